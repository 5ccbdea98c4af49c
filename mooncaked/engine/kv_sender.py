"""The prefill node's side of prefill/decode disaggregation, as a KV connector.

A request that carries a ``KVGrant`` (``Handoff.sink``) is computed as usual
(reusing this node's caches), and as layers' forwards end the K and V rows
they wrote for the granted blocks go out as one batch of WRITEs per decode
node through the transfer engine, while the next layers compute. Layers are
grouped until a batch carries ``layer_batch_bytes`` (the last layer goes
alone): a batch has a fixed cost on the event loop that a short prompt's
layer does not repay. ``wait_for_save`` waits for the step's batches before
its results return, so when the first token is out, the KV is in place on
the decode node.

Who owns what: the event loop owns each request's handoff state (a
``_Sink``: what was sent, what failed, the batches still in flight); before a
step, ``build_meta`` turns it into frozen plain data (``SendMeta``). The
step thread submits the writes and waits for them, keeping what it learns in
its own ``_StepWrites``, and returns a ``SendReport`` (bytes per request,
failures per request, the batches not waited for, the step's send
timings); ``after_step`` applies it on the loop. The request's final output
carries the outcome (``kv_sent``), which is what the prefill call answers.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from mooncaked.engine.connector import KVConnector
from mooncaked.engine.handoff import HandoffStats, KVWrite, KVWriter, StepObserver, StepSend
from mooncaked.engine.plan import StepPlan
from mooncaked.handoff import KVGrant, KVLayout, LayerSpan
from mooncaked.request import KVSent, Request

__all__ = ["KVSender", "SendMeta", "SendReport"]

# Rows of one request sent in one step: (src block, dst block, first row,
# rows), contiguous on both sides.
Run = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class _Send:
    """One request's writes in one step."""

    request_id: str
    grant: KVGrant
    runs: tuple[Run, ...]
    # The chunk samples the first token: its request's KV must be complete
    # when the step returns.
    final: bool = False


@dataclass(frozen=True, slots=True)
class _Batch:
    """Writes submitted to one decode node: the requests whose rows it carries."""

    node_id: str
    request_ids: tuple[str, ...]
    future: Future[tuple[bool, str]]
    # When its writes completed (the sender's clock), filled in before the
    # future resolves: the step's head and sampling run meanwhile, and the
    # time they cover is not the handoff's.
    done_at: list[float] = field(default_factory=list, compare=False)


@dataclass(frozen=True, slots=True)
class SendMeta:
    """The worker side's plan for one step (built on the loop, read in the step thread)."""

    sends: tuple[_Send, ...]
    timeout_s: float
    # Earlier chunks' batches that this step's sampling chunks wait for.
    pending: tuple[_Batch, ...] = ()


@dataclass(frozen=True, slots=True)
class SendReport:
    """What one step's sends came to (step thread -> event loop)."""

    # Bytes submitted for each request this step.
    bytes_sent: tuple[tuple[str, int], ...]
    # Requests whose KV could not all be written, and why.
    failed: tuple[tuple[str, str], ...]
    # Batches not waited for (a step without a sampling chunk): each
    # request's sampling step waits for those that carry its rows.
    in_flight: tuple[_Batch, ...]
    num_bytes: int
    num_failed_batches: int
    # The step's send timings, when it waited for its writes.
    step: StepSend | None = None


@dataclass(slots=True)
class _Sink:
    """One granted request's handoff, as the event loop keeps it."""

    grant: KVGrant
    deadline: float
    failed: str | None = None
    bytes_sent: int = 0
    # Prompt positions before this one are sent (or were not the decode
    # node's to receive): a chunk that starts later, after a prefix this node
    # had cached, sends that prefix's rows too.
    sent_upto: int = 0
    # Batches of earlier chunks not waited for yet: the step that samples the
    # first token waits for them.
    pending: list[_Batch] = field(default_factory=list)
    # The prompt's length: the chunk that reaches it is the request's last.
    prompt_len: int = 0


@dataclass(slots=True)
class _StepWrites:
    """What the step thread submitted for one step, until it reports."""

    meta: SendMeta
    batches: list[_Batch] = field(default_factory=list)
    bytes_sent: dict[str, int] = field(default_factory=dict)
    num_bytes: int = 0
    t_first: float = 0.0
    t_last_layer: float = 0.0
    # Layers from this one on are computed but not sent yet (layer-wise).
    next_layer: int = 0
    # The KV bytes one layer of this step sends (K and V, every request).
    layer_bytes: int = 0


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
        layer_batch_bytes: int = 0,
        on_step: StepObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        span: LayerSpan | None = None,
    ) -> None:
        """``span``: the model's layers this node holds (a stage of a pipelined
        prefill group writes only those of the decode node's KV); default all."""
        self._writer = writer
        self._span = (
            span if span is not None else LayerSpan(0, layout.num_layers, layout.num_layers)
        )
        if self._span.count != layout.num_layers:
            raise ValueError(
                f"a KV layout of {layout.num_layers} layers for layers "
                f"{self._span.lo}..{self._span.hi}"
            )
        self._on_step = on_step
        self._segment = segment
        self._layout = layout
        self._loop = loop
        self.layerwise = layerwise
        if layer_batch_bytes < 0:
            raise ValueError(f"layer_batch_bytes must be >= 0, got {layer_batch_bytes}")
        self._layer_batch_bytes = layer_batch_bytes
        self._clock = clock
        # Event loop only.
        self._sinks: dict[str, _Sink] = {}
        self.stats = HandoffStats()
        # Step thread only: the step being sent.
        self._writes: _StepWrites | None = None

    # -- scheduler side (event loop) -------------------------------------------

    def request_added(self, req: Request) -> None:
        grant = req.handoff.sink
        if grant is None:
            return
        sink = _Sink(
            grant,
            self._clock() + grant.ttl_s,
            sent_upto=grant.first_block * grant.layout.block_size,
            prompt_len=req.num_prompt_tokens,
        )
        lay, mine = grant.layout, self._layout
        if (lay.num_layers, lay.block_size, lay.row_bytes) != (
            self._span.num_layers,
            mine.block_size,
            mine.row_bytes,
        ):
            span = self._span
            sink.failed = f"the decode node's KV layout {lay} does not match this node's {mine}"
            if not span.whole:
                sink.failed += f" (layers {span.lo}..{span.hi} of {span.num_layers})"
        else:
            try:
                self._writer.add_peer(grant.node_id, grant.transfer_address)
            except ValueError as exc:
                sink.failed = f"bad transfer address: {exc}"
        self._sinks[req.request_id] = sink

    def kv_sent(self, req: Request) -> KVSent | None:
        sink = self._sinks.get(req.request_id)
        return None if sink is None else KVSent(sink.bytes_sent, sink.failed)

    def request_finished(self, req: Request) -> None:
        self._sinks.pop(req.request_id, None)

    def build_meta(self, plan: StepPlan) -> SendMeta | None:
        if not self._sinks:
            return None
        now = self._clock()
        sends: list[_Send] = []
        pending: list[_Batch] = []
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
            # The chunk that ends the prompt (it samples, but for a pipeline
            # stage before the last): its step waits for the request's writes.
            final = chunk.sample or chunk.end_pos >= sink.prompt_len
            if not runs and not final:
                continue
            sends.append(_Send(chunk.request_id, sink.grant, tuple(runs), final=final))
            timeout = min(timeout, sink.deadline - now)
            if final:
                # This step waits for them; the loop forgets them.
                pending += sink.pending
                sink.pending = []
        if not sends:
            return None
        return SendMeta(tuple(sends), timeout, tuple(pending))

    def after_step(self, report: Any) -> None:
        if not isinstance(report, SendReport):
            return
        self.stats.sent_bytes += report.num_bytes
        self.stats.send_failures += report.num_failed_batches
        for rid, n in report.bytes_sent:
            if (sink := self._sinks.get(rid)) is not None:
                sink.bytes_sent += n
        for rid, why in report.failed:
            if (sink := self._sinks.get(rid)) is not None and sink.failed is None:
                sink.failed = why
        for batch in report.in_flight:
            for rid in batch.request_ids:
                if (sink := self._sinks.get(rid)) is not None:
                    sink.pending.append(batch)
        step = report.step
        if step is None:
            return
        self.stats.num_steps_sent += 1
        self.stats.exposed_seconds += step.exposed_seconds
        self.stats.blocked_seconds += step.blocked_seconds
        self.stats.send_seconds += step.send_seconds
        if self._on_step is not None:
            self._on_step(step)

    @staticmethod
    def _runs(grant: KVGrant, block_ids: Sequence[int], start: int, end: int) -> list[Run] | None:
        """Rows [start, end) of a request whose block table is ``block_ids``, as
        runs into the granted blocks contiguous on both sides; None when the
        grant does not reach ``end``. Blocks before the grant's first are the
        decode node's already and send nothing."""
        bs = grant.layout.block_size
        runs: list[Run] = []
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

    # -- worker side (step thread) ---------------------------------------------

    def save_layer(self, layer: int, meta: Any) -> None:
        if not isinstance(meta, SendMeta):
            return
        writes = self._step_writes(meta)
        now = self._clock()
        if writes.t_first == 0.0:
            writes.t_first = now
        writes.t_last_layer = now
        if not self.layerwise:
            return
        unsent = layer + 1 - writes.next_layer
        # The last layer goes alone (what is left at the one before it goes
        # then): the tail after the forward is one layer's transfer.
        near_end = layer >= self._layout.num_layers - 2
        if near_end or unsent * writes.layer_bytes >= self._layer_batch_bytes:
            self._send_layers(writes, range(writes.next_layer, layer + 1))
            writes.next_layer = layer + 1

    def wait_for_save(self, meta: Any) -> SendReport | None:
        if not isinstance(meta, SendMeta):
            return None
        writes = self._step_writes(meta)
        self._writes = None
        if not self.layerwise:
            writes.t_last_layer = self._clock()
            self._send_layers(writes, range(self._layout.num_layers))
        if not any(s.final for s in meta.sends):
            # A middle chunk: later chunks write other rows and these blocks
            # stay allocated, so its writes go on under the next step's
            # compute; the step that samples waits for them.
            return self._report(writes, {}, 0, in_flight=tuple(writes.batches))
        blocked_from = self._clock()
        failed: dict[str, str] = {}
        num_failed = 0
        seen: set[int] = set()
        waited: list[_Batch] = []
        for batch in (*writes.batches, *meta.pending):
            if id(batch.future) in seen:
                continue
            seen.add(id(batch.future))
            waited.append(batch)
            try:
                # The batch's own deadline ends it; the margin only guards a lost loop.
                ok, reason = batch.future.result(timeout=meta.timeout_s + 5.0)
            except Exception as exc:
                ok, reason = False, repr(exc)
            if not ok:
                num_failed += 1
                for rid in batch.request_ids:
                    failed.setdefault(rid, f"a KV write to {batch.node_id} failed: {reason}")
        now = self._clock()
        # The writes were complete when the last batch resolved (a wait that
        # timed out has no time: then now).
        done = max((b.done_at[0] if b.done_at else now for b in waited), default=now)
        done = max(done, writes.t_last_layer)
        step = StepSend(
            writes.num_bytes,
            send_seconds=done - (writes.t_first or writes.t_last_layer),
            exposed_seconds=done - writes.t_last_layer,
            ok=num_failed == 0,
            blocked_seconds=now - blocked_from,
        )
        return self._report(writes, failed, num_failed, step=step)

    def _step_writes(self, meta: SendMeta) -> _StepWrites:
        writes = self._writes
        if writes is None or writes.meta is not meta:
            rows = sum(n for s in meta.sends for *_, n in s.runs)
            writes = self._writes = _StepWrites(meta, layer_bytes=2 * rows * self._layout.row_bytes)
        return writes

    @staticmethod
    def _report(
        writes: _StepWrites,
        failed: dict[str, str],
        num_failed: int,
        *,
        in_flight: tuple[_Batch, ...] = (),
        step: StepSend | None = None,
    ) -> SendReport:
        return SendReport(
            bytes_sent=tuple(writes.bytes_sent.items()),
            failed=tuple(failed.items()),
            in_flight=in_flight,
            num_bytes=writes.num_bytes,
            num_failed_batches=num_failed,
            step=step,
        )

    def _send_layers(self, writes: _StepWrites, layers: range) -> None:
        # One batch per decode node: a node that fails (or is cut as lost)
        # fails only the requests it was receiving.
        by_node: dict[str, list[_Send]] = {}
        for s in writes.meta.sends:
            by_node.setdefault(s.grant.node_id, []).append(s)
        per_row = 2 * len(layers) * self._layout.row_bytes
        for node_id, sends in by_node.items():
            ops = self._ops(layers, sends)
            if not ops:
                continue
            done_at: list[float] = []
            fut = asyncio.run_coroutine_threadsafe(
                self._submit(ops, writes.meta.timeout_s, done_at), self._loop
            )
            batch = _Batch(node_id, tuple(s.request_id for s in sends), fut, done_at)
            writes.batches.append(batch)
            for s in sends:
                rows = sum(n for *_, n in s.runs)
                writes.bytes_sent[s.request_id] = (
                    writes.bytes_sent.get(s.request_id, 0) + per_row * rows
                )
            writes.num_bytes += sum(op[4] for op in ops)

    def _ops(self, layers: range, sends: list[_Send]) -> list[KVWrite]:
        mine = self._layout
        row = mine.row_bytes
        # This node's layer i is the model's (and the decode node's) lo + i.
        lo = self._span.lo
        ops: list[KVWrite] = []
        for s in sends:
            g = s.grant
            for layer in layers:
                for kv in (0, 1):
                    for src, dst, r0, n in s.runs:
                        ops.append(
                            (
                                mine.offset(layer, kv, src, r0),
                                g.node_id,
                                g.segment,
                                g.layout.offset(lo + layer, kv, dst, r0),
                                n * row,
                            )
                        )
        return ops

    async def _submit(
        self, ops: list[KVWrite], timeout_s: float, done_at: list[float]
    ) -> tuple[bool, str]:
        try:
            return await self._writer.write(self._segment, ops, timeout_s)
        finally:
            # Before the future resolves: the step thread reads it after.
            done_at.append(self._clock())

    async def close(self) -> None:
        self._sinks.clear()
