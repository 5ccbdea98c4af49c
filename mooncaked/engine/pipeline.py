"""One stage of a pipelined prefill group: the activations between stages.

Chunked pipeline parallelism (Mooncake's CPP): the nodes of a group each
hold a range of the model's layers, and a long prompt's chunks flow through
them, so that stage ``s`` computes chunk ``i`` while stage ``s + 1``
computes chunk ``i - 1``. Only activations cross between stages: each
chunk's residual stream after a stage's last layer, ``hidden_size`` values
a token in the model's dtype. Each stage keeps its own layers' KV (and
writes it into the decode node's granted blocks, as a prefill node does).

``StagePipe`` is an engine's side of it, on the event loop:

- **Inbound** (every stage but the head). The stage before writes each
  chunk's activations through the transfer engine into rows of this node's
  inbound segment: ``reserve`` sets a request's rows aside and opens them to
  that node's writes alone (an ``ActGrant``); ``arrived`` takes its word
  that a chunk landed, refuses one out of order, twice or outside the
  grant, and says how far the request's input now reaches (the scheduler
  computes no further); ``release`` closes the grant and frees the rows
  (rows a writer may still write stay held until its grant expires).
- **Outbound** (every stage but the last). ``after_step`` takes a step's
  output rows and queues each request's; one task per request sends them
  in order: copied into rows of this node's staging segment, written into
  the next stage's granted rows, then announced to it (``ChunkNotice``).
  ``sent`` waits until a request's output is all delivered, or raises why
  not.

The step thread never waits here: it reads its input from the inbound rows
(``act_in``, bound to the runner) and hands its output back with the step.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog
import torch

from mooncaked.engine.handoff import KVWrite, KVWriter
from mooncaked.engine.plan import StepPlan
from mooncaked.handoff import ActGrant, LayerSpan
from mooncaked.tasks import TaskSet

log = structlog.get_logger(__name__)

__all__ = [
    "ACT_IN_SEGMENT",
    "ACT_OUT_SEGMENT",
    "ChunkNotice",
    "ChunkRefused",
    "PipeStats",
    "RowBlocks",
    "RowGrants",
    "StageError",
    "StagePipe",
    "row_runs",
]

# The transfer segments of a stage's activations: the rows the stage before
# writes into (granted per request), and this stage's output waiting to be
# written to the next.
ACT_IN_SEGMENT = "act.in"
ACT_OUT_SEGMENT = "act.out"


class StageError(Exception):
    """A stage's part of a pipelined prefill failed (a write, a notice, a peer)."""


class ChunkRefused(ValueError):
    """A chunk notice that does not follow the last one (out of order, a
    duplicate, beyond the grant, or for a request this stage does not run)."""


class ChunkNotice(Protocol):
    """Tells the next stage a chunk's activations are in its rows (over the
    internal API); raises StageError when it is refused or cannot be told."""

    async def __call__(self, grant: ActGrant, seq: int, start: int, end: int) -> None: ...


class RowGrants(Protocol):
    """Opens blocks of a segment to one peer's writes (the transfer engine's
    write grants, adapted above the engine)."""

    def open_blocks(
        self,
        segment: str,
        peer: str,
        *,
        block_bytes: int,
        num_blocks: int,
        block_ids: Sequence[int],
        ttl_s: float,
    ) -> object: ...

    def close(self, handle: object) -> None: ...


class RowBlocks:
    """Blocks of rows: a free list, first freed last reused."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a row pool needs blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks, or None when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, ids: Sequence[int]) -> None:
        self._free.extend(ids)

    def check_integrity(self, in_use: int) -> None:
        """free + in use == total; RuntimeError otherwise."""
        if len(self._free) + in_use != self.num_blocks or len(set(self._free)) != len(self._free):
            raise RuntimeError(
                f"activation rows: {len(self._free)} free + {in_use} in use "
                f"!= {self.num_blocks} blocks"
            )


def row_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_row, dst_row, rows)`` runs contiguous on both sides, in order."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


@dataclass(slots=True)
class PipeStats:
    """Counters of a stage's activations, for /admin/status."""

    chunks_received: int = 0
    chunks_refused: int = 0
    chunks_sent: int = 0
    bytes_sent: int = 0
    send_failures: int = 0
    # Requests whose input rows could not be set aside (too few free).
    reserve_refused: int = 0


@dataclass(slots=True)
class _Inbound:
    grant: ActGrant
    handle: object
    deadline: float
    next_seq: int = 0
    # Prompt positions before this one have their input here.
    frontier: int = 0
    # The prompt's end: the upstream writes no further.
    end: int = 0


@dataclass(slots=True)
class _Outbound:
    grant: ActGrant
    end: int
    timeout_s: float
    queue: asyncio.Queue[tuple[int, int, torch.Tensor]] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    seq: int = 0
    # Positions before this one are delivered (announced to the next stage).
    sent_upto: int = 0
    num_bytes: int = 0
    error: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class StagePipe:
    """A stage's activations in and out (see the module docstring)."""

    def __init__(
        self,
        *,
        node_id: str,
        span: LayerSpan,
        hidden_size: int,
        dtype: torch.dtype,
        block_rows: int,
        act_in: torch.Tensor | None,
        act_out: torch.Tensor | None,
        transfer_address: str,
        writer: KVWriter | None = None,
        grants: RowGrants | None = None,
        notice: ChunkNotice | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``act_in`` / ``act_out``: the inbound and staging rows,
        ``[rows, hidden_size]`` of ``dtype``, views of the segments
        ``ACT_IN_SEGMENT`` and ``ACT_OUT_SEGMENT`` (None where the stage has
        no such side: the head takes token ids, the last sends nothing)."""
        self.node_id = node_id
        self.span = span
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.row_bytes = hidden_size * torch.empty((), dtype=dtype).element_size()
        self.block_rows = block_rows
        self.transfer_address = transfer_address
        self._clock = clock
        self._writer = writer
        self._grants = grants
        self._notice = notice
        self.stats = PipeStats()
        for name, rows, needed in (
            ("input", act_in, not span.first),
            ("output", act_out, not span.last),
        ):
            if (rows is not None) != needed:
                raise ValueError(f"layers {span.lo}..{span.hi}: {name} rows given wrongly")
            if rows is not None and (
                rows.dim() != 2
                or rows.shape[1] != hidden_size
                or rows.dtype != dtype
                or rows.shape[0] < block_rows
            ):
                raise ValueError(f"{name} rows {tuple(rows.shape)} {rows.dtype} do not fit")
        self.act_in = act_in
        self.act_out = act_out
        self._in_blocks = RowBlocks(act_in.shape[0] // block_rows) if act_in is not None else None
        self._out_blocks = (
            RowBlocks(act_out.shape[0] // block_rows) if act_out is not None else None
        )
        self._inbound: dict[str, _Inbound] = {}
        # Rows a writer may still write (its request ended before its input
        # was all in): (until, block ids), freed once the grant expires.
        self._held: list[tuple[float, list[int]]] = []
        self._outbound: dict[str, _Outbound] = {}
        self._out_freed = asyncio.Condition()
        self._tasks = TaskSet("stage-pipe")
        # Frees held rows once their grant ends (``_release_expired``).
        self._timer: asyncio.TimerHandle | None = None

    # -- inbound ---------------------------------------------------------------

    def reserve(
        self,
        request_id: str,
        start: int,
        end: int,
        *,
        upstream: str | None,
        url: str,
        ttl_s: float,
    ) -> ActGrant | None:
        """Rows for the input of prompt positions [start, end) of ``request_id``,
        open to ``upstream``'s writes for ``ttl_s`` (None: to nobody's, a
        probe); None when too few are free."""
        if self._in_blocks is None or self.act_in is None:
            raise RuntimeError("the head stage takes no activations in")
        if request_id in self._inbound:
            raise ValueError(f"request {request_id!r} has input rows already")
        if not 0 <= start < end:
            raise ValueError(f"no input positions in {start}..{end}")
        self._release_expired()
        n = -(-(end - start) // self.block_rows)
        ids = self._in_blocks.allocate(n)
        if ids is None:
            self.stats.reserve_refused += 1
            return None
        grant = ActGrant(
            node_id=self.node_id,
            url=url,
            request_id=request_id,
            transfer_address=self.transfer_address,
            segment=ACT_IN_SEGMENT,
            row_bytes=self.row_bytes,
            block_rows=self.block_rows,
            block_ids=tuple(ids),
            start=start,
        )
        handle: object = None
        if self._grants is not None and upstream is not None:
            try:
                handle = self._grants.open_blocks(
                    ACT_IN_SEGMENT,
                    upstream,
                    block_bytes=self.block_rows * self.row_bytes,
                    num_blocks=self._in_blocks.num_blocks,
                    block_ids=ids,
                    ttl_s=ttl_s,
                )
            except BaseException:
                self._in_blocks.free(ids)
                raise
        self._inbound[request_id] = _Inbound(
            grant, handle, self._clock() + ttl_s, frontier=start, end=end
        )
        return grant

    def arrived(self, request_id: str, seq: int, start: int, end: int) -> int:
        """A chunk's input landed: positions [start, end), the ``seq``-th notice
        for the request. The request's input frontier, now ``end``;
        ChunkRefused for a notice that does not follow the last one."""
        inbound = self._inbound.get(request_id)
        try:
            if inbound is None:
                raise ChunkRefused(f"this stage runs no request {request_id!r}")
            if seq != inbound.next_seq or start != inbound.frontier:
                raise ChunkRefused(
                    f"chunk {seq} at {start}..{end} does not follow chunk "
                    f"{inbound.next_seq - 1} (input in up to {inbound.frontier}): "
                    "out of order or sent twice"
                )
            if not start < end <= inbound.end:
                raise ChunkRefused(
                    f"chunk {seq} at {start}..{end} is outside the prompt's "
                    f"{inbound.grant.start}..{inbound.end}"
                )
        except ChunkRefused:
            self.stats.chunks_refused += 1
            raise
        inbound.next_seq += 1
        inbound.frontier = end
        self.stats.chunks_received += 1
        return end

    def release(self, request_id: str) -> None:
        """The request ended here: its grant closes and its rows are freed, or
        held until the grant expires where its input was not all in (the
        writer may still write them). Idempotent."""
        inbound = self._inbound.pop(request_id, None)
        if inbound is None or self._in_blocks is None:
            return
        if self._grants is not None and inbound.handle is not None:
            self._grants.close(inbound.handle)
        ids = list(inbound.grant.block_ids)
        if inbound.frontier < inbound.end:
            # Over shm a granted mapping outlives the grant: whatever the
            # writer still sends lands here until then.
            self._held.append((inbound.deadline, ids))
            self._release_expired()
        else:
            self._in_blocks.free(ids)

    def _release_expired(self) -> None:
        """Frees held rows whose grant ended; wakes itself for the next to end
        (nothing else may come to free them: the group may be gone)."""
        now = self._clock()
        keep: list[tuple[float, list[int]]] = []
        for until, ids in self._held:
            if until <= now and self._in_blocks is not None:
                self._in_blocks.free(ids)
            else:
                keep.append((until, ids))
        self._held = keep
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if keep:
            wait = min(until for until, _ in keep) - now
            self._timer = asyncio.get_running_loop().call_later(
                max(0.0, wait) + 0.01, self._release_expired
            )

    # -- outbound --------------------------------------------------------------

    def open_output(self, request_id: str, grant: ActGrant, end: int, timeout_s: float) -> None:
        """Send ``request_id``'s output for prompt positions [grant.start, end)
        into ``grant`` as its steps produce it."""
        if self._out_blocks is None:
            raise RuntimeError("the last stage sends no activations")
        if request_id in self._outbound:
            raise ValueError(f"request {request_id!r} sends its output already")
        if grant.row_bytes != self.row_bytes or grant.end < end:
            raise ValueError(
                f"the next stage's rows ({grant.row_bytes} bytes, up to {grant.end}) do not "
                f"hold this stage's output ({self.row_bytes} bytes, up to {end})"
            )
        if self._writer is not None:
            self._writer.add_peer(grant.node_id, grant.transfer_address)
        out = _Outbound(grant, end, timeout_s, sent_upto=grant.start)
        out.task = self._tasks.spawn(self._send_loop(out), name=f"stage-send-{request_id}")
        self._outbound[request_id] = out

    def after_step(self, plan: StepPlan, hidden: torch.Tensor) -> None:
        """Queue each chunk's output rows (``hidden``, in plan order) for its
        request's next stage."""
        lo = 0
        for chunk in plan.chunks:
            n = chunk.num_tokens
            out = self._outbound.get(chunk.request_id)
            if out is not None and out.error is None:
                out.queue.put_nowait((chunk.start_pos, chunk.end_pos, hidden[lo : lo + n]))
            lo += n

    async def sent(self, request_id: str) -> int:
        """Once the request's output is all delivered: the bytes sent; StageError
        when it cannot be."""
        out = self._outbound.get(request_id)
        if out is None:
            raise StageError(f"request {request_id!r} sends no output from here")
        await out.done.wait()
        if out.error is not None:
            raise StageError(out.error)
        return out.num_bytes

    def close_output(self, request_id: str) -> None:
        """Stop sending the request's output (idempotent); what is in flight ends."""
        out = self._outbound.pop(request_id, None)
        if out is not None and out.task is not None and not out.task.done():
            out.task.cancel()

    async def _send_loop(self, out: _Outbound) -> None:
        try:
            while out.sent_upto < out.end:
                p0, p1, rows = await out.queue.get()
                if p1 <= out.sent_upto:
                    continue  # recomputed after a preemption: delivered already
                if p0 > out.sent_upto:
                    raise StageError(f"output rows {out.sent_upto}..{p0} were never computed")
                rows = rows[out.sent_upto - p0 :]
                await self._send(out, out.sent_upto, p1, rows)
        except asyncio.CancelledError:
            out.error = out.error or "the request was cancelled"
            raise
        except Exception as exc:
            out.error = str(exc) if isinstance(exc, StageError) else repr(exc)
            self.stats.send_failures += 1
            log.warning("stage output failed", request_id=out.grant.request_id, error=out.error)
        finally:
            out.done.set()

    async def _send(self, out: _Outbound, p0: int, p1: int, rows: torch.Tensor) -> None:
        blocks = self._out_blocks
        staging = self.act_out
        if blocks is None or staging is None or self._writer is None or self._notice is None:
            raise StageError("this stage cannot send activations (no transfer engine)")
        br = self.block_rows
        # A piece at most half the staging rows, so two requests' pieces fit at once.
        piece = max(br, (blocks.num_blocks // 2) * br)
        while p0 < p1:
            q1 = min(p1, p0 + piece)
            n = q1 - p0
            ids = await self._staging_blocks(-(-n // br))
            try:
                src = [b * br + r for b in ids for r in range(br)][:n]
                with torch.inference_mode():
                    staging.index_copy_(
                        0, torch.tensor(src, dtype=torch.int64), rows[:n].to(staging.device)
                    )
                dst = out.grant.rows(p0, q1)
                rb = self.row_bytes
                writes: list[KVWrite] = [
                    (s * rb, out.grant.node_id, out.grant.segment, d * rb, k * rb)
                    for s, d, k in row_runs(src, dst)
                ]
                ok, why = await self._writer.write(ACT_OUT_SEGMENT, writes, out.timeout_s)
            finally:
                await self._free_staging(ids)
            if not ok:
                raise StageError(f"activations to {out.grant.node_id} were not written: {why}")
            await self._notice(out.grant, out.seq, p0, q1)
            out.seq += 1
            out.sent_upto = q1
            out.num_bytes += n * self.row_bytes
            self.stats.chunks_sent += 1
            self.stats.bytes_sent += n * self.row_bytes
            rows = rows[n:]
            p0 = q1

    async def _staging_blocks(self, n: int) -> list[int]:
        blocks = self._out_blocks
        if blocks is None or n > blocks.num_blocks:
            raise StageError(f"{n} staging blocks asked of {blocks.num_blocks if blocks else 0}")
        async with self._out_freed:
            while (ids := blocks.allocate(n)) is None:
                await self._out_freed.wait()
        return ids

    async def _free_staging(self, ids: list[int]) -> None:
        if self._out_blocks is None:
            return
        self._out_blocks.free(ids)
        async with self._out_freed:
            self._out_freed.notify_all()

    # -- whole -----------------------------------------------------------------

    def status(self) -> dict[str, object]:
        held = sum(len(ids) for _, ids in self._held)
        return {
            "layers": [self.span.lo, self.span.hi],
            "num_layers": self.span.num_layers,
            "inbound_requests": len(self._inbound),
            "outbound_requests": len(self._outbound),
            "input_blocks_free": self._in_blocks.num_free if self._in_blocks else None,
            "input_blocks_held": held,
            "output_blocks_free": self._out_blocks.num_free if self._out_blocks else None,
            **{k: getattr(self.stats, k) for k in self.stats.__slots__},  # type: ignore[attr-defined]
        }

    def check_integrity(self) -> None:
        """Every row block free, reserved or held; RuntimeError otherwise."""
        if self._in_blocks is not None:
            used = sum(len(i.grant.block_ids) for i in self._inbound.values())
            used += sum(len(ids) for _, ids in self._held)
            self._in_blocks.check_integrity(used)

    async def close(self) -> None:
        for rid in list(self._outbound):
            self.close_output(rid)
        await self._tasks.wait()
        for rid in list(self._inbound):
            self.release(rid)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
