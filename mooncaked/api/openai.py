"""OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models.

The handlers. A body is checked by ``api.protocol``, its prompt tokenized
here, and the request handed to the router; its ``RequestOutput``s come
back as one JSON answer or as server-sent events (``data: {...}`` chunks
ending in ``data: [DONE]``), rendered by ``api.render``. Refusals are
answered as ``api.refusals`` says, in OpenAI's error shape. Every request
that reached the engine is closed in a ``finally``: a client that goes away
(the server runs with handler cancellation, so a lost connection cancels
the handler) gets its request aborted and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from mooncaked.api.errors import ApiError, bad_param
from mooncaked.api.gate import Gate
from mooncaked.api.limits import OFFLOOP_TOKENIZE_CHARS, BadBody, read_json_object
from mooncaked.api.metrics import ApiMetrics
from mooncaked.api.middleware import CLIENT_GONE
from mooncaked.api.protocol import (
    Parsed,
    chat_messages,
    check_chars,
    check_model,
    completion_prompt,
    parse_generation,
    parse_stream,
)
from mooncaked.api.recent import FinishedRequest
from mooncaked.api.refusals import MODEL_LOADING, NotServing, as_api_errors, refusal
from mooncaked.api.render import SSE_DONE, Reply, json_response, placement_headers, sse_event
from mooncaked.api.timing import RequestTimer
from mooncaked.cache.hashing import block_hashes
from mooncaked.request import FinishReason
from mooncaked.router import RouteError, Router, Submission

if TYPE_CHECKING:
    from mooncaked.engine.core import EngineCore

log = structlog.get_logger(__name__)


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
            raise refusal(NotServing(MODEL_LOADING, "model_loading")).error
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
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            hashes = block_hashes(parsed.prompt_token_ids, engine.block_size, engine.model_id)
            sub = self._router.submit(
                parsed.prompt_token_ids,
                parsed.sampling,
                request_id,
                hashes,
                parsed.slo,
                retain=parsed.retain,
            )
            self._router.track(sub)
            reply = Reply(
                request_id=request_id,
                model=engine.model_name,
                created=int(time.time()),
                chat=chat,
                num_prompt_tokens=len(parsed.prompt_token_ids),
                logprobs_style=parsed.logprobs_style,
                include_usage=parsed.include_usage,
                token_str=engine.tokenizer.token_str,
            )
            timer = RequestTimer(self._metrics, arrival, self._clock)
            try:
                with as_api_errors(_prompt_param(chat)):
                    # Placed and taken by its decode node's engine (refusals
                    # are still answers with a status of their own).
                    await sub.start()
                if parsed.stream:
                    return await self._stream(request, sub, reply, timer, _headers(sub))
                return await self._collect(sub, reply, timer)
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

    async def _collect(self, sub: Submission, reply: Reply, timer: RequestTimer) -> web.Response:
        with as_api_errors(_prompt_param(reply.chat)):
            async for out in sub:
                timer.on_output(out)
                reply.add(out)
        if reply.error is not None:
            raise _generation_failed(reply.error)
        if reply.finish_reason is FinishReason.ABORT:
            raise _aborted()
        # Known by now: the nodes that actually ran it (a failover changes them).
        return json_response(reply.final(), headers=_headers(sub))

    async def _stream(
        self,
        request: web.Request,
        sub: Submission,
        reply: Reply,
        timer: RequestTimer,
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
                await resp.write(sse_event(reply.chunk(role=True)))
            try:
                async for out in sub:
                    timer.on_output(out)
                    reply.add(out)
                    if out.error is not None:
                        await resp.write(sse_event(_generation_failed(out.error).body()))
                        break
                    if out.text or out.finished or out.logprobs:
                        await resp.write(sse_event(reply.chunk(out)))
            except RouteError as exc:
                # Headers are out: the failure goes in the stream itself.
                reply.error = exc.message
                await resp.write(sse_event(refusal(exc).error.body()))
            if reply.finish_reason is FinishReason.ABORT and reply.error is None:
                # Cut short (the drain timed out): say so before [DONE].
                await resp.write(sse_event(_aborted().body()))
            if reply.include_usage and reply.error is None:
                await resp.write(sse_event(reply.usage_chunk()))
            await resp.write(SSE_DONE)
            await resp.write_eof()
        except ConnectionResetError:
            # The client left mid-stream; the caller's finally aborts the request.
            request[CLIENT_GONE] = True
        return resp

    # ------------------------------------------------------------- parsing

    async def _parse(self, engine: EngineCore, body: dict[str, Any], *, chat: bool) -> Parsed:
        check_model(body, engine.model_name)
        stream = parse_stream(body)
        if chat:
            prompt_ids = await self._chat_prompt(engine, body)
        else:
            prompt_ids = await self._completion_prompt(engine, body)
        return parse_generation(
            body, prompt_ids, stream, chat=chat, max_model_len=engine.max_model_len
        )

    async def _completion_prompt(self, engine: EngineCore, body: dict[str, Any]) -> list[int]:
        prompt = completion_prompt(body, getattr(engine.tokenizer, "vocab_size", None))
        if isinstance(prompt, str):
            ids = await _encode(engine, prompt, "prompt", add_special_tokens=True)
        else:
            ids = prompt
        if not ids:
            raise bad_param("prompt", "'prompt' must not be empty")
        return list(ids)

    async def _chat_prompt(self, engine: EngineCore, body: dict[str, Any]) -> list[int]:
        messages = chat_messages(body)
        check_chars(sum(len(m["content"]) for m in messages), engine.max_model_len, "messages")
        try:
            text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as exc:
            # The template's own raise_exception (roles that do not alternate,
            # an unknown role): the client's messages broke its rules.
            raise bad_param("messages", str(exc)) from None
        # The template writes the special tokens (BOS) itself.
        ids = await _encode(engine, text, "messages", add_special_tokens=False)
        if not ids:
            raise bad_param("messages", "'messages' produce an empty prompt")
        return list(ids)


def _prompt_param(chat: bool) -> str:
    """The body field a refused prompt is blamed on."""
    return "messages" if chat else "prompt"


def _headers(sub: Submission) -> dict[str, str]:
    return placement_headers(sub.prefill_node, sub.decode_node, sub.placement)


def _generation_failed(error: str) -> ApiError:
    return ApiError(500, f"generation failed: {error}", type="server_error")


def _aborted() -> ApiError:
    return ApiError(
        503,
        "the request was cancelled: mooncaked is shutting down",
        type="service_unavailable",
        code="aborted",
    )


async def _encode(
    engine: EngineCore, text: str, param: str, *, add_special_tokens: bool
) -> list[int]:
    check_chars(len(text), engine.max_model_len, param)
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
