"""The tiered store's offloads: blocks copied into DRAM in the background.

``TieredStore.offload`` queues a copy of blocks (device blocks after a
prefill, or host rows) into DRAM and returns at once. The queue is bounded: a
full queue drops the request (counted) and the caller gets None, so the
engine never waits on the cache. A job's future resolves once its source has
been read: only then may the engine reuse the source blocks.

Blocks that find no DRAM slot (every slot leased or being filled, or no DRAM
tier) are written straight to the SSD from a staging copy, so a prefix longer
than DRAM keeps its head in DRAM and its tail on SSD.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import torch

from mooncaked.cache.buffers import BlockBuffer, copy_in
from mooncaked.cache.dram import DramPool
from mooncaked.cache.hashing import BlockHash
from mooncaked.cache.ssd_writer import SsdWriter
from mooncaked.cache.stats import StoreStats
from mooncaked.tasks import JobQueue

# Runs a copy function in the store's copy threads.
RunCopy = Callable[..., Awaitable[None]]


@dataclass(slots=True)
class _OffloadJob:
    hashes: list[BlockHash]
    src: BlockBuffer
    future: asyncio.Future[int]
    generation: int


class Offloader(JobQueue[_OffloadJob]):
    """The offload queue of one store; its worker task runs ``serve``."""

    def __init__(
        self,
        dram: DramPool,
        ssd_writer: SsdWriter,
        stats: StoreStats,
        max_queued: int,
        run_copy: RunCopy,
    ) -> None:
        super().__init__(max_queued, "store.offload_failed")
        self._dram, self._ssd_writer, self._stats = dram, ssd_writer, stats
        self._run_copy = run_copy
        # Bumped by clear(): a job that started before it stores nothing.
        self._generation = 0

    def submit(self, hashes: Sequence[BlockHash], src: BlockBuffer) -> asyncio.Future[int] | None:
        """Queue a copy of blocks into DRAM; None when the queue is full (dropped)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        todo = [h for h in hashes if not self._dram.has(h)]
        self._dram.touch(hashes)
        if not todo:
            fut.set_result(0)
            return fut
        if not self.offer(_OffloadJob(list(hashes), src, fut, self._generation)):
            self._stats.offloads_dropped += 1
            return None
        self._stats.offloads += 1
        return fut

    def clear(self) -> None:
        """Drop the queued offloads (their futures resolve to 0); those in flight
        store nothing."""
        self._generation += 1
        for job in self.take_all():
            if not job.future.done():
                job.future.set_result(0)

    async def handle(self, job: _OffloadJob) -> None:
        try:
            stored = await self._offload(job)
        except Exception as exc:
            if not job.future.done():
                job.future.set_exception(exc)
                # Retrieved here: a caller may have dropped the future.
                job.future.exception()
            raise
        if not job.future.done():
            job.future.set_result(stored)

    async def _offload(self, job: _OffloadJob) -> int:
        dram = self._dram
        rows: list[int] = []
        slots: list[int] = []
        # Blocks that found no DRAM slot go to the SSD (see the module docstring).
        overflow: list[int] = []
        seen: set[BlockHash] = set()
        for i, h in enumerate(job.hashes):
            if h in seen or dram.has(h):
                continue
            seen.add(h)
            slot = dram.allocate(h) if not overflow else None
            if slot is not None:
                rows.append(i)
                slots.append(slot)
            elif self._ssd_writer.wants(h):
                overflow.append(i)
        staged = torch.empty((len(overflow), dram.block_bytes), dtype=torch.uint8)
        try:
            await self._run_copy(copy_in, job.src, dram, rows, slots, overflow, staged)
        except BaseException:
            for slot in slots:
                dram.abort(slot)
            raise
        if job.generation != self._generation:
            # clear() ran while the bytes were copied.
            for slot in slots:
                dram.abort(slot)
            return 0
        return self._commit(job, slots, overflow, staged)

    def _commit(
        self, job: _OffloadJob, slots: list[int], overflow: list[int], staged: torch.Tensor
    ) -> int:
        for slot in slots:
            h = self._dram.commit(slot)
            self._stats.dram.bytes_written += self._dram.block_bytes
            self._ssd_writer.stored_in_dram(h)
        queued = sum(
            self._ssd_writer.queue(job.hashes[i], staged[j]) for j, i in enumerate(overflow)
        )
        return len(slots) + queued
