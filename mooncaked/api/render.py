"""Rendering of the public API's answers: JSON bodies, server-sent events,
OpenAI's completion and chat shapes, and the headers saying where a request ran.

Pure functions of what the engine produced (``RequestOutput``s) and what the
client asked for; the handlers (``api.openai``) decide when to send what.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from mooncaked.cluster.placement import Placement
from mooncaked.request import FinishReason, RequestOutput, TokenLogprob
from mooncaked.wire import headers

# The last event of every stream.
SSE_DONE = b"data: [DONE]\n\n"


def json_response(
    data: Any, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(data),
        status=status,
        headers=headers,
        content_type="application/json",
    )


def sse_event(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def placement_headers(
    prefill_node: str | None, decode_node: str | None, placement: Placement | None
) -> dict[str, str]:
    """The nodes that ran (or will run) each phase, and the Conductor's
    forecasts in milliseconds where it made them."""
    out = {
        headers.PREFILL_NODE_HEADER: prefill_node or "",
        headers.DECODE_NODE_HEADER: decode_node or "",
    }
    p = placement
    if p is None:
        return out
    for name, seconds in (
        (headers.PREDICTED_TTFT_HEADER, p.predicted_ttft_s),
        (headers.PREDICTED_TBT_HEADER, p.predicted_tbt_s),
        (headers.MODEL_TTFT_HEADER, p.model_ttft_s),
        (headers.MODEL_TBT_HEADER, p.model_tbt_s),
    ):
        if seconds > 0.0:
            out[name] = f"{seconds * 1e3:.2f}"
    return out


@dataclass(slots=True)
class Reply:
    """Accumulates outputs of one request and renders OpenAI's shapes."""

    request_id: str
    model: str
    created: int
    chat: bool
    num_prompt_tokens: int
    # How to report logprobs: None (not asked), "completion" or "chat".
    logprobs_style: str | None
    # Streams end with a usage chunk (stream_options.include_usage).
    include_usage: bool
    token_str: Callable[[int], str]
    text: str = ""
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    # Completions logprobs are column-wise, chat's row-wise; both kept here.
    lp_rows: list[TokenLogprob] | None = None

    def __post_init__(self) -> None:
        self.lp_rows = [] if self.logprobs_style else None

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.num_output_tokens += len(out.new_token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if self.lp_rows is not None:
            self.lp_rows.extend(out.logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason
        if out.error is not None:
            self.error = out.error

    @property
    def _object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def usage(self) -> dict[str, Any]:
        num_prompt = self.num_prompt_tokens
        return {
            "prompt_tokens": num_prompt,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": num_prompt + self.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }

    def _finish(self) -> str | None:
        return None if self.finish_reason is None else self.finish_reason.openai

    def _logprobs(self, rows: list[TokenLogprob]) -> dict[str, Any] | None:
        style = self.logprobs_style
        if style is None:
            return None
        ts = self.token_str
        if style == "chat":
            return {
                "content": [
                    {
                        "token": ts(r.token_id),
                        "logprob": r.logprob,
                        "bytes": list(ts(r.token_id).encode()),
                        "top_logprobs": [
                            {"token": ts(t), "logprob": lp, "bytes": list(ts(t).encode())}
                            for t, lp in r.top
                        ],
                    }
                    for r in rows
                ]
            }
        tokens = [ts(r.token_id) for r in rows]
        offsets, pos = [], 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [r.logprob for r in rows],
            "top_logprobs": [{ts(t): lp for t, lp in r.top} for r in rows],
            "text_offset": offsets,
        }

    def final(self) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": self.text}
        else:
            choice["text"] = self.text
        choice["logprobs"] = self._logprobs(self.lp_rows or [])
        choice["finish_reason"] = self._finish()
        return {
            "id": self.request_id,
            "object": self._object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        }

    def chunk(self, out: RequestOutput | None = None, *, role: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        text = out.text if out is not None else ""
        if self.chat:
            choice["delta"] = (
                {"role": "assistant", "content": ""}
                if role
                else ({"content": text} if text else {})
            )
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(out.logprobs) if out is not None else None
        choice["finish_reason"] = (
            out.finish_reason.openai
            if out is not None and out.finished and out.finish_reason
            else None
        )
        chunk: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(),
        }
