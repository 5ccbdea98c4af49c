"""The server side of the disaggregated-serving calls (signed like every internal call).

- ``POST /internal/generate`` (entry node -> decode node, ``wire.generate``):
  runs the request here and streams its outputs back as JSON lines; closing
  the connection aborts it.
- ``POST /internal/prefill`` (decode node -> prefill node, ``wire.prefill``):
  computes the prompt's KV into the decode node's granted blocks and answers
  with the first token once the KV is written.

Bodies are decoded by their ``wire`` messages; refusals are answered as the
refusal table says (``api.refusals``), in the internal error shape.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web

from mooncaked.api.pipeline import PipelineAPI
from mooncaked.api.refusals import REFUSALS, NodeMismatch, NotServing, refusal
from mooncaked.api.signed import Rejected, read_signed_json, rpc_error
from mooncaked.engine.core import EngineCore
from mooncaked.engine.handoff import PrefillBusy, PrefillError, PrefillReply
from mooncaked.engine.kv_sender import KVSender
from mooncaked.engine.plan import SampledToken
from mooncaked.rpc import Target, Verifier
from mooncaked.wire.generate import GenerateBody
from mooncaked.wire.paths import GENERATE_PATH, MAX_CALL_BYTES, PREFILL_PATH
from mooncaked.wire.prefill import PrefillBody, encode_prefill_reply
from mooncaked.wire.request import encode_output

log = structlog.get_logger(__name__)


class DisaggAPI:
    """The server side of both calls, over this node's engine and KV sender."""

    def __init__(
        self,
        *,
        secret: bytes,
        node_id: Callable[[], str],
        generation: int,
        role: str,
        engine: Callable[[], EngineCore | None],
        sender: Callable[[], KVSender | None],
        draining: Callable[[], bool],
        queue_s: Callable[[], float] = lambda: 0.0,
        pipeline: PipelineAPI | None = None,
    ) -> None:
        # Calls are good only if signed for this node in this process.
        self.verifier = Verifier(secret, identity=lambda: Target(node_id(), generation))
        # How long a prompt queued now waits here, as this node prices it (late binding).
        self._queue_s = queue_s
        self._node_id = node_id
        self._role = role
        self._engine = engine
        self._sender = sender
        self._draining = draining
        # A pipelined group's head runs a prefill call naming its stages.
        self._pipeline = pipeline

    def routes(self) -> list[web.RouteDef]:
        return [web.post(GENERATE_PATH, self.generate), web.post(PREFILL_PATH, self.prefill)]

    @property
    def num_unauthorized(self) -> int:
        return self.verifier.num_unauthorized

    async def _body(self, request: web.Request, work: str) -> dict[str, Any]:
        """The signed body of a call to ``work`` (decode or prefill); a node of
        the other role refuses it."""
        data = await read_signed_json(request, self.verifier, max_bytes=MAX_CALL_BYTES)
        other = "prefill" if work == "decode" else "decode"
        if self._role == other:
            raise NodeMismatch(f"this node only {other}s; it does not {work}")
        return data

    def _ready_engine(self) -> EngineCore:
        engine = self._engine()
        if engine is None or self._draining():
            raise NotServing("this node is not serving (starting, draining or stopping)")
        return engine

    # -- decode node -------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            data = await self._body(request, "decode")
            engine = self._ready_engine()
            call = GenerateBody.decode(data)
            stream = engine.add_request(
                call.prompt_token_ids,
                call.sampling,
                call.request_id,
                handoff=call.handoff(time.monotonic()),
            )
        except Rejected as bad:
            return bad.response
        except REFUSALS as exc:
            return refusal(exc).rpc_response()
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        try:
            await resp.prepare(request)
            async for out in stream:
                await resp.write(encode_output(out))
            await resp.write_eof()
        finally:
            # The entry node went away (or we are done): abort unless finished.
            await stream.aclose()
        return resp

    # -- prefill node ------------------------------------------------------------

    async def prefill(self, request: web.Request) -> web.Response:
        try:
            data = await self._body(request, "prefill")
            call = PrefillBody.decode(data)
            limit = call.max_wait_s
            queued = self._queue_s() if math.isfinite(limit) else 0.0
            if queued > limit:
                # Late binding: the entry chose this node on a view older
                # than its queue; a later candidate is forecast to start sooner.
                raise PrefillBusy(
                    f"prompts queued here take {queued:.3f} s, longer than the "
                    f"{limit:.3f} s allowed; ask the next node"
                )
            engine = self._ready_engine()
            if call.stages:
                return await self._pipelined(call)
            if not engine.span.whole:
                raise NodeMismatch(
                    f"this node holds layers {engine.span.lo}..{engine.span.hi} only: "
                    "it prefills as a stage of its pipelined group"
                )
            sender = self._sender()
            if sender is None:
                raise NotServing("this node cannot send KV (no transfer engine)")
            # One token: the first of the completion, sampled exactly as the
            # decode node would; stop conditions are the decode node's to check.
            first = dataclasses.replace(call.sampling, max_tokens=1, stop=(), stop_token_ids=())
            local_id = f"{call.request_id}@prefill"
            stream = engine.add_request(
                call.prompt_token_ids, first, local_id, handoff=call.handoff()
            )
        except Rejected as bad:
            return bad.response
        except REFUSALS as exc:
            return refusal(exc).rpc_response()
        last = None
        try:
            async for out in stream:
                last = out
        finally:
            await stream.aclose()
        if last is None or last.error is not None or not last.new_token_ids:
            why = last.error if last is not None and last.error else "the prefill was aborted"
            return rpc_error(502, why)
        sent = last.kv_sent
        failed, nbytes = (sent.failed, sent.num_bytes) if sent else ("no handoff state", 0)
        if failed is not None:
            return rpc_error(502, failed)
        log.info(
            "prefill served",
            request_id=call.request_id,
            decode_node=call.grant.node_id,
            prompt_tokens=len(call.prompt_token_ids),
            cached_tokens=last.num_cached_tokens,
            kv_bytes=nbytes,
        )
        token = SampledToken(last.new_token_ids[-1], last.logprobs[-1] if last.logprobs else None)
        reply = PrefillReply(self._node_id(), token, last.num_cached_tokens, nbytes)
        return web.Response(body=encode_prefill_reply(reply), content_type="application/json")

    async def _pipelined(self, call: PrefillBody) -> web.Response:
        """The call as its pipelined group's head (the refusals of a call that
        does not fit propagate to the caller's table)."""
        if self._pipeline is None:
            raise NodeMismatch("this node runs no pipelined prefill groups")
        try:
            reply = await self._pipeline.head(call)
        except PrefillError as exc:
            if isinstance(exc, PrefillBusy):
                raise
            return rpc_error(502, str(exc))
        return web.Response(body=encode_prefill_reply(reply), content_type="application/json")
