"""A stage's side of a pipelined prefill group (chunked pipeline parallelism).

The decode node asks the group's head with the prefill call
(``/internal/prefill`` naming the stages, ``DisaggAPI.prefill`` hands it
here): the head opens the next stage (``/internal/pipeline/open``), which
opens the one after it, and so on. Opening settles where the group starts:
each stage caps the prefix it was told (the least any stage before holds)
by what it holds itself and passes it on; the last one's cap is the start,
and every stage computes from there. Each stage then sets rows aside for
its input and answers with them; the head runs its chunks, and each stage
runs what arrives, writes its own layers' KV into the decode node's grant
and sends its output on; the last samples the first token. The answers
come back up the chain: a stage's last line is the token and the KV bytes
of it and every stage after it, and the head answers the decode node.

Any stage that fails, is refused or goes away fails the request on every
stage (each call's close aborts the next), and the head's answer to the
decode node is an error: it asks its next candidate, as for any prefill
node. Nothing outlives the request: each stage's rows, grants and engine
request end with its handler.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
from aiohttp import web

from mooncaked.api.metrics import SnapshotMetrics, Spec
from mooncaked.api.refusals import REFUSALS, NodeMismatch, NotServing, refusal
from mooncaked.api.signed import Rejected, read_signed_json, rpc_error
from mooncaked.cache.peer import PeerFetcher
from mooncaked.cluster.costs import StepCost, equal_time_chunks
from mooncaked.cluster.watch import MemberLost, MemberWatch
from mooncaked.config import PipelineConfig
from mooncaked.engine.core import EngineCore
from mooncaked.engine.handoff import PrefillBusy, PrefillError, PrefillReply
from mooncaked.engine.output import RequestStream
from mooncaked.engine.pipeline import ChunkRefused, PipeStats, StageError, StagePipe
from mooncaked.engine.plan import SampledToken
from mooncaked.handoff import Handoff, KVGrant, StageJob, StageRef
from mooncaked.request import RequestOutput, SamplingParams
from mooncaked.rpc import Target, Verifier
from mooncaked.wire.paths import MAX_CALL_BYTES, PIPELINE_CHUNK_PATH, PIPELINE_OPEN_PATH
from mooncaked.wire.pipeline import (
    ChunkBody,
    OpenedStage,
    StageBusy,
    StageClient,
    StageDone,
    StageOpen,
    encode_done,
    encode_failed,
    encode_opened,
)
from mooncaked.wire.prefill import PREFILL_BUSY, PrefillBody

log = structlog.get_logger(__name__)

T = TypeVar("T")

# A stage keeps its input rows held this much past the decode node's grant
# when its request ends early: the stage before may still be writing them.
_ROWS_GRACE_S = 2.0
# Small bodies: a chunk notice.
_MAX_CHUNK_BYTES = 4096


class PipelineAPI:
    """A pipeline stage's calls: the head's run of a request, ``open`` and ``chunk``."""

    def __init__(
        self,
        *,
        secret: bytes,
        node_id: Callable[[], str],
        generation: int,
        config: PipelineConfig,
        block_size: int,
        engine: Callable[[], EngineCore | None],
        draining: Callable[[], bool],
        client: StageClient,
        step_cost: Callable[[], StepCost | None],
        watch: MemberWatch | None = None,
        fetcher: Callable[[], PeerFetcher | None] = lambda: None,
    ) -> None:
        self.verifier = Verifier(secret, identity=lambda: Target(node_id(), generation))
        self._node_id = node_id
        self._config = config
        self._block_size = block_size
        self._engine = engine
        self._draining = draining
        self._client = client
        self._step_cost = step_cost
        self._watch = watch
        # Pulls a prefix of this stage's layers from a peer holding them.
        self._fetcher = fetcher
        self.num_requests = 0
        self.num_failed = 0

    def routes(self) -> list[web.RouteDef]:
        return [web.post(PIPELINE_OPEN_PATH, self.open), web.post(PIPELINE_CHUNK_PATH, self.chunk)]

    def metrics_source(self) -> SnapshotMetrics:
        """The stage's counters for /metrics (nothing on a node that is no stage)."""
        return SnapshotMetrics(self._stats, PIPELINE_METRICS)

    def _stats(self) -> PipeStats | None:
        engine = self._engine()
        if engine is None or engine.pipe is None:
            return None
        # A copy: the counters go on moving while the snapshot is read.
        return dataclasses.replace(engine.pipe.stats)

    def status_section(self) -> dict[str, object] | None:
        """/admin/status's ``pipeline``: this stage, its rows and counters (None: not a stage)."""
        engine = self._engine()
        cfg = self._config
        if not cfg.enabled or engine is None or engine.pipe is None:
            return None
        return {
            "group": cfg.group,
            "stage": cfg.stage,
            "num_stages": cfg.num_stages,
            "requests": self.num_requests,
            "failed": self.num_failed,
            **engine.pipe.status(),
        }

    def _stage_engine(self, index: int, me: StageRef) -> tuple[EngineCore, StagePipe]:
        """This node's engine, if it serves stage ``index`` as ``me`` names it."""
        engine = self._engine()
        if engine is None or self._draining():
            raise NotServing("this node is not serving (starting, draining or stopping)")
        cfg, span, pipe = self._config, engine.span, engine.pipe
        if not cfg.enabled or pipe is None:
            raise NodeMismatch("this node is not a stage of a pipelined prefill group")
        if me.node_id != self._node_id() or index != cfg.stage:
            raise NodeMismatch(
                f"this node is stage {cfg.stage} of group {cfg.group!r}, not stage {index} "
                f"({me.node_id})"
            )
        if (me.layer_lo, me.layer_hi) != (span.lo, span.hi):
            raise NodeMismatch(
                f"this stage holds layers {span.lo}..{span.hi}, not {me.layer_lo}..{me.layer_hi}"
            )
        return engine, pipe

    def _chunks(self, new_tokens: int, start: int) -> tuple[int, ...]:
        """The head's chunks: level in time by its own fitted step model."""
        first = self._config.chunk_tokens
        if first <= 0:
            return ()
        cost = self._step_cost()
        return tuple(
            equal_time_chunks(
                cost if cost is not None else StepCost(),
                new_tokens,
                start,
                first,
                align=self._block_size,
            )
        )

    async def _held(self, engine: EngineCore, prompt: list[int], peer_fetch: bool) -> int:
        """Prompt tokens this stage holds of its layers, once what peers hold of
        them (another group's same stage) is pulled into its DRAM tier."""
        fetcher = self._fetcher()
        if peer_fetch and fetcher is not None:
            hashes = engine.hash_prompt(prompt)[: (len(prompt) - 1) // engine.block_size]
            if fetcher.would_ask(hashes):
                # Bounded by the fetcher's own deadline; a failure costs a recompute.
                await fetcher.fetch(hashes)
        return engine.cached_prefix(prompt)

    async def _race(self, node_id: str, call: Awaitable[T]) -> T:
        """``call``, cut short when gossip loses ``node_id`` (a frozen stage
        neither answers nor closes its connections)."""
        if self._watch is None:
            return await call
        return await self._watch.race(node_id, call)

    # -- the head --------------------------------------------------------------

    async def head(self, call: PrefillBody) -> PrefillReply:
        """Run ``call`` as its group's head; PrefillBusy when a stage has no room
        (nothing was computed), PrefillError when the group failed it. The
        refusals of a bad call (REFUSALS) propagate."""
        me = call.stages[0]
        engine, pipe = self._stage_engine(0, me)
        prompt = call.prompt_token_ids
        local_id = f"{call.request_id}@stage0"
        cap = await self._held(engine, prompt, call.peer_fetch)
        self.num_requests += 1
        try:
            opened = await self._client.open(
                StageOpen(
                    call.request_id,
                    prompt,
                    call.sampling,
                    call.grant,
                    call.stages,
                    1,
                    cap,
                    call.peer_fetch,
                )
            )
        except StageBusy as exc:
            raise PrefillBusy(str(exc)) from None
        except StageError as exc:
            self.num_failed += 1
            raise PrefillError(str(exc)) from None
        try:
            job = StageJob(
                0,
                len(call.stages),
                opened.start,
                self._chunks(len(prompt) - opened.start, opened.start),
                act_out=opened.act,
            )
            stream = self._add(engine, pipe, local_id, prompt, call.sampling, call.grant, job,
                               call.peer_fetch)  # fmt: skip
            done = await self._finish(engine, pipe, local_id, stream, opened, me)
        except StageError as exc:
            self.num_failed += 1
            raise PrefillError(f"pipelined prefill failed: {exc}") from None
        finally:
            pipe.close_output(local_id)
            opened.close()
        log.info(
            "pipelined prefill served",
            request_id=call.request_id,
            decode_node=call.grant.node_id,
            stages=[s.node_id for s in call.stages],
            prompt_tokens=len(prompt),
            start=opened.start,
            kv_bytes=done.num_bytes,
        )
        return PrefillReply(self._node_id(), done.token, opened.start, done.num_bytes)

    # -- a later stage ---------------------------------------------------------

    async def open(self, request: web.Request) -> web.StreamResponse:
        try:
            data = await read_signed_json(request, self.verifier, max_bytes=MAX_CALL_BYTES)
            call = StageOpen.decode(data)
            engine, pipe = self._stage_engine(call.index, call.me)
        except Rejected as bad:
            return bad.response
        except REFUSALS as exc:
            return refusal(exc).rpc_response()
        self.num_requests += 1
        prompt = call.prompt_token_ids
        local_id = f"{call.request_id}@stage{call.index}"
        last = call.index == len(call.stages) - 1
        cap = min(await self._held(engine, prompt, call.peer_fetch), call.cap)
        opened: OpenedStage | None = None
        stream: RequestStream | None = None
        try:
            try:
                if not last:
                    opened = await self._client.open(call.next(cap))
                start = opened.start if opened is not None else cap
                act_in = pipe.reserve(
                    local_id,
                    start,
                    len(prompt),
                    upstream=call.upstream.node_id,
                    url=call.me.url,
                    ttl_s=call.grant.ttl_s + _ROWS_GRACE_S,
                )
                if act_in is None:
                    raise StageBusy(
                        f"{self._node_id()} has no activation rows free for "
                        f"{len(prompt) - start} tokens"
                    )
                job = StageJob(
                    call.index,
                    len(call.stages),
                    start,
                    act_in=act_in,
                    act_out=opened.act if opened is not None else None,
                )
                stream = self._add(engine, pipe, local_id, prompt, call.sampling, call.grant,
                                   job, call.peer_fetch)  # fmt: skip
            except StageBusy as exc:
                return rpc_error(409, str(exc), code=PREFILL_BUSY)
            except StageError as exc:
                self.num_failed += 1
                return rpc_error(502, str(exc))
            except REFUSALS as exc:
                return refusal(exc).rpc_response()
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
            await resp.write(encode_opened(start, act_in))
            try:
                # A stage before that is lost (frozen: its connection stays
                # open) sends nothing more: its loss ends this part too.
                done = await self._race(
                    call.upstream.node_id,
                    self._finish(engine, pipe, local_id, stream, opened, call.me),
                )
            except (StageError, MemberLost) as exc:
                self.num_failed += 1
                await resp.write(encode_failed(str(exc)))
            else:
                await resp.write(encode_done(done))
            await resp.write_eof()
            return resp
        finally:
            if stream is not None:
                await stream.aclose()
            pipe.close_output(local_id)
            pipe.release(local_id)
            if opened is not None:
                opened.close()

    async def chunk(self, request: web.Request) -> web.Response:
        try:
            data = await read_signed_json(request, self.verifier, max_bytes=_MAX_CHUNK_BYTES)
            call = ChunkBody.decode(data)
            engine = self._engine()
            if engine is None:
                raise NotServing("this node is not serving (starting, draining or stopping)")
            engine.stage_arrived(call.request_id, call.seq, call.start, call.end)
        except Rejected as bad:
            return bad.response
        except ChunkRefused as exc:
            return rpc_error(409, str(exc))
        except REFUSALS as exc:
            return refusal(exc).rpc_response()
        return web.Response(status=204)

    # -- both ------------------------------------------------------------------

    def _add(
        self,
        engine: EngineCore,
        pipe: StagePipe,
        local_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        grant: KVGrant,
        job: StageJob,
        peer_fetch: bool,
    ) -> RequestStream:
        # One token, and only on the last stage: the first of the completion,
        # sampled as the decode node would; stops are the decode node's.
        first = dataclasses.replace(sampling, max_tokens=1, stop=(), stop_token_ids=())
        if job.act_out is not None:
            pipe.open_output(local_id, job.act_out, len(prompt), grant.ttl_s)
        return engine.add_request(
            prompt,
            first,
            local_id,
            handoff=Handoff(sink=grant, peer_fetch=peer_fetch, stage=job),
        )

    async def _finish(
        self,
        engine: EngineCore,
        pipe: StagePipe,
        local_id: str,
        stream: RequestStream,
        opened: OpenedStage | None,
        me: StageRef,
    ) -> StageDone:
        """This stage's part run to its end, its output delivered and (if any)
        the next stage's answer read: the token and the KV bytes of this stage
        and every later one. StageError when any of it failed: the first
        failure ends the rest (an output that cannot be delivered stops the
        compute at once, a later stage's error too)."""
        try:
            async with asyncio.TaskGroup() as tg:
                part = tg.create_task(self._part(stream, me))
                if opened is not None:
                    sent = tg.create_task(pipe.sent(local_id))
                    after = tg.create_task(opened.done())
        except BaseExceptionGroup as group:
            first = group.exceptions[0]
            if isinstance(first, StageError | MemberLost):
                raise StageError(str(first)) from None
            raise first from None
        token, num_bytes = part.result()
        if opened is None:
            if token is None:
                raise StageError(f"{me.node_id}: the last stage sampled no token")
            return StageDone(token, num_bytes)
        sent.result()
        done = after.result()
        return StageDone(done.token, num_bytes + done.num_bytes)

    @staticmethod
    async def _part(stream: RequestStream, me: StageRef) -> tuple[SampledToken | None, int]:
        """This stage's engine request to its end: its token (the last stage's)
        and the KV bytes it wrote; StageError when it failed."""
        last: RequestOutput | None = None
        try:
            async for out in stream:
                last = out
        finally:
            await stream.aclose()
        if last is None or last.error is not None:
            why = last.error if last is not None and last.error else "the request was aborted"
            raise StageError(f"{me.node_id}: {why}")
        sent = last.kv_sent
        if sent is None or sent.failed is not None:
            raise StageError(f"{me.node_id}: {sent.failed if sent else 'no handoff state'}")
        token = None
        if last.new_token_ids:
            lp = last.logprobs[-1] if last.logprobs else None
            token = SampledToken(last.new_token_ids[-1], lp)
        return token, sent.num_bytes


# Read off ``PipeStats``.
PIPELINE_METRICS: tuple[Spec, ...] = (
    Spec(
        "mooncaked_pipeline_chunks",
        "Chunks of activations this pipeline stage sent to the next stage (sent) and took "
        "in from the one before (received, refused: out of order, twice or outside the rows).",
        lambda st: {
            "sent": st.chunks_sent,
            "received": st.chunks_received,
            "refused": st.chunks_refused,
        },
        counter=True,
        label="outcome",
    ),
    Spec(
        "mooncaked_pipeline_sent_bytes",
        "Activation bytes this pipeline stage wrote into the next stage's rows.",
        lambda st: st.bytes_sent,
        counter=True,
    ),
    Spec(
        "mooncaked_pipeline_send_failures",
        "Requests whose activations this stage could not deliver to the next.",
        lambda st: st.send_failures,
        counter=True,
    ),
    Spec(
        "mooncaked_pipeline_reserve_refused",
        "Requests refused for want of free input rows (the group asked its next candidate).",
        lambda st: st.reserve_refused,
        counter=True,
    ),
)
