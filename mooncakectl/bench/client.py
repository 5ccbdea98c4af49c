"""One streamed request against an OpenAI-compatible server, and probing the server.

The client relies on nothing but the OpenAI API. Where the server offers
more, it is used: ``ignore_eos`` (vLLM's and ours) so outputs have the asked
length, ``prompt`` as token ids, ``usage.prompt_tokens_details.cached_tokens``
and the ``x-mooncaked-prefill-node`` / ``x-mooncaked-decode-node`` headers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from mooncakectl.bench.metrics import REJECTED, RequestRecord
from mooncakectl.bench.workloads import BenchRequest
from mooncakectl.client import DaemonError, DaemonUnreachable
from mooncaked.wire.headers import (
    DECODE_NODE_HEADER,
    MODEL_TBT_HEADER,
    MODEL_TTFT_HEADER,
    PREDICTED_TBT_HEADER,
    PREDICTED_TTFT_HEADER,
    PREFILL_NODE_HEADER,
)

API_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Error messages kept per record: enough to tell errors apart, not whole pages.
_MAX_ERROR_CHARS = 300


def base_url(text: str, flag: str = "--url") -> str:
    """``text`` as a server's base URL (``http://`` when it names no scheme,
    no trailing slash); ValueError naming ``flag`` and the value if it is
    not an http(s) URL of a host."""
    url = text.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    bad = ValueError(f"{flag}: {text!r} is not an http(s) URL of a server")
    try:
        parts = urlsplit(url)
        # Reading the port checks it: ValueError for one that is not a number.
        _ = parts.port
    except ValueError:
        raise bad from None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.query
        or parts.fragment
        or any(c.isspace() for c in url)
    ):
        raise bad
    return url


def parse_entries(text: str) -> list[str]:
    """``--entries URL[,URL...]``: the base URLs, each checked, none twice."""
    urls: list[str] = []
    for part in text.split(","):
        url = base_url(part, "--entries")
        if url in urls:
            raise ValueError(f"--entries: {part.strip()!r} is given twice")
        urls.append(url)
    return urls


@dataclass(frozen=True, slots=True)
class ServerInfo:
    model: str
    max_model_len: int | None
    vocab_size: int | None


def _header_ms(v: str | None) -> float | None:
    try:
        return float(v) if v else None
    except ValueError:
        return None


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _error_text(raw: bytes) -> str:
    try:
        msg = str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        msg = raw.decode("utf-8", errors="replace").strip()
    return msg[:_MAX_ERROR_CHARS]


def _error_code(raw: bytes) -> str | None:
    """The OpenAI error's ``code`` (mooncaked's rejections say why: ``ttft_slo``...)."""
    try:
        code = json.loads(raw)["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return None if code is None else str(code)


async def probe_server(
    session: aiohttp.ClientSession, base_url: str, model: str | None, timeout_s: float
) -> ServerInfo:
    """The served model and its limits from ``/v1/models``. An unreachable
    server raises DaemonUnreachable at once, before any load is generated."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(base_url + "/v1/models", timeout=timeout) as resp:
            status = resp.status
            body = await resp.read()
    except (aiohttp.ClientConnectionError, TimeoutError) as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
        raise DaemonUnreachable(base_url, reason) from None
    entries: list[dict[str, Any]] = []
    if status == 200:
        try:
            data = json.loads(body).get("data")
            entries = [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []
        except (ValueError, AttributeError):
            entries = []
    if model is None:
        if status != 200:
            # Not ready yet (503 while a model loads), or no such endpoint.
            raise DaemonError(status, f"GET /v1/models: {_error_text(body)}; or pass --model")
        if not entries or not isinstance(entries[0].get("id"), str):
            raise DaemonError(status, f"{base_url}/v1/models lists no model; pass --model")
        model = str(entries[0]["id"])
    entry = next((e for e in entries if e.get("id") == model), {})
    return ServerInfo(
        model, _int_or_none(entry.get("max_model_len")), _int_or_none(entry.get("vocab_size"))
    )


async def accepts_token_ids(
    session: aiohttp.ClientSession, base_url: str, model: str, timeout_s: float
) -> bool:
    """Whether ``/v1/completions`` takes a prompt of token ids (one tiny request)."""
    body = {"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 1, "stream": False}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.post(
            base_url + API_PATHS["completions"], json=body, timeout=timeout
        ) as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientConnectionError, TimeoutError) as exc:
        raise DaemonUnreachable(base_url, str(exc) or type(exc).__name__) from None


# Two-letter pieces, so a made-up word is a token or two in most vocabularies.
_PIECES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def synthetic_text(ids: Sequence[int]) -> str:
    """Deterministic words for token ids, for servers that take only text and
    when no tokenizer is given: equal ids give equal words, so shared
    prefixes stay shared (their token counts are approximate)."""
    n = len(_PIECES)
    return " ".join(_PIECES[t % n] + _PIECES[(t // n) % n] for t in ids)


def tokenizer_text(path: str) -> tuple[Callable[[Sequence[int]], str], int]:
    """Decoding with a tokenizer.json (the ``tokenizers`` package), and its vocabulary size."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises its own exception type
        raise ValueError(f"--tokenizer {path!r}: cannot load it ({exc})") from None
    return (lambda ids: tok.decode(list(ids), skip_special_tokens=False)), tok.get_vocab_size()


@dataclass(frozen=True, slots=True)
class Endpoint:
    base_url: str
    model: str
    # "completions" or "chat".
    api: str = "completions"
    # "ids" (token ids in the prompt) or "text".
    prompt_format: str = "ids"
    ignore_eos: bool = True
    timeout_s: float = 600.0
    # Keep the output text in the record (to compare greedy outputs).
    keep_text: bool = False


def request_body(
    ep: Endpoint, req: BenchRequest, text_of: Callable[[Sequence[int]], str]
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": ep.model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ep.ignore_eos:
        body["ignore_eos"] = True
    if ep.api == "chat":
        body["messages"] = [{"role": "user", "content": text_of(req.prompt_ids)}]
    elif ep.prompt_format == "ids":
        body["prompt"] = list(req.prompt_ids)
    else:
        body["prompt"] = text_of(req.prompt_ids)
    return body


def _chunk_has_output(obj: dict[str, Any], chat: bool) -> bool:
    choices = obj.get("choices")
    if not choices or not isinstance(choices, list):
        return False
    if not chat:
        # vLLM counts every completions chunk with a choice as output.
        return True
    delta = choices[0].get("delta") or {}
    return bool(delta.get("content"))


def _chunk_text(obj: dict[str, Any], chat: bool) -> str:
    choice = obj["choices"][0]
    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    return text if isinstance(text, str) else ""


def _read_usage(rec: RequestRecord, usage: dict[str, Any]) -> None:
    if isinstance(v := usage.get("prompt_tokens"), int):
        rec.prompt_tokens = v
    if isinstance(v := usage.get("completion_tokens"), int):
        rec.output_tokens = v
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(v := details.get("cached_tokens"), int):
        rec.cached_tokens = v


async def send_request(
    session: aiohttp.ClientSession,
    ep: Endpoint,
    req: BenchRequest,
    rec: RequestRecord,
    clock: Callable[[], float],
    text_of: Callable[[Sequence[int]], str],
) -> None:
    """Sends ``req`` and fills ``rec`` in; never raises for what the server
    or the network did (that is recorded as the request's error)."""
    chat = ep.api == "chat"
    body = request_body(ep, req, text_of)
    timeout = aiohttp.ClientTimeout(total=ep.timeout_s)
    rec.entry = ep.base_url
    rec.start_s = clock()
    try:
        async with session.post(
            ep.base_url + API_PATHS[ep.api], json=body, timeout=timeout
        ) as resp:
            rec.status = resp.status
            rec.prefill_node = resp.headers.get(PREFILL_NODE_HEADER)
            rec.decode_node = resp.headers.get(DECODE_NODE_HEADER)
            rec.predicted_ttft_ms = _header_ms(resp.headers.get(PREDICTED_TTFT_HEADER))
            rec.predicted_tbt_ms = _header_ms(resp.headers.get(PREDICTED_TBT_HEADER))
            rec.model_ttft_ms = _header_ms(resp.headers.get(MODEL_TTFT_HEADER))
            rec.model_tbt_ms = _header_ms(resp.headers.get(MODEL_TBT_HEADER))
            if resp.status != 200:
                raw = await resp.read()
                rec.end_s = clock()
                rec.error = _error_text(raw)
                rec.error_code = _error_code(raw)
                if resp.status == 429:
                    rec.error_kind = REJECTED
                    retry = resp.headers.get("Retry-After", "")
                    rec.retry_after_s = float(retry) if retry.isdigit() else None
                else:
                    rec.error_kind = f"http_{resp.status}"
                return
            await _read_stream(resp, rec, clock, chat, ep.keep_text)
    except TimeoutError:
        rec.error_kind, rec.error = "timeout", f"no complete answer within {ep.timeout_s} s"
    except aiohttp.ClientError as exc:
        rec.error_kind = "connection"
        rec.error = (str(exc) or type(exc).__name__)[:_MAX_ERROR_CHARS]


async def _read_stream(
    resp: aiohttp.ClientResponse,
    rec: RequestRecord,
    clock: Callable[[], float],
    chat: bool,
    keep_text: bool,
) -> None:
    done = False
    if keep_text:
        rec.text = ""
    async for raw_line in resp.content:
        now = clock()
        line = raw_line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        try:
            obj = json.loads(data)
        except ValueError:
            rec.error_kind, rec.error = "stream", f"not JSON in the stream: {data[:80]!r}"
            return
        if not isinstance(obj, dict):
            continue
        if "error" in obj:
            rec.error_kind = "stream"
            err = obj["error"]
            rec.error = str(err.get("message") if isinstance(err, dict) else err)[:_MAX_ERROR_CHARS]
            return
        if _chunk_has_output(obj, chat):
            rec.chunk_s.append(now)
            if rec.text is not None:
                rec.text += _chunk_text(obj, chat)
        if isinstance(usage := obj.get("usage"), dict):
            _read_usage(rec, usage)
    if not done:
        rec.error_kind, rec.error = "stream", "the stream ended without [DONE]"
        return
    # vLLM's E2EL ends at the last output chunk; a reply without one ends here.
    rec.end_s = rec.chunk_s[-1] if rec.chunk_s else clock()
