"""Parsing of the public API's request bodies: completions and chat.

Pure functions from a JSON body (and the model's limits) to checked values:
no request, no engine, no I/O, so every rule here is tested without a
server. Tokenizing is the handlers' (``api.openai``): they turn the prompt
this module extracts into token ids and hand those back for the checks that
need the count. Each refusal is an ``ApiError`` (400, 404) naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mooncaked.api.errors import ApiError, bad_param
from mooncaked.api.limits import MAX_CHARS_PER_TOKEN, brief, type_name
from mooncaked.cluster.slo import Slo
from mooncaked.handoff import MAX_REPLICAS, MAX_RETAIN_S, Retain
from mooncaked.request import SamplingParams

# The most top alternatives a request may ask for (SamplingParams' own limit).
MAX_TOP_LOGPROBS = 20
# OpenAI's limit on stop sequences.
MAX_STOP = 4
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(body: dict[str, Any], key: str, default: int | None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise bad_param(key, f"'{key}' must be an integer, got {type_name(v)} {brief(v)}")
    return v


def _number(body: dict[str, Any], key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not _is_number(v):
        raise bad_param(key, f"'{key}' must be a number, got {type_name(v)} {brief(v)}")
    return float(v)


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_param(key, f"'{key}' must be a boolean, got {type_name(v)} {brief(v)}")
    return v


def _unsupported(body: dict[str, Any], key: str, allowed: tuple[Any, ...], what: str) -> None:
    v = body.get(key)
    if v is not None and v not in allowed:
        raise bad_param(key, f"'{key}' is not supported by mooncaked ({what})")


@dataclass(frozen=True, slots=True)
class Parsed:
    """What a completion or chat body asks for, checked."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    # How to report logprobs: None (not asked), "completion" or "chat".
    logprobs_style: str | None
    # The request's own latency targets ("slo": {"ttft_ms", "tbt_ms"}); None: the node's.
    slo: Slo | None = None
    # Keep the prompt's KV ("cache": {"retain_s", "replicas"}); None: cache as usual.
    retain: Retain | None = None


def parse_slo(body: dict[str, Any]) -> Slo | None:
    """A request's ``"slo": {"ttft_ms", "tbt_ms"}``; ApiError (400) naming a bad value."""
    v = body.get("slo")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad_param("slo", f"'slo' must be an object, got {type_name(v)} {brief(v)}")
    unknown = sorted(set(v) - {"ttft_ms", "tbt_ms"})
    if unknown:
        raise bad_param("slo", f"'slo' has unknown fields {unknown}; use ttft_ms and tbt_ms")
    ttft = _number(v, "ttft_ms", 0.0)
    tbt = _number(v, "tbt_ms", 0.0)
    for key, ms in (("ttft_ms", ttft), ("tbt_ms", tbt)):
        if not 0.0 <= ms <= 3_600_000.0:
            raise bad_param("slo", f"'slo.{key}' must be in [0, 3600000] ms, got {ms}")
    return Slo(ttft / 1e3, tbt / 1e3)


def parse_cache(body: dict[str, Any]) -> Retain | None:
    """A request's ``"cache": {"retain_s", "replicas"}``: keep the prompt's KV
    for ``retain_s`` seconds (soft-pinned) on ``replicas`` nodes (default 1);
    ApiError (400) naming the bad value."""
    v = body.get("cache")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad_param("cache", f"'cache' must be an object, got {type_name(v)} {brief(v)}")
    unknown = sorted(set(v) - {"retain_s", "replicas"})
    if unknown:
        raise bad_param("cache", f"'cache' has unknown fields {unknown}; use retain_s and replicas")
    retain_s = v.get("retain_s")
    if retain_s is None:
        raise bad_param("cache.retain_s", "'cache.retain_s' is required: seconds to keep the KV")
    if not _is_number(retain_s) or not 0.0 < retain_s <= MAX_RETAIN_S:
        raise bad_param(
            "cache.retain_s",
            f"'cache.retain_s' must be a number of seconds in (0, {MAX_RETAIN_S:g}], "
            f"got {brief(retain_s)}",
        )
    replicas = v.get("replicas", 1)
    if not _is_int(replicas) or not 1 <= replicas <= MAX_REPLICAS:
        raise bad_param(
            "cache.replicas",
            f"'cache.replicas' must be an integer in [1, {MAX_REPLICAS}], got {brief(replicas)}",
        )
    return Retain(float(retain_s), replicas)


def check_model(body: dict[str, Any], served: str) -> None:
    """A body's ``model``, when it names one, must be the one this node serves (404)."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_param("model", f"'model' must be a string, got {type_name(model)}")
    if model != served:
        raise ApiError(
            404,
            f"the model '{model}' does not exist; this node serves '{served}'",
            param="model",
            code="model_not_found",
        )


def parse_generation(
    body: dict[str, Any],
    prompt_token_ids: list[int],
    stream: tuple[bool, bool],
    *,
    chat: bool,
    max_model_len: int,
) -> Parsed:
    """The rest of a body once its prompt is tokenized: limits, sampling, SLO.
    ``stream`` is ``parse_stream(body)``, checked before the prompt."""
    if chat:
        max_tokens, max_key, logprobs = _chat_limits(body)
    else:
        max_tokens, max_key, logprobs = _completion_limits(body)
    if max_tokens is not None and max_tokens < 1:
        raise bad_param(max_key, f"'{max_key}' must be at least 1, got {max_tokens}")
    max_tokens = _fit_context(
        len(prompt_token_ids), max_tokens, max_key, max_model_len, "messages" if chat else "prompt"
    )
    return Parsed(
        prompt_token_ids=prompt_token_ids,
        sampling=_parse_sampling(body, max_tokens=max_tokens, logprobs=logprobs),
        stream=stream[0],
        include_usage=stream[1],
        logprobs_style=None if logprobs is None else ("chat" if chat else "completion"),
        slo=parse_slo(body),
        retain=parse_cache(body),
    )


def _chat_limits(body: dict[str, Any]) -> tuple[int | None, str, int | None]:
    """(max_tokens, the key it came from, logprobs) of a chat body."""
    max_tokens = _int(body, "max_completion_tokens", None)
    max_key = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_key = _int(body, "max_tokens", None), "max_tokens"
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None)
    if top is not None and not want_logprobs:
        raise bad_param("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_param(
            "top_logprobs", f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {top}"
        )
    for key in ("tools", "functions"):
        if body.get(key):
            raise bad_param(key, f"'{key}' (tool calling) is not supported by mooncaked")
    return max_tokens, max_key, (top or 0) if want_logprobs else None


def _completion_limits(body: dict[str, Any]) -> tuple[int | None, str, int | None]:
    """(max_tokens, the key it came from, logprobs) of a completion body."""
    max_tokens = _int(body, "max_tokens", 16)
    logprobs = _int(body, "logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad_param(
            "logprobs", f"'logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}"
        )
    _unsupported(body, "echo", (False,), "only false")
    _unsupported(body, "best_of", (1,), "only 1")
    _unsupported(body, "suffix", ("",), "no insertion")
    return max_tokens, "max_tokens", logprobs


def _fit_context(
    num_prompt: int, max_tokens: int | None, max_key: str, limit: int, prompt_param: str
) -> int:
    """``max_tokens`` checked against the context (None, chat's default: the rest of it)."""
    if max_tokens is None:
        max_tokens = limit - num_prompt
        if max_tokens < 1:
            raise ApiError(
                400,
                f"the prompt has {num_prompt} tokens, which leaves no room to generate within "
                f"the model's context length of {limit} tokens; shorten the messages",
                param=prompt_param,
                code="context_length_exceeded",
            )
    elif num_prompt + max_tokens > limit:
        raise ApiError(
            400,
            f"the model's context length is {limit} tokens, but {num_prompt + max_tokens} were "
            f"requested ({num_prompt} in the prompt, {max_tokens} for the completion); "
            f"shorten the prompt or lower {max_key}",
            param=prompt_param,
            code="context_length_exceeded",
        )
    return max_tokens


def _parse_sampling(
    body: dict[str, Any], *, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    if max_tokens is not None and max_tokens < 1:
        raise bad_param("max_tokens", f"'max_tokens' must be at least 1, got {max_tokens}")
    temperature = _number(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise bad_param("temperature", f"'temperature' must be in [0, 2], got {temperature}")
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad_param("top_p", f"'top_p' must be in (0, 1], got {top_p}")
    top_k_raw = _int(body, "top_k", None)
    top_k = 0 if top_k_raw is None else top_k_raw
    if top_k == -1:  # vLLM's spelling of "off"
        top_k = 0
    if top_k < 0:
        raise bad_param("top_k", f"'top_k' must be >= 0 (0 or -1: off), got {top_k}")
    seed = _int(body, "seed", None)

    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,)
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = tuple(stop_raw)
    else:
        raise bad_param("stop", "'stop' must be a string or an array of strings")
    if len(stop) > MAX_STOP:
        raise bad_param("stop", f"'stop' takes at most {MAX_STOP} sequences, got {len(stop)}")
    if any(not s for s in stop):
        raise bad_param("stop", "'stop' sequences must not be empty")

    stop_ids_raw = body.get("stop_token_ids")
    if stop_ids_raw is None:
        stop_token_ids: tuple[int, ...] = ()
    elif isinstance(stop_ids_raw, list) and all(_is_int(t) and t >= 0 for t in stop_ids_raw):
        stop_token_ids = tuple(stop_ids_raw)
    else:
        raise bad_param("stop_token_ids", "'stop_token_ids' must be an array of token ids (>= 0)")

    n = _int(body, "n", 1)
    if n != 1:
        raise bad_param("n", f"'n' must be 1: mooncaked returns one choice per request, got {n}")
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key, 0.0) != 0.0:
            raise bad_param(key, f"'{key}' is not supported by mooncaked (only 0)")
    logit_bias = body.get("logit_bias")
    if logit_bias:
        raise bad_param("logit_bias", "'logit_bias' is not supported by mooncaked")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_param("user", f"'user' must be a string, got {type_name(user)}")
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else 16,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=_bool(body, "ignore_eos", False),
            logprobs=logprobs,
        )
    except ValueError as exc:  # a limit of SamplingParams this layer does not check itself
        raise ApiError(400, str(exc)) from None


def parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage``."""
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad_param("stream_options", "'stream_options' is only allowed with stream: true")
        if not isinstance(opts, dict):
            raise bad_param("stream_options", "'stream_options' must be an object")
        include_usage = _bool(opts, "include_usage", False)
    return stream, include_usage


def _check_token_ids(ids: list[Any], param: str, vocab_size: int | None) -> list[int]:
    for t in ids:
        if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
            limit = f" below {vocab_size}" if vocab_size is not None else ""
            raise bad_param(
                param, f"'{param}' token ids must be integers >= 0{limit}, got {brief(t)}"
            )
    return ids


def completion_prompt(body: dict[str, Any], vocab_size: int | None) -> str | list[int]:
    """A completion body's prompt: text to tokenize, or token ids (each below
    ``vocab_size`` when it is known)."""
    prompt = body.get("prompt")
    # One-element batches are what some clients send for a single prompt.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return _check_token_ids(prompt, "prompt", vocab_size)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad_param(
            "prompt",
            "'prompt' must be one string or one array of token ids: "
            "batches of prompts are not supported, send one request per prompt",
        )
    if prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt", code="missing_required")
    raise bad_param(
        "prompt", f"'prompt' must be a string or an array of token ids, got {type_name(prompt)}"
    )


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """A chat body's messages as ``{"role", "content"}`` with text content, for
    the chat template; text parts of a content array are joined."""
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is required", param="messages", code="missing_required")
    if not isinstance(messages, list) or not messages:
        raise bad_param("messages", "'messages' must be a non-empty array of messages")
    norm: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_param(param, f"'{param}' must be an object")
        role = m.get("role")
        # isinstance first: an array or object is unhashable, so not a set member.
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad_param(
                f"{param}.role",
                f"'{param}.role' must be one of {sorted(CHAT_ROLES)}, got {brief(role)}",
            )
        norm.append({"role": role, "content": _content_text(m.get("content"), param)})
    return norm


def _content_text(content: Any, param: str) -> str:
    """A message's content as text: a string, or the text parts of an array."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_param(f"{param}.content", f"'{param}.content' must be a string or an array")
    parts = []
    for part in content:
        if not (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            raise bad_param(
                f"{param}.content",
                f"'{param}.content' parts must be text parts "
                '({"type": "text", "text": ...}); other kinds are not supported',
            )
        parts.append(part["text"])
    return "".join(parts)


def check_chars(num_chars: int, max_model_len: int, param: str) -> None:
    """Before tokenizing: a text this long cannot fit the context whatever the
    tokenizer, and tokenizing it would stall the loop and grow memory for nothing."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if num_chars > limit:
        raise ApiError(
            400,
            f"the prompt has {num_chars} characters, more than could fit the model's context "
            f"length of {max_model_len} tokens (at most {limit} characters); "
            f"shorten the {param}",
            param=param,
            code="context_length_exceeded",
        )
