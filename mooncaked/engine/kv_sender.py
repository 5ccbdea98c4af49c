"""The prefill node's side of prefill/decode disaggregation, as a KV connector.

A request that carries a ``KVGrant`` is computed as usual (reusing this
node's caches), and after each layer's forward the K and V rows that layer
wrote for the granted blocks go out as one batch of WRITEs through the
transfer engine, while the next layers compute. ``wait_for_save`` waits for
the step's batches before its results return, so when the first token is
out, the KV is in place on the decode node.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from mooncaked.engine.connector import KVConnector
from mooncaked.engine.handoff import HandoffStats, KVWrite, KVWriter, StepObserver, StepSend
from mooncaked.engine.plan import StepPlan
from mooncaked.handoff import KVGrant, KVLayout
from mooncaked.request import Request

__all__ = ["KVSender"]


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
