"""The wire forms of ``mooncaked.request``'s values: sampling parameters,
token logprobs, and the output lines a decode node streams back.

``request.py`` stays free of wire formats; these are the one encoder and
the one decoder of each.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import orjson

from mooncaked.request import FinishReason, RequestOutput, SamplingParams, TokenLogprob
from mooncaked.wire import fields
from mooncaked.wire.paths import MAX_PROMPT_TOKENS

# Longest request id an output names: the entry's id and a resume suffix.
_MAX_REQUEST_ID = 512


def decode_prompt(raw: Any, name: str = "prompt_token_ids") -> list[int]:
    """A call's prompt: 1..MAX_PROMPT_TOKENS token ids."""
    return fields.integers(raw, name, lo=None, min_len=1, max_len=MAX_PROMPT_TOKENS)


def encode_sampling(sp: SamplingParams) -> dict[str, Any]:
    """Every field by its name, as JSON values: what ``decode_sampling`` takes."""
    return dataclasses.asdict(sp) | {
        "stop": list(sp.stop),
        "stop_token_ids": list(sp.stop_token_ids),
    }


def decode_sampling(raw: Any, name: str = "sampling") -> SamplingParams:
    """ValueError naming the field (``'sampling.top_p'``) when ``raw`` is not
    a sampling object; absent fields take SamplingParams' defaults."""
    d = fields.obj(raw, name)
    unknown = set(d) - set(SamplingParams.__dataclass_fields__)
    if unknown:
        raise ValueError(f"{name!r} has unknown fields {sorted(unknown)}")
    stop = d.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise fields.refuse(f"{name}.stop", "a list of strings", stop)
    seed, logprobs = d.get("seed"), d.get("logprobs")
    return SamplingParams(
        max_tokens=fields.integer(d.get("max_tokens", 16), f"{name}.max_tokens", 1),
        temperature=fields.number(d.get("temperature", 1.0), f"{name}.temperature", 0.0, 2.0),
        top_k=fields.integer(d.get("top_k", 0), f"{name}.top_k"),
        top_p=fields.number(d.get("top_p", 1.0), f"{name}.top_p", 0.0, 1.0, above=True),
        seed=None if seed is None else fields.integer(seed, f"{name}.seed", None),
        stop=tuple(stop),
        stop_token_ids=tuple(
            fields.integers(d.get("stop_token_ids", []), f"{name}.stop_token_ids", lo=None)
        ),
        ignore_eos=fields.flag(d.get("ignore_eos", False), f"{name}.ignore_eos"),
        logprobs=None if logprobs is None else fields.integer(logprobs, f"{name}.logprobs", 0, 20),
    )


def encode_logprob(lp: TokenLogprob) -> list[Any]:
    return [lp.token_id, lp.logprob, [[t, v] for t, v in lp.top]]


def decode_logprob(raw: Any, name: str = "logprob") -> TokenLogprob:
    """``[token_id, logprob, [[token_id, logprob], ...]]``; ValueError naming ``name``."""
    want = "[token_id, logprob, [[token_id, logprob], ...]]"
    if not isinstance(raw, list) or len(raw) != 3 or not isinstance(raw[2], list):
        raise fields.refuse(name, want, raw)
    top: list[tuple[int, float]] = []
    for pair in raw[2]:
        if not isinstance(pair, list) or len(pair) != 2:
            raise fields.refuse(name, want, raw)
        top.append((_token(pair[0], name), _logprob(pair[1], name)))
    return TokenLogprob(_token(raw[0], name), _logprob(raw[1], name), top)


def _token(raw: Any, name: str) -> int:
    return fields.integer(raw, f"{name}.token_id")


def _logprob(raw: Any, name: str) -> float:
    return fields.number(raw, f"{name}.logprob", -math.inf)


def encode_output(out: RequestOutput) -> bytes:
    """One line of a generate call's answer (NDJSON, newline included)."""
    doc = {
        "request_id": out.request_id,
        "new_token_ids": out.new_token_ids,
        "text": out.text,
        "finished": out.finished,
        "finish_reason": out.finish_reason.value if out.finish_reason else None,
        "logprobs": [encode_logprob(lp) for lp in out.logprobs],
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_cached_tokens": out.num_cached_tokens,
        "num_output_tokens": out.num_output_tokens,
        "error": out.error,
        "prefill_node": out.prefill_node,
    }
    return orjson.dumps(doc) + b"\n"


def decode_output(line: bytes) -> RequestOutput:
    """An output line back; ValueError naming the field when it is not one a node sent."""
    d = fields.loads(line, "an output line")
    reason = d.get("finish_reason")
    try:
        finish = None if reason is None else FinishReason(reason)
    except ValueError:
        raise fields.refuse(
            "finish_reason", f"one of {[r.value for r in FinishReason]} or null", reason
        ) from None
    logprobs = d.get("logprobs") or []
    if not isinstance(logprobs, list):
        raise fields.refuse("logprobs", "a list", logprobs)
    return RequestOutput(
        request_id=fields.text(d.get("request_id"), "request_id", _MAX_REQUEST_ID),
        new_token_ids=fields.integers(d.get("new_token_ids"), "new_token_ids"),
        text=fields.text(d.get("text"), "text", 1 << 24, empty=True),
        finished=fields.flag(d.get("finished"), "finished"),
        finish_reason=finish,
        logprobs=[decode_logprob(x, f"logprobs[{i}]") for i, x in enumerate(logprobs)],
        num_prompt_tokens=fields.integer(d.get("num_prompt_tokens", 0), "num_prompt_tokens"),
        num_cached_tokens=fields.integer(d.get("num_cached_tokens", 0), "num_cached_tokens"),
        num_output_tokens=fields.integer(d.get("num_output_tokens", 0), "num_output_tokens"),
        error=fields.optional_text(d.get("error"), "error", 1 << 16),
        prefill_node=fields.optional_text(d.get("prefill_node"), "prefill_node"),
    )
