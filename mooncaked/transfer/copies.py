"""Copies that cross no socket: ops to this node, and ops over shared memory.

Both run in a small pool of worker threads (``ctypes.memmove`` drops the
GIL). A small op between host memory is one memcpy (a ``Copy``); copies are
grouped into jobs of about ``COPY_JOB_BYTES`` and each job reports its ops at
once. A bigger or device op is cut into slices first, and the transport's
function copies them, a job of slices at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import structlog

from mooncaked.transfer.batch import Batch, OpKind, Slice
from mooncaked.transfer.segment import SegmentTable, memmove
from mooncaked.transfer.shm import ShmMapping, ShmPeer, copy_slice

log = structlog.get_logger(__name__)

# Copies (shm, local) run in this many worker threads.
COPY_WORKERS = 2
# One copy job moves at most this much, so a big batch spreads over workers.
COPY_JOB_BYTES = 16 * 1024 * 1024


# A whole op moved by one memcpy: (op index, destination, source, length),
# with raw addresses into memory the job keeps referenced.
Copy = tuple[int, int, int, int]


def copy_item(index: int, kind: OpKind, here: int, there: int, length: int) -> Copy:
    """A READ copies there -> here, a WRITE here -> there."""
    return (index, here, there, length) if kind is OpKind.READ else (index, there, here, length)


def _copy_ops(
    batch: Batch, items: list[Copy], shm: ShmPeer | None, mapping: ShmMapping | None
) -> None:
    """Worker thread: memcpy whole ops of one batch, report them at once.

    ``mapping`` (a peer's segment, held here so its addresses stay mapped) is
    checked for revocation once per job; ops cancelled meanwhile are skipped.
    """
    indices = [item[0] for item in items]
    if shm is not None and mapping is not None:
        reason = shm.check_live(mapping)
        if reason is not None:
            batch.ops_failed(indices, reason)
            return
    pending = batch.is_pending
    for i, dst, src, length in items:
        if pending(i):
            memmove(dst, src, length)
    batch.ops_done(indices)


def copy_local(table: SegmentTable, slices: list[Slice]) -> None:
    """Worker thread: slices whose remote segment is this node's own."""
    for s in slices:
        if not s.live:
            s.batch.slice_dropped(s)
            continue
        remote = table.get(s.remote_name)
        if remote is None:
            s.batch.slice_failed(s, f"segment {s.remote_name!r} was unregistered")
            continue
        try:
            if remote.is_host:
                copy_slice(s, remote.address + s.remote_offset)
            elif s.kind is OpKind.READ:
                view, commit = s.local.destination(s.local_offset, s.length)
                view[:] = remote.source(s.remote_offset, s.length)
                if commit is not None:
                    commit()
            else:
                view, commit = remote.destination(s.remote_offset, s.length)
                view[:] = s.local.source(s.local_offset, s.length)
                if commit is not None:
                    commit()
        except Exception as exc:
            s.batch.slice_failed(s, f"local copy failed: {exc!r}")
            continue
        s.batch.slice_done(s)


class CopyPool:
    """The engine's copy threads and the jobs in flight on them."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: set[Future[None]] = set()

    def start(self) -> None:
        self._pool = ThreadPoolExecutor(COPY_WORKERS, thread_name_prefix="xfer-copy")

    async def close(self) -> None:
        """Wait for the jobs in flight, then end the threads."""
        if self._jobs:
            await asyncio.gather(
                *(asyncio.wrap_future(j) for j in list(self._jobs)), return_exceptions=True
            )
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def run_slices(self, slices: list[Slice], fn: Callable[[list[Slice]], None]) -> None:
        """Split slices into jobs of about COPY_JOB_BYTES for ``fn`` in the pool."""
        self._check_running()
        job: list[Slice] = []
        size = 0
        for s in slices:
            job.append(s)
            size += s.length
            if size >= COPY_JOB_BYTES:
                self._submit(fn, job)
                job, size = [], 0
        if job:
            self._submit(fn, job)

    def run_ops(
        self,
        batch: Batch,
        items: list[Copy],
        transport: str,
        shm: ShmPeer | None,
        mapping: ShmMapping | None,
    ) -> None:
        """Whole-op memcpys in jobs of about COPY_JOB_BYTES (see ``_copy_ops``)."""
        self._check_running()
        batch._add_ops([item[0] for item in items], transport)
        job: list[Copy] = []
        size = 0
        for item in items:
            job.append(item)
            size += item[3]
            if size >= COPY_JOB_BYTES:
                self._submit(_copy_ops, batch, job, shm, mapping)
                job, size = [], 0
        if job:
            self._submit(_copy_ops, batch, job, shm, mapping)

    def _check_running(self) -> None:
        if self._pool is None:
            raise RuntimeError("the transfer engine is not running")

    def _submit(self, fn: Any, *args: Any) -> None:
        future = self._pool.submit(fn, *args)  # type: ignore[union-attr]
        self._jobs.add(future)
        future.add_done_callback(self._job_done)

    def _job_done(self, future: Future[None]) -> None:
        self._jobs.discard(future)
        exc = future.exception()
        if exc is not None:
            log.error("transfer copy job failed", error=repr(exc))
