"""Prefill/decode disaggregation as the engine's second KV connector.

The decode node's side, ``KVReceiver``: a request that arrives with a
``PrefillSource`` (the prefill nodes the entry node picked) offers every
prompt token past the device prefix hit as coming from outside. The
scheduler allocates blocks for them; ``load`` grants those blocks to one
prefill node (a ``KVGrant``: where the blocks are in this node's KV segment,
for how long) and asks it to prefill. The prefill node writes the prompt's KV
straight into the granted blocks and answers with the first sampled token;
the request then joins the decode batch. A prefill node that fails, times
out or is draining is replaced by the next candidate; when none is left the
load delivers nothing and this node computes the prompt itself.

The grant is enforced where the bytes land: before asking a prefill node,
the receiver opens the granted blocks to that node's writes alone
(``WriteGrants``, the transfer engine's write grants), and closes them the
moment the call ends, answered or not; a write outside them, from another
node, or later, is refused. Blocks a prefill node was granted also stay held
(a reference on each) until it can no longer write them: at once when it
answered, else until the grant has expired (a peer that mapped the memory
over shm or RDMA while its grant was live is bounded by that); a request whose
prefill failed computes into fresh blocks instead.

The prefill node's side, ``KVSender``: a request that carries a ``KVGrant``
is computed as usual (reusing this node's caches), and after each layer's
forward the K and V rows that layer wrote for the granted blocks go out as
one batch of WRITEs through the transfer engine, while the next layers
compute. ``wait_for_save`` waits for the step's batches before its results
return, so when the first token is out, the KV is in place on the decode node.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from mooncaked.engine.connector import KVConnector, LoadResult
from mooncaked.engine.late_binding import PrefillWalk
from mooncaked.engine.plan import LoadJob, SampledToken, StepPlan
from mooncaked.handoff import KVGrant, KVLayout, PrefillTarget
from mooncaked.request import Request

log = structlog.get_logger(__name__)

__all__ = [
    "HandoffStats",
    "KVReceiver",
    "KVSender",
    "PrefillBusy",
    "PrefillError",
    "PrefillReply",
    "StepObserver",
    "StepSend",
    "WriteGrants",
]

# A prefill node's late writes land by the grant's deadline; this much more
# covers the time the grant spent in flight to it.
_GRANT_GRACE_S = 2.0


class PrefillError(Exception):
    """A prefill node could not do the prefill (down, refused, failed, timed out)."""


class PrefillBusy(PrefillError):
    """The prefill node's own queue is longer than the entry allowed it (late
    binding): it passed the request on without computing anything."""


@dataclass(frozen=True, slots=True)
class PrefillReply:
    """What a prefill node answers once the prompt's KV is written."""

    node_id: str
    token: SampledToken
    num_cached_tokens: int
    bytes_sent: int = 0


# One WRITE from this node's KV segment: (local offset, remote node, remote
# segment, remote offset, length).
KVWrite = tuple[int, str, str, int, int]


class KVWriter(Protocol):
    """How the sender moves bytes (the transfer engine, adapted by the daemon):
    the engine layer sits above the transfer layer and never imports it."""

    def add_peer(self, node_id: str, address: str) -> None:
        """Learn where a decode node's transfer endpoint is; ValueError if malformed."""

    async def write(
        self, segment: str, writes: list[KVWrite], timeout_s: float
    ) -> tuple[bool, str]:
        """Do every write out of ``segment``: (all done, why not)."""
        ...


class WriteGrants(Protocol):
    """Opens a grant's blocks of this node's KV segment to one peer's writes
    (the transfer engine, adapted by the daemon)."""

    def open(self, grant: KVGrant, peer: str, ttl_s: float) -> object:
        """Let ``peer`` write the granted blocks for ``ttl_s`` seconds; a handle."""
        ...

    def close(self, handle: object) -> None:
        """End an opened grant now (idempotent)."""


# (target, request, grant) -> the reply; raises PrefillError.
# Ask one prefill node for a request's KV, with the longest queue it may
# take it with (inf: any).
PrefillCall = Callable[[PrefillTarget, Request, KVGrant, float], Awaitable[PrefillReply]]


@dataclass(frozen=True, slots=True)
class StepSend:
    """One engine step's KV sent to decode nodes, for observers (histograms)."""

    num_bytes: int
    # From the step's first layer finishing to its writes being complete.
    send_seconds: float
    # From the step's last layer finishing to its writes being complete.
    exposed_seconds: float
    ok: bool


# Called in the engine's step thread once per step that sent KV.
StepObserver = Callable[[StepSend], None]


@dataclass(slots=True)
class HandoffStats:
    """Counters of the handoff, by side."""

    # Decode side: handoffs by outcome.
    ok: int = 0
    retried: int = 0
    # Prefill nodes that passed a request on, their queue longer than the
    # entry allowed (late binding); the next was asked.
    passed_on: int = 0
    fell_back: int = 0
    cancelled: int = 0
    # Prefill side.
    sent_requests: int = 0
    sent_bytes: int = 0
    send_failures: int = 0
    send_seconds: float = 0.0
    # Time from a step's last layer finishing to its writes being complete.
    exposed_seconds: float = 0.0
    num_steps_sent: int = 0


# -- decode side -----------------------------------------------------------------


class KVReceiver(KVConnector):
    def __init__(
        self,
        *,
        node_id: str,
        transfer_address: str,
        segment: str,
        layout: KVLayout,
        prefill: PrefillCall,
        grant_ttl_s: float = 30.0,
        write_grants: WriteGrants | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``write_grants`` opens the granted blocks to the asked node's writes;
        None where nothing enforces grants (tests of the engine alone)."""
        self.node_id = node_id
        self.transfer_address = transfer_address
        self.segment = segment
        self.layout = layout
        self._prefill = prefill
        self.grant_ttl_s = grant_ttl_s
        self._write_grants = write_grants
        self._clock = clock
        # Requests whose handoff ran already (a failed one is computed here).
        self._tried: set[str] = set()
        # Blocks a prefill node may still write: key -> block ids.
        self._holds: dict[int, list[int]] = {}
        self._hold_timers: dict[int, asyncio.TimerHandle] = {}
        self._next_hold = 0
        self.stats = HandoffStats()

    def lookup(self, req: Request, num_computed_tokens: int) -> int | None:
        if req.handoff.source is None or req.request_id in self._tried:
            return 0
        if req.num_output_tokens:
            return 0  # a preempted request recomputes here
        return req.num_tokens - num_computed_tokens

    async def load(self, req: Request, job: LoadJob) -> LoadResult:
        self._tried.add(req.request_id)
        source = req.handoff.source
        if source is None:
            return LoadResult(0)
        grant = KVGrant(
            request_id=req.request_id,
            node_id=self.node_id,
            transfer_address=self.transfer_address,
            segment=self.segment,
            layout=self.layout,
            first_block=job.first_block,
            block_ids=tuple(job.block_ids),
            ttl_s=self.grant_ttl_s,
        )
        # Held for as long as a prefill node may write them.
        hold = self._hold(job.block_ids)
        walk = PrefillWalk.of(source)
        while (step := walk.next()) is not None:
            i, max_wait = step
            target = source.targets[i]
            if max_wait < 0.0:
                # Slower than the candidates left even idle: not worth a call.
                self.stats.passed_on += 1
                continue
            t0 = self._clock()
            try:
                opened = self._open_grant(grant, target.node_id)
            except ValueError as exc:
                # Nothing could write the blocks: no node is worth asking.
                log.error("cannot open a KV grant; computing it here", error=str(exc))
                break
            try:
                reply = await self._prefill(target, req, grant, max_wait)
            except PrefillBusy as exc:
                # Late binding: its true queue is longer than the entry
                # thought; the next candidate is forecast to start sooner.
                log.info(
                    "prefill node busy; asking the next",
                    request_id=req.request_id,
                    prefill_node=target.node_id,
                    reason=str(exc),
                )
                self.stats.passed_on += 1
                continue
            except PrefillError as exc:
                log.warning(
                    "prefill failed; trying the next node"
                    if i + 1 < len(source.targets)
                    else "prefill failed; computing it here",
                    request_id=req.request_id,
                    prefill_node=target.node_id,
                    error=str(exc),
                )
                self.stats.retried += i + 1 < len(source.targets)
                continue
            except asyncio.CancelledError:
                self.stats.cancelled += 1
                self._release_later(hold)
                raise
            finally:
                # Whatever the outcome, this node writes no more: a late write
                # (a timed-out node still sending) is refused, not landed in
                # blocks the next node or this one now fills.
                if opened is not None and self._write_grants is not None:
                    self._write_grants.close(opened)
            self._release(hold)
            self.stats.ok += 1
            log.info(
                "kv handoff done",
                request_id=req.request_id,
                prefill_node=reply.node_id,
                tokens=job.num_tokens,
                kv_bytes=reply.bytes_sent,
                cached_tokens=reply.num_cached_tokens,
                seconds=round(self._clock() - t0, 4),
            )
            return LoadResult(
                num_tokens=job.num_tokens,
                sampled=reply.token,
                num_cached_tokens=reply.num_cached_tokens,
                prefill_node=reply.node_id,
            )
        self.stats.fell_back += 1
        # A failed prefill node may still write the granted blocks until the
        # grant expires: compute into fresh blocks and keep those held.
        self._swap_blocks(req, job, hold)
        return LoadResult(0, prefill_node=self.node_id)

    def _open_grant(self, grant: KVGrant, peer: str) -> object | None:
        if self._write_grants is None:
            return None
        # As long as the blocks stay held for a node that failed.
        return self._write_grants.open(grant, peer, self.grant_ttl_s + _GRANT_GRACE_S)

    def _swap_blocks(self, req: Request, job: LoadJob, hold: int) -> None:
        pool = self.ctx.pool
        fresh = pool.allocate(len(job.block_ids))
        if fresh is None:
            # Short of blocks: keep the granted ones, once nobody can write them.
            log.warning("no blocks to swap a failed handoff's for", request_id=req.request_id)
            self._release_later(hold)
            return
        first = job.first_block
        granted = req.block_ids[first : first + len(fresh)]
        req.block_ids[first : first + len(fresh)] = fresh
        # The request's references on the granted blocks move to the hold.
        self._holds[hold] = self._holds[hold] + granted
        self._release_later(hold)

    def _hold(self, block_ids: Sequence[int]) -> int:
        key = self._next_hold
        self._next_hold += 1
        self.ctx.pool.touch(block_ids)
        self._holds[key] = list(block_ids)
        return key

    def _release(self, key: int) -> None:
        timer = self._hold_timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        block_ids = self._holds.pop(key, None)
        if block_ids:
            self.ctx.pool.free(block_ids)
            self.ctx.wakeup()

    def _release_later(self, key: int) -> None:
        loop = asyncio.get_running_loop()
        self._hold_timers[key] = loop.call_later(
            self.grant_ttl_s + _GRANT_GRACE_S, self._release, key
        )

    def load_cancellable(self, req: Request) -> bool:
        # Cancelling a handoff holds its granted blocks until the grant expires.
        return True

    def request_finished(self, req: Request) -> None:
        self._tried.discard(req.request_id)

    def held_blocks(self) -> list[list[int]]:
        return list(self._holds.values())

    async def close(self) -> None:
        for key in list(self._holds):
            self._release(key)


# -- prefill side ----------------------------------------------------------------


@dataclass(slots=True)
class _Sink:
    grant: KVGrant
    deadline: float
    failed: str | None = None
    bytes_sent: int = 0
    # Prompt positions before this one are sent (or were not the decode
    # node's to receive): a chunk that starts later, after a prefix this node
    # had cached, sends that prefix's rows too.
    sent_upto: int = 0
    # Writes of earlier chunks not waited for yet: the step that samples the
    # first token waits for them.
    pending: list[tuple[list[_Send], Future[tuple[bool, str]]]] = field(default_factory=list)


@dataclass(slots=True)
class _Send:
    """One request's writes in one step: runs of rows, each (src block, dst block,
    first row, rows), contiguous on both sides."""

    sink: _Sink
    runs: list[tuple[int, int, int, int]]
    # The chunk samples the first token: its request's KV must be complete
    # when the step returns.
    final: bool = False


@dataclass(slots=True)
class _StepSends:
    sends: list[_Send]
    timeout_s: float
    # Set in the step thread: per layer, the future of its submitted batch.
    futures: list[tuple[list[_Send], Future[tuple[bool, str]]]] = field(default_factory=list)
    t_first: float = 0.0
    t_last_layer: float = 0.0
    num_bytes: int = 0


class KVSender(KVConnector):
    """Streams a granted request's KV to its decode node, layer by layer.

    ``layerwise=False`` sends everything after the whole step instead (the
    baseline the handoff benchmark compares with).
    """

    def __init__(
        self,
        writer: KVWriter,
        *,
        segment: str,
        layout: KVLayout,
        loop: asyncio.AbstractEventLoop,
        layerwise: bool = True,
        on_step: StepObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._writer = writer
        self._on_step = on_step
        self._segment = segment
        self._layout = layout
        self._loop = loop
        self.layerwise = layerwise
        self._clock = clock
        self._sinks: dict[str, _Sink] = {}
        # Outcomes of finished requests, until the prefill handler takes them.
        self._outcomes: dict[str, _Sink] = {}
        self.stats = HandoffStats()

    def request_added(self, req: Request) -> None:
        grant = req.handoff.sink
        if grant is None:
            return
        sink = _Sink(
            grant,
            self._clock() + grant.ttl_s,
            sent_upto=grant.first_block * grant.layout.block_size,
        )
        lay, mine = grant.layout, self._layout
        if (lay.num_layers, lay.block_size, lay.row_bytes) != (
            mine.num_layers,
            mine.block_size,
            mine.row_bytes,
        ):
            sink.failed = f"the decode node's KV layout {lay} does not match this node's {mine}"
        else:
            try:
                self._writer.add_peer(grant.node_id, grant.transfer_address)
            except ValueError as exc:
                sink.failed = f"bad transfer address: {exc}"
        self._sinks[req.request_id] = sink

    def request_finished(self, req: Request) -> None:
        sink = self._sinks.pop(req.request_id, None)
        if sink is not None:
            self._outcomes[req.request_id] = sink

    def take_outcome(self, request_id: str) -> tuple[str | None, int] | None:
        """(why the handoff failed or None, bytes sent) of a finished request."""
        sink = self._outcomes.pop(request_id, None)
        if sink is None:
            return None
        return sink.failed, sink.bytes_sent

    def build_meta(self, plan: StepPlan) -> Any:
        if not self._sinks:
            return None
        now = self._clock()
        sends: list[_Send] = []
        timeout = math.inf
        for chunk in plan.chunks:
            sink = self._sinks.get(chunk.request_id)
            if sink is None or sink.failed is not None:
                continue
            if now >= sink.deadline:
                sink.failed = "the grant expired before its KV was sent"
                continue
            start = min(sink.sent_upto, chunk.start_pos)
            runs = self._runs(sink.grant, chunk.block_ids, start, chunk.end_pos)
            if runs is None:
                sink.failed = "the grant does not cover the prompt"
                continue
            sink.sent_upto = max(sink.sent_upto, chunk.end_pos)
            if runs:
                sends.append(_Send(sink, runs, final=chunk.sample))
                timeout = min(timeout, sink.deadline - now)
        if not sends:
            return None
        return _StepSends(sends, timeout)

    def _runs(
        self, grant: KVGrant, block_ids: list[int], start: int, end: int
    ) -> list[tuple[int, int, int, int]] | None:
        """Rows [start, end) of the granted blocks as runs contiguous on both sides."""
        bs = self._layout.block_size
        runs: list[tuple[int, int, int, int]] = []
        for i in range(start // bs, (end - 1) // bs + 1):
            if i < grant.first_block:
                continue  # the decode node has this block already
            j = i - grant.first_block
            if j >= len(grant.block_ids):
                return None
            r0 = max(start, i * bs) - i * bs
            r1 = min(end, (i + 1) * bs) - i * bs
            src, dst = block_ids[i], grant.block_ids[j]
            if runs:
                ps, pd, pr, pn = runs[-1]
                # Extends the last run when it ended at a block end and both
                # sides continue in the next block.
                if r0 == 0 and (pr + pn) % bs == 0:
                    nb = (pr + pn) // bs
                    if src == ps + nb and dst == pd + nb:
                        runs[-1] = (ps, pd, pr, pn + (r1 - r0))
                        continue
            runs.append((src, dst, r0, r1 - r0))
        return runs

    def _ops(self, layers: range, sends: list[_Send]) -> list[KVWrite]:
        mine = self._layout
        row = mine.row_bytes
        ops: list[KVWrite] = []
        for s in sends:
            g = s.sink.grant
            for layer in layers:
                for kv in (0, 1):
                    for src, dst, r0, n in s.runs:
                        ops.append(
                            (
                                mine.offset(layer, kv, src, r0),
                                g.node_id,
                                g.segment,
                                g.layout.offset(layer, kv, dst, r0),
                                n * row,
                            )
                        )
        return ops

    async def _submit(self, ops: list[KVWrite], timeout_s: float) -> tuple[bool, str]:
        return await self._writer.write(self._segment, ops, timeout_s)

    def _send_layers(self, meta: _StepSends, layers: range) -> None:
        # One batch per decode node: a node that fails (or is cut as lost)
        # fails only the requests it was receiving.
        by_node: dict[str, list[_Send]] = {}
        for s in meta.sends:
            by_node.setdefault(s.sink.grant.node_id, []).append(s)
        row = self._layout.row_bytes
        per_layer = 2 * len(layers) * row
        for sends in by_node.values():
            ops = self._ops(layers, sends)
            if not ops:
                continue
            fut = asyncio.run_coroutine_threadsafe(self._submit(ops, meta.timeout_s), self._loop)
            meta.futures.append((sends, fut))
            for s in sends:
                s.sink.bytes_sent += per_layer * sum(n for *_, n in s.runs)
            num_bytes = sum(op[4] for op in ops)
            meta.num_bytes += num_bytes
            self.stats.sent_bytes += num_bytes

    def save_layer(self, layer: int, meta: Any) -> None:
        if not isinstance(meta, _StepSends):
            return
        now = self._clock()
        if meta.t_first == 0.0:
            meta.t_first = now
        meta.t_last_layer = now
        if self.layerwise:
            self._send_layers(meta, range(layer, layer + 1))

    def wait_for_save(self, meta: Any) -> None:
        if not isinstance(meta, _StepSends):
            return
        if not self.layerwise:
            meta.t_last_layer = self._clock()
            self._send_layers(meta, range(self._layout.num_layers))
        finals = [s for s in meta.sends if s.final]
        if not finals:
            # A middle chunk: later chunks write other rows and these blocks
            # stay allocated, so its writes go on under the next step's
            # compute; the step that samples waits for them.
            for s in meta.sends:
                s.sink.pending.extend(meta.futures)
            return
        waits = list(meta.futures)
        for s in finals:
            waits += s.sink.pending
            s.sink.pending = []
        all_ok = True
        seen: set[int] = set()
        for sends, fut in waits:
            if id(fut) in seen:
                continue
            seen.add(id(fut))
            try:
                # The batch's own deadline ends it; the margin only guards a lost loop.
                ok, reason = fut.result(timeout=meta.timeout_s + 5.0)
            except Exception as exc:
                ok, reason = False, repr(exc)
            all_ok = all_ok and ok
            if not ok:
                self.stats.send_failures += 1
                for s in sends:
                    if s.sink.failed is None:
                        s.sink.failed = f"a KV write to {s.sink.grant.node_id} failed: {reason}"
        done = self._clock()
        exposed = done - meta.t_last_layer
        window = done - (meta.t_first or meta.t_last_layer)
        self.stats.num_steps_sent += 1
        self.stats.exposed_seconds += exposed
        self.stats.send_seconds += window
        if self._on_step is not None:
            self._on_step(StepSend(meta.num_bytes, window, exposed, all_ok))

    async def close(self) -> None:
        self._sinks.clear()
        self._outcomes.clear()
