"""OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models.

A handler turns one JSON body into prompt token ids and ``SamplingParams``,
hands them to the engine and relays ``RequestOutput``s, either as one JSON
answer or as server-sent events (``data: {...}`` chunks ending in
``data: [DONE]``). Every request that reached the engine is closed in a
``finally``: a client that goes away (the server runs with handler
cancellation, so a lost connection cancels the handler) gets its request
aborted and its KV blocks freed.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
so OpenAI clients show the message.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
import structlog
from aiohttp import web

from mooncaked.api.limits import (
    MAX_CHARS_PER_TOKEN,
    OFFLOOP_TOKENIZE_CHARS,
    BadBody,
    brief,
    read_json_object,
    type_name,
)
from mooncaked.api.metrics import ApiMetrics
from mooncaked.api.recent import FinishedRequest
from mooncaked.cache.hashing import block_hashes
from mooncaked.cluster.slo import Slo
from mooncaked.request import FinishReason, RequestOutput, SamplingParams, TokenLogprob
from mooncaked.router import RouteError, Router, Submission
from mooncaked.wire.headers import (
    DECODE_NODE_HEADER,
    MODEL_TBT_HEADER,
    MODEL_TTFT_HEADER,
    PREDICTED_TBT_HEADER,
    PREDICTED_TTFT_HEADER,
    PREFILL_NODE_HEADER,
)

if TYPE_CHECKING:
    from mooncaked.engine.core import EngineCore

log = structlog.get_logger(__name__)

# The most top alternatives a request may ask for (SamplingParams' own limit).
MAX_TOP_LOGPROBS = 20
# OpenAI's limit on stop sequences.
MAX_STOP = 4
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class ApiError(Exception):
    """An answer other than 200, in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return json_response(self.body(), status=self.status, headers=self.headers)


def bad_param(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def json_response(
    data: Any, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(data),
        status=status,
        headers=headers,
        content_type="application/json",
    )


class Gate:
    """Admits generation requests and counts them, so a drain can wait for them.

    ``close()`` starts a drain: new requests get 503 while those already
    admitted run on; ``wait_idle()`` returns once none is left.
    """

    def __init__(self) -> None:
        self._num_inflight = 0
        self._closed = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_inflight(self) -> int:
        return self._num_inflight

    def close(self) -> None:
        self._closed = True

    async def wait_idle(self) -> None:
        await self._idle.wait()

    @contextmanager
    def admit(self) -> Iterator[None]:
        if self._closed:
            raise ApiError(
                503,
                "mooncaked is shutting down and accepts no new requests; retry on another node",
                type="service_unavailable",
                code="draining",
            )
        self._num_inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._num_inflight -= 1
            if self._num_inflight == 0:
                self._idle.set()


# ---------------------------------------------------------------- validation


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


@dataclass(slots=True)
class Parsed:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    # How to report logprobs: None (not asked), "completion" or "chat".
    logprobs_style: str | None
    # The request's own latency targets ("slo": {"ttft_ms", "tbt_ms"}); None: the node's.
    slo: Slo | None = None


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


def _parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
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


# ------------------------------------------------------------------- the API


def _prediction_headers(sub: Submission) -> dict[str, str]:
    p = sub.placement
    out: dict[str, str] = {}
    if p is not None and p.predicted_ttft_s > 0.0:
        out[PREDICTED_TTFT_HEADER] = f"{p.predicted_ttft_s * 1e3:.2f}"
    if p is not None and p.predicted_tbt_s > 0.0:
        out[PREDICTED_TBT_HEADER] = f"{p.predicted_tbt_s * 1e3:.2f}"
    if p is not None and p.model_ttft_s > 0.0:
        out[MODEL_TTFT_HEADER] = f"{p.model_ttft_s * 1e3:.2f}"
    if p is not None and p.model_tbt_s > 0.0:
        out[MODEL_TBT_HEADER] = f"{p.model_tbt_s * 1e3:.2f}"
    return out


@contextmanager
def _mapped_errors(chat: bool) -> Iterator[None]:
    """The engine's and the router's refusals as OpenAI-shaped answers."""
    from mooncaked.engine.core import (
        EngineClosedError,
        EngineFailedError,
        PromptTooLongError,
        QueueFullError,
    )

    try:
        yield
    except EngineFailedError:
        raise ApiError(
            503,
            "this mooncaked node failed and is restarting; retry on another node",
            type="service_unavailable",
            code="engine_failed",
        ) from None
    except EngineClosedError:
        raise ApiError(
            503,
            "mooncaked is shutting down and accepts no new requests; retry on another node",
            type="service_unavailable",
            code="draining",
        ) from None
    except QueueFullError as exc:
        retry = max(1, math.ceil(exc.retry_after_s))
        raise ApiError(
            429,
            f"mooncaked is overloaded: {exc}; retry after {retry} s",
            type="rate_limit_exceeded",
            code="queue_full",
            headers={"Retry-After": str(retry)},
        ) from None
    except PromptTooLongError as exc:
        raise ApiError(
            400,
            str(exc),
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        ) from None
    except RouteError as exc:
        if exc.status == 429:
            retry = max(1, math.ceil(exc.retry_after_s or 1.0))
            what = (
                "mooncaked cannot meet the latency target"
                if exc.code in ("ttft_slo", "tbt_slo")
                else "mooncaked is overloaded"
            )
            raise ApiError(
                429,
                f"{what}: {exc.message}; retry after {retry} s",
                type="rate_limit_exceeded",
                code=exc.code or "queue_full",
                headers={"Retry-After": str(retry)},
            ) from None
        if exc.status == 400:
            raise ApiError(400, exc.message, param="messages" if chat else "prompt") from None
        raise ApiError(
            503 if exc.status >= 500 else exc.status,
            exc.message,
            type="service_unavailable",
            code="no_capacity",
        ) from None
    except ValueError as exc:  # the engine's own checks of the prompt
        raise ApiError(400, str(exc), param="messages" if chat else "prompt") from None


class OpenAIAPI:
    """Handlers of the /v1 routes over one engine.

    ``engine`` is a callable because the engine is built after the server
    starts listening (so /health answers while the model loads); until then
    the /v1 routes answer 503.
    """

    def __init__(
        self,
        engine: Callable[[], EngineCore | None],
        metrics: ApiMetrics,
        gate: Gate,
        clock: Callable[[], float] = time.monotonic,
        *,
        router: Router,
    ) -> None:
        """``router`` runs each request where the cluster's placement says
        (this node's engine, or another node's)."""
        self._router = router
        self._engine = engine
        self._metrics = metrics
        self._gate = gate
        self._clock = clock
        # Called with each generation request once it ends (e.g. the node's
        # recent-request ring); append before the server starts.
        self.finished_listeners: list[Callable[[FinishedRequest], None]] = []

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
        ]

    def _require_engine(self) -> EngineCore:
        engine = self._engine()
        if engine is None:
            raise ApiError(
                503,
                "the model is still loading; retry shortly",
                type="service_unavailable",
                code="model_loading",
            )
        return engine

    # ------------------------------------------------------------ handlers

    async def models(self, request: web.Request) -> web.Response:
        engine = self._require_engine()
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": engine.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "mooncaked",
                        "max_model_len": engine.max_model_len,
                    }
                ],
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        arrival = self._clock()
        with self._gate.admit():
            engine = self._require_engine()
            body = await _read_json(request)
            parsed = await self._parse(engine, body, chat=chat)
            prefix = "chatcmpl" if chat else "cmpl"
            request_id = f"{prefix}-{uuid.uuid4().hex}"
            hashes = block_hashes(parsed.prompt_token_ids, engine.block_size, engine.model_id)
            sub = self._router.submit(
                parsed.prompt_token_ids, parsed.sampling, request_id, hashes, parsed.slo
            )
            self._router.track(sub)
            reply = _Reply(
                request_id=request_id,
                model=engine.model_name,
                created=int(time.time()),
                chat=chat,
                parsed=parsed,
                token_str=engine.tokenizer.token_str,
            )
            timer = _Timer(self._metrics, arrival, self._clock)
            try:
                with _mapped_errors(chat):
                    # Placed and taken by its decode node's engine (refusals
                    # are still answers with a status of their own).
                    await sub.start()
                headers = {
                    PREFILL_NODE_HEADER: sub.prefill_node or "",
                    DECODE_NODE_HEADER: sub.decode_node or "",
                    **_prediction_headers(sub),
                }
                if parsed.stream:
                    return await self._stream(request, sub, reply, timer, headers)
                return await self._collect(sub, reply, timer, headers)
            finally:
                # Cancels the request on every node (frees its blocks) unless
                # it finished: a client that left, a failed write, a cancelled
                # handler.
                await sub.aclose()
                self._router.untrack(sub)
                self._report(timer.done(reply))

    def _report(self, finished: FinishedRequest) -> None:
        for listener in self.finished_listeners:
            try:
                listener(finished)
            except Exception:
                # A listener's bug must not turn a served request into an error.
                log.exception("finished-request listener failed", request_id=finished.request_id)

    async def _collect(
        self, stream: Submission, reply: _Reply, timer: _Timer, headers: dict[str, str]
    ) -> web.Response:
        with _mapped_errors(reply.chat):
            async for out in stream:
                timer.on_output(out)
                reply.add(out)
        if reply.error is not None:
            raise ApiError(500, f"generation failed: {reply.error}", type="server_error")
        if reply.finish_reason is FinishReason.ABORT:
            raise _aborted()
        # Known by now: the nodes that actually ran it (a failover changes them).
        headers = {
            PREFILL_NODE_HEADER: stream.prefill_node or "",
            DECODE_NODE_HEADER: stream.decode_node or "",
            **_prediction_headers(stream),
        }
        return json_response(reply.final(), headers=headers)

    async def _stream(
        self,
        request: web.Request,
        stream: Submission,
        reply: _Reply,
        timer: _Timer,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": reply.request_id,
                **headers,
            }
        )
        await resp.prepare(request)
        try:
            if reply.chat:
                await _send(resp, reply.chunk(role=True))
            try:
                async for out in stream:
                    timer.on_output(out)
                    reply.add(out)
                    if out.error is not None:
                        err = ApiError(500, f"generation failed: {out.error}", type="server_error")
                        await _send(resp, err.body())
                        break
                    if out.text or out.finished or out.logprobs:
                        await _send(resp, reply.chunk(out))
            except RouteError as exc:
                # Headers are out: the failure goes in the stream itself.
                reply.error = exc.message
                err = ApiError(503, exc.message, type="service_unavailable", code="no_capacity")
                await _send(resp, err.body())
            if reply.finish_reason is FinishReason.ABORT and reply.error is None:
                # Cut short (the drain timed out): say so before [DONE].
                await _send(resp, _aborted().body())
            if reply.parsed.include_usage and reply.error is None:
                await _send(resp, reply.usage_chunk())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            # The client left mid-stream; the caller's finally aborts the request.
            request[CLIENT_GONE] = True
        return resp

    # ------------------------------------------------------------- parsing

    async def _parse(self, engine: EngineCore, body: dict[str, Any], *, chat: bool) -> Parsed:
        model = body.get("model")
        if model is not None:
            if not isinstance(model, str):
                raise bad_param("model", f"'model' must be a string, got {type_name(model)}")
            if model != engine.model_name:
                raise ApiError(
                    404,
                    f"the model '{model}' does not exist; this node serves '{engine.model_name}'",
                    param="model",
                    code="model_not_found",
                )
        stream, include_usage = _parse_stream(body)
        if chat:
            prompt_ids = await self._chat_prompt(engine, body)
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
            logprobs = (top or 0) if want_logprobs else None
            for key in ("tools", "functions"):
                if body.get(key):
                    raise bad_param(key, f"'{key}' (tool calling) is not supported by mooncaked")
        else:
            prompt_ids = await self._completion_prompt(engine, body)
            max_tokens, max_key = _int(body, "max_tokens", 16), "max_tokens"
            logprobs = _int(body, "logprobs", None)
            if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
                raise bad_param(
                    "logprobs", f"'logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}"
                )
            _unsupported(body, "echo", (False,), "only false")
            _unsupported(body, "best_of", (1,), "only 1")
            _unsupported(body, "suffix", ("",), "no insertion")
        if max_tokens is not None and max_tokens < 1:
            raise bad_param(max_key, f"'{max_key}' must be at least 1, got {max_tokens}")

        limit = engine.max_model_len
        num_prompt = len(prompt_ids)
        prompt_param = "messages" if chat else "prompt"
        if max_tokens is None:
            # Chat's default: the rest of the context.
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
        sampling = _parse_sampling(body, max_tokens=max_tokens, logprobs=logprobs)
        return Parsed(
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            stream=stream,
            include_usage=include_usage,
            logprobs_style=None if logprobs is None else ("chat" if chat else "completion"),
            slo=parse_slo(body),
        )

    async def _completion_prompt(self, engine: EngineCore, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        vocab = getattr(engine.tokenizer, "vocab_size", None)
        # One-element batches are what some clients send for a single prompt.
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await _encode(engine, prompt, "prompt", add_special_tokens=True)
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            ids = _check_token_ids(prompt, "prompt", vocab)
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise bad_param(
                "prompt",
                "'prompt' must be one string or one array of token ids: "
                "batches of prompts are not supported, send one request per prompt",
            )
        elif prompt is None:
            raise ApiError(400, "'prompt' is required", param="prompt", code="missing_required")
        else:
            raise bad_param(
                "prompt",
                f"'prompt' must be a string or an array of token ids, got {type_name(prompt)}",
            )
        if not ids:
            raise bad_param("prompt", "'prompt' must not be empty")
        return list(ids)

    async def _chat_prompt(self, engine: EngineCore, body: dict[str, Any]) -> list[int]:
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
            if not isinstance(role, str) or role not in _CHAT_ROLES:
                raise bad_param(
                    f"{param}.role",
                    f"'{param}.role' must be one of {sorted(_CHAT_ROLES)}, got {brief(role)}",
                )
            content = m.get("content")
            if content is None:
                text = ""
            elif isinstance(content, str):
                text = content
            elif isinstance(content, list):
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
                text = "".join(parts)
            else:
                raise bad_param(
                    f"{param}.content", f"'{param}.content' must be a string or an array"
                )
            norm.append({"role": role, "content": text})
        _check_chars(engine, sum(len(m["content"]) for m in norm), "messages")
        try:
            text = engine.tokenizer.apply_chat_template(norm, add_generation_prompt=True)
        except ValueError as exc:
            # The template's own raise_exception (roles that do not alternate,
            # an unknown role): the client's messages broke its rules.
            raise bad_param("messages", str(exc)) from None
        # The template writes the special tokens (BOS) itself.
        ids = await _encode(engine, text, "messages", add_special_tokens=False)
        if not ids:
            raise bad_param("messages", "'messages' produce an empty prompt")
        return list(ids)


def _aborted() -> ApiError:
    return ApiError(
        503,
        "the request was cancelled: mooncaked is shutting down",
        type="service_unavailable",
        code="aborted",
    )


def _check_chars(engine: EngineCore, num_chars: int, param: str) -> None:
    # Before tokenizing: a text this long cannot fit the context whatever the
    # tokenizer, and tokenizing it would stall the loop and grow memory for nothing.
    limit = engine.max_model_len * MAX_CHARS_PER_TOKEN
    if num_chars > limit:
        raise ApiError(
            400,
            f"the prompt has {num_chars} characters, more than could fit the model's context "
            f"length of {engine.max_model_len} tokens (at most {limit} characters); "
            f"shorten the {param}",
            param=param,
            code="context_length_exceeded",
        )


async def _encode(
    engine: EngineCore, text: str, param: str, *, add_special_tokens: bool
) -> list[int]:
    _check_chars(engine, len(text), param)
    encode = engine.tokenizer.encode
    if len(text) > OFFLOOP_TOKENIZE_CHARS:
        # Long texts on a worker thread: the loop keeps streaming meanwhile.
        return await asyncio.to_thread(encode, text, add_special_tokens)
    return encode(text, add_special_tokens)


async def _read_json(request: web.Request) -> dict[str, Any]:
    try:
        return await read_json_object(request)
    except BadBody as exc:
        raise ApiError(400, str(exc), code=exc.code) from None


async def _send(resp: web.StreamResponse, obj: Any) -> None:
    await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")


# ------------------------------------------------------------- answer shapes


@dataclass(slots=True)
class _Reply:
    """Accumulates outputs of one request and renders OpenAI's shapes."""

    request_id: str
    model: str
    created: int
    chat: bool
    parsed: Parsed
    token_str: Callable[[int], str]
    text: str = ""
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    # Completions logprobs are column-wise, chat's row-wise; both kept here.
    lp_rows: list[TokenLogprob] | None = None

    def __post_init__(self) -> None:
        self.lp_rows = [] if self.parsed.logprobs_style else None

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
        num_prompt = len(self.parsed.prompt_token_ids)
        return {
            "prompt_tokens": num_prompt,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": num_prompt + self.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }

    def _finish(self) -> str | None:
        return None if self.finish_reason is None else self.finish_reason.openai

    def _logprobs(self, rows: list[TokenLogprob]) -> dict[str, Any] | None:
        style = self.parsed.logprobs_style
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
        if self.parsed.include_usage:
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


class _Timer:
    """Latency of one request: TTFT, gaps between outputs, end to end."""

    __slots__ = ("_arrival", "_clock", "_last", "_metrics", "ttft_s")

    def __init__(self, metrics: ApiMetrics, arrival: float, clock: Callable[[], float]) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self._clock = clock
        self._last: float | None = None
        self.ttft_s: float | None = None

    def on_output(self, out: RequestOutput) -> None:
        if not out.new_token_ids:
            return
        now = self._clock()
        if self._last is None:
            self.ttft_s = now - self._arrival
            self._metrics.ttft.observe(self.ttft_s)
        else:
            # One observation per token: an output that carries several
            # tokens (after a stall) spreads its gap over them.
            n = len(out.new_token_ids)
            gap = (now - self._last) / n
            for _ in range(n):
                self._metrics.itl.observe(gap)
        self._last = now

    def done(self, reply: _Reply) -> FinishedRequest:
        e2e_s = self._clock() - self._arrival
        metrics = self._metrics
        metrics.prompt_tokens.inc(len(reply.parsed.prompt_token_ids))
        metrics.generation_tokens.inc(reply.num_output_tokens)
        metrics.cached_prompt_tokens.inc(reply.num_cached_tokens)
        if reply.error is not None:
            reason = "error"
        elif reply.finish_reason is None:  # the client left before the end
            reason = "abort"
        else:
            reason = reply.finish_reason.value
        metrics.requests_finished.labels(reason=reason).inc()
        if reply.finish_reason is not None and reply.error is None:
            metrics.e2e.observe(e2e_s)
        return FinishedRequest(
            request_id=reply.request_id,
            endpoint="chat" if reply.chat else "completions",
            num_prompt_tokens=len(reply.parsed.prompt_token_ids),
            num_cached_tokens=reply.num_cached_tokens,
            num_output_tokens=reply.num_output_tokens,
            ttft_s=self.ttft_s,
            e2e_s=e2e_s,
            finish_reason=reason,
        )


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def api_middleware(metrics: ApiMetrics) -> Any:
    """Renders ApiError and unexpected exceptions as JSON; counts every answer."""

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        route = request.match_info.route.resource
        # The route's pattern, not the raw path: unknown paths must not grow the label set.
        endpoint = route.canonical if route is not None else "unmatched"
        status = 500
        try:
            resp = await handler(request)
            status = 499 if request.get(CLIENT_GONE) else resp.status
            return resp
        except ApiError as exc:
            status = exc.status
            return exc.response()
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            # The client went away (nginx's 499 "client closed request"), or shutdown.
            status = 499
            raise
        except Exception as exc:
            if isinstance(exc, ConnectionResetError) and _client_gone(request):
                # The caller hung up mid-request (a peer killed or cut off
                # while sending a body or reading the answer): nobody to
                # answer, and nothing wrong on this side.
                status = 499
                log.info("client connection lost", endpoint=endpoint, remote=request.remote)
                return web.Response(status=499)
            log.exception("request failed", endpoint=endpoint)
            err = ApiError(
                500, "internal error in mooncaked; see the daemon's log", type="server_error"
            )
            return err.response()
        finally:
            metrics.http_requests.labels(endpoint=endpoint, status=str(status)).inc()

    return middleware


# Set on a request whose client disconnected while its answer streamed.
CLIENT_GONE = "mooncaked_client_gone"
