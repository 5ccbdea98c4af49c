"""Transfer ops, batches and their completion: the plain data between the engine
and its transports.

An op is cut into slices; transports move slices and report each one back to
its batch from whatever thread moved it. An op is done when all its slices
are, failed at its first failed slice (or on cancel or timeout). A batch is
*settled* when no slice of it is held by any transport any more: only then
may the caller reuse or free the memory the batch touched, so ``wait()``
returns at settlement, not at the last op's verdict.
"""

from __future__ import annotations

import asyncio
import enum
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mooncaked.transfer.segment import Segment


class OpKind(enum.IntEnum):
    # Values match protocol.OpCode.
    READ = 1  # remote -> local
    WRITE = 2  # local -> remote


class OpStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


# The fields of a TransferOp after its kind: (local segment, local offset,
# remote node, remote segment, remote offset, length).
OpRange = tuple[str, int, str, str, int, int]


@dataclass(frozen=True, slots=True)
class TransferOp:
    """Move ``length`` bytes between a local segment and a remote node's segment."""

    kind: OpKind
    local_segment: str
    local_offset: int
    remote_node: str
    remote_segment: str
    remote_offset: int
    length: int

    @classmethod
    def read(cls, *where: *OpRange) -> TransferOp:
        """``length`` bytes of the remote segment into the local one."""
        return cls(OpKind.READ, *where)

    @classmethod
    def write(cls, *where: *OpRange) -> TransferOp:
        """``length`` bytes of the local segment into the remote one."""
        return cls(OpKind.WRITE, *where)


class TransferError(RuntimeError):
    """Raised by :meth:`Batch.raise_for_failures` with each failed op's reason."""

    def __init__(self, failures: list[tuple[int, str]]) -> None:
        shown = "; ".join(f"op {i}: {reason}" for i, reason in failures[:5])
        more = f" (and {len(failures) - 5} more)" if len(failures) > 5 else ""
        super().__init__(f"{len(failures)} transfer op(s) failed: {shown}{more}")
        self.failures = failures


@dataclass(slots=True)
class TransferMetrics:
    """Counters for /metrics; updated from transport threads under one lock."""

    bytes_read: int = 0
    bytes_written: int = 0
    ops_done: int = 0
    ops_failed: int = 0
    batches: int = 0
    slices_retried: int = 0
    reconnects: int = 0
    served_bytes_read: int = 0
    served_bytes_written: int = 0
    served_ops: int = 0
    served_errors: int = 0
    # Remote ops refused by a segment's access rights (a write into a
    # read-only segment, or outside a live grant): each one an attack or a bug.
    served_forbidden: int = 0
    handshakes_refused: int = 0
    bytes_by_transport: dict[str, int] = field(default_factory=dict)
    # A gauge, filled in by TransferEngine.metrics().
    queued_slices: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def snapshot(self) -> TransferMetrics:
        with self.lock:
            return TransferMetrics(
                self.bytes_read,
                self.bytes_written,
                self.ops_done,
                self.ops_failed,
                self.batches,
                self.slices_retried,
                self.reconnects,
                self.served_bytes_read,
                self.served_bytes_written,
                self.served_ops,
                self.served_errors,
                self.served_forbidden,
                self.handshakes_refused,
                dict(self.bytes_by_transport),
                self.queued_slices,
            )

    def add(self, name: str, value: int) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + value)


@dataclass(slots=True, eq=False)
class Slice:
    """A contiguous piece of one op, the unit a transport moves and retries."""

    batch: Batch
    op_index: int
    kind: OpKind
    local: Segment
    local_offset: int
    remote_name: str
    remote_offset: int
    length: int
    transport: str
    attempts: int = 0

    @property
    def live(self) -> bool:
        """False once the op has a verdict (failed elsewhere, cancelled, timed out)."""
        return self.batch._status[self.op_index] is OpStatus.PENDING


class Batch:
    """A submitted batch: per-op status, cancel, and await until settled."""

    def __init__(
        self,
        ops: Sequence[TransferOp],
        loop: asyncio.AbstractEventLoop,
        metrics: TransferMetrics,
        on_settled: Callable[[Batch], None] | None = None,
    ) -> None:
        self.ops = tuple(ops)
        n = len(self.ops)
        self._status = [OpStatus.PENDING] * n
        self._reasons: list[str | None] = [None] * n
        self._remaining = [0] * n
        self._transports: list[str] = [""] * n
        self._outstanding = 0
        self._sealed = False
        self._lock = threading.Lock()
        self._loop = loop
        self._settled = asyncio.Event()
        self._metrics = metrics
        self._on_settled = on_settled
        self._num_pending = n
        self._bytes_done = 0

    # -- caller's side --------------------------------------------------

    def __len__(self) -> int:
        return len(self.ops)

    def status(self, index: int) -> OpStatus:
        return self._status[index]

    def reason(self, index: int) -> str | None:
        """Why op ``index`` failed, or None."""
        return self._reasons[index]

    def transport(self, index: int) -> str:
        """The transport that carried op ``index`` ("tcp", "shm", "rdma", "local")."""
        return self._transports[index]

    @property
    def statuses(self) -> list[OpStatus]:
        return list(self._status)

    @property
    def done(self) -> bool:
        """Every op has a verdict and no slice is in flight."""
        return self._settled.is_set()

    @property
    def ok(self) -> bool:
        return self.done and all(s is OpStatus.DONE for s in self._status)

    @property
    def bytes_done(self) -> int:
        return self._bytes_done

    def failures(self) -> list[tuple[int, str]]:
        return [
            (i, self._reasons[i] or "failed")
            for i, s in enumerate(self._status)
            if s is OpStatus.FAILED
        ]

    async def wait(self) -> bool:
        """Wait until the batch settles; True if every op succeeded.

        Ops carry their own deadline (see ``TransferEngine.submit``), so this
        always returns; wrap it in ``asyncio.timeout`` to stop waiting sooner.
        """
        await self._settled.wait()
        return self.ok

    def raise_for_failures(self) -> None:
        failures = self.failures()
        if failures:
            raise TransferError(failures)

    def cancel(self, reason: str = "cancelled") -> int:
        """Fail every op without a verdict yet; returns how many.

        Slices already on the wire finish or fail on their own; ``wait()``
        returns once they have, and the memory is free to reuse then.
        """
        return self.fail_pending(reason)

    # -- transports' side (any thread) ------------------------------------

    def _add_slices(self, op_index: int, count: int, transport: str) -> None:
        """Engine, before handing slices to transports."""
        with self._lock:
            self._remaining[op_index] += count
            self._outstanding += count
            self._transports[op_index] = transport

    def _seal(self) -> None:
        """Engine, after every slice went out: settlement may now fire."""
        with self._lock:
            self._sealed = True
            fire = self._outstanding == 0
        if fire:
            self._fire_settled()

    def slice_done(self, s: Slice) -> None:
        self._complete([(s.op_index, s.length)])

    def slices_done(self, slices: Sequence[Slice]) -> None:
        """Report finished slices (all of this batch) under one lock."""
        self._complete([(s.op_index, s.length) for s in slices])

    def ops_done(self, indices: Sequence[int]) -> None:
        """Report whole ops moved as one unit each (see ``_add_ops``)."""
        ops = self.ops
        self._complete([(i, ops[i].length) for i in indices])

    def ops_failed(self, indices: Sequence[int], reason: str) -> None:
        fire = False
        with self._lock:
            for i in indices:
                self._fail_locked(i, reason)
            self._outstanding -= len(indices)
            fire = self._sealed and self._outstanding == 0
        if fire:
            self._fire_settled()

    def _complete(self, units: Sequence[tuple[int, int]]) -> None:
        """(op index, bytes) per finished unit: a slice, or a whole op."""
        done_read = done_written = 0
        by_transport: dict[str, int] = {}
        num_done = 0
        with self._lock:
            status = self._status
            remaining = self._remaining
            for i, nbytes in units:
                if status[i] is OpStatus.PENDING:
                    remaining[i] -= 1
                    self._bytes_done += nbytes
                    if remaining[i] == 0:
                        status[i] = OpStatus.DONE
                        self._num_pending -= 1
                        num_done += 1
                        op = self.ops[i]
                        if op.kind is OpKind.READ:
                            done_read += op.length
                        else:
                            done_written += op.length
                        t = self._transports[i]
                        by_transport[t] = by_transport.get(t, 0) + op.length
            self._outstanding -= len(units)
            fire = self._sealed and self._outstanding == 0
        if num_done:
            m = self._metrics
            with m.lock:
                m.ops_done += num_done
                m.bytes_read += done_read
                m.bytes_written += done_written
                for t, n in by_transport.items():
                    m.bytes_by_transport[t] = m.bytes_by_transport.get(t, 0) + n
        if fire:
            self._fire_settled()

    def slice_failed(self, s: Slice, reason: str) -> None:
        fire = False
        with self._lock:
            self._fail_locked(s.op_index, reason)
            self._outstanding -= 1
            fire = self._sealed and self._outstanding == 0
        if fire:
            self._fire_settled()

    def slice_dropped(self, s: Slice) -> None:
        """A transport let go of a slice whose op already has a verdict."""
        self.slice_failed(s, "dropped")

    def _add_ops(self, indices: Sequence[int], transport: str) -> None:
        """Engine: these ops move as one unit each (no Slice objects)."""
        with self._lock:
            remaining = self._remaining
            transports = self._transports
            for i in indices:
                remaining[i] += 1
                transports[i] = transport
            self._outstanding += len(indices)

    def is_pending(self, op_index: int) -> bool:
        return self._status[op_index] is OpStatus.PENDING

    def _complete_empty(self, op_index: int) -> None:
        """Engine: an op of length 0 is done without moving anything."""
        with self._lock:
            if self._status[op_index] is OpStatus.PENDING:
                self._status[op_index] = OpStatus.DONE
                self._num_pending -= 1
                self._count_op(op_index, ok=True)

    def fail_op(self, op_index: int, reason: str) -> None:
        """Fail an op that has no slice in flight (checked before dispatch)."""
        with self._lock:
            self._fail_locked(op_index, reason)

    def fail_pending(self, reason: str) -> int:
        with self._lock:
            n = 0
            for i, status in enumerate(self._status):
                if status is OpStatus.PENDING:
                    self._fail_locked(i, reason)
                    n += 1
            return n

    def _fail_locked(self, i: int, reason: str) -> None:
        if self._status[i] is OpStatus.PENDING:
            self._status[i] = OpStatus.FAILED
            self._reasons[i] = reason
            self._num_pending -= 1
            self._count_op(i, ok=False)

    def _count_op(self, i: int, ok: bool) -> None:
        op = self.ops[i]
        m = self._metrics
        with m.lock:
            if ok:
                m.ops_done += 1
                if op.kind is OpKind.READ:
                    m.bytes_read += op.length
                else:
                    m.bytes_written += op.length
                t = self._transports[i]
                m.bytes_by_transport[t] = m.bytes_by_transport.get(t, 0) + op.length
            else:
                m.ops_failed += 1

    def _fire_settled(self) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._settle()
        else:
            try:
                self._loop.call_soon_threadsafe(self._settle)
            except RuntimeError:
                pass  # loop closed: nobody is waiting any more

    def _settle(self) -> None:
        if self._settled.is_set():
            return
        self._settled.set()
        if self._on_settled is not None:
            self._on_settled(self)
