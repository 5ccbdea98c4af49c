"""The tiered store's SSD writes: one bounded queue of blocks and its writers.

Two kinds of block go down to the SSD in the background: with
``ssd_write_through`` every block stored in DRAM, and a block evicted from
DRAM that the SSD lacks (demoted: copied out before its slot is reused). Both
share one bounded queue; a full queue drops the write (and counts it), never
waits. A queued write is registered by hash, which dedupes writes and lets an
eviction attach the bytes to a write that would otherwise read them from the
DRAM slot about to be reused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mooncaked.cache.dram import DramPool
from mooncaked.cache.hashing import BlockHash
from mooncaked.cache.ssd import SsdTier
from mooncaked.cache.stats import StoreStats
from mooncaked.config import StoreConfig
from mooncaked.tasks import JobQueue

# Internal readers (local loads, the SSD writer) end their leases in `finally`;
# only peers need a deadline.
NO_DEADLINE = math.inf


@dataclass(slots=True)
class _SsdJob:
    block_hash: BlockHash
    # None: read the bytes from the block's DRAM slot when the job runs. An
    # eviction before then attaches a copy here (the slot is about to be reused).
    data: torch.Tensor | None = None


class SsdWriter(JobQueue[_SsdJob]):
    """Queued SSD writes of one store; its writer tasks run ``serve``."""

    def __init__(
        self, dram: DramPool, ssd: SsdTier | None, stats: StoreStats, config: StoreConfig
    ) -> None:
        # One failed write loses one block; the writers keep going.
        super().__init__(config.ssd_write_queue, "store.ssd_write_failed")
        self._dram, self._ssd, self._stats = dram, ssd, stats
        self._write_through = config.ssd_write_through
        # Queued SSD writes by hash: dedupes them, and lets an eviction attach bytes.
        self._jobs: dict[BlockHash, _SsdJob] = {}

    def wants(self, block_hash: BlockHash) -> bool:
        """There is an SSD, it lacks the block and no write of it is queued."""
        ssd = self._ssd
        return ssd is not None and not ssd.has(block_hash) and block_hash not in self._jobs

    def stored_in_dram(self, block_hash: BlockHash) -> None:
        """A block just stored in DRAM: queued for the SSD too with write-through."""
        if self._write_through:
            self.queue(block_hash, None)

    def queue(self, block_hash: BlockHash, data: torch.Tensor | None) -> bool:
        """Queue a write of a block (``data``, or its DRAM slot's bytes when None);
        False when the SSD has it, there is no SSD, or the queue is full."""
        ssd = self._ssd
        if ssd is None or ssd.has(block_hash):
            return False
        job = self._jobs.get(block_hash)
        if job is not None:
            if job.data is None and data is not None:
                job.data = data
            return True
        job = _SsdJob(block_hash, data)
        if not self.offer(job):
            self._stats.ssd_writes_dropped += 1
            return False
        self._jobs[block_hash] = job
        self._stats.ssd_writes_queued += 1
        return True

    def demote(self, block_hash: BlockHash, slot: int) -> None:
        """An evicted DRAM block the SSD lacks: copy it out before its slot is reused."""
        ssd = self._ssd
        if ssd is None or ssd.has(block_hash):
            return
        job = self._jobs.get(block_hash)
        if job is not None and job.data is not None:
            return
        if job is None and self._q.full():
            self._stats.ssd_writes_dropped += 1
            return
        # A synchronous copy of one block: the slot is reused right after this
        # returns, and a copy is cheaper than making the allocator wait.
        if self.queue(block_hash, self._dram.slot(slot).clone()):
            self._stats.ssd_demotions += 1

    def clear(self) -> None:
        """Forget the queued writes: the writers skip them once unregistered."""
        self._jobs.clear()

    def forget(self, hashes: Sequence[BlockHash]) -> None:
        """Forget the queued writes of blocks just removed (a write already
        under way still lands)."""
        for h in hashes:
            self._jobs.pop(h, None)

    def check_integrity(self) -> None:
        if len(self._jobs) > self._q.qsize():
            raise RuntimeError(
                f"{len(self._jobs)} SSD jobs registered but {self._q.qsize()} queued"
            )

    async def handle(self, job: _SsdJob) -> None:
        if self._jobs.get(job.block_hash) is not job:
            return  # dropped by clear()
        del self._jobs[job.block_hash]
        await self._write(job)

    async def _write(self, job: _SsdJob) -> None:
        ssd = self._ssd
        if ssd is None or ssd.has(job.block_hash):
            return
        if job.data is not None:
            await ssd.put(job.block_hash, job.data)
            return
        lease = self._dram.lease([job.block_hash], "ssd-writer", NO_DEADLINE)
        if lease is None:
            return  # removed from DRAM (not evicted: that would have attached a copy)
        try:
            await ssd.put(job.block_hash, self._dram.slot(lease.slot_ids[0]))
        finally:
            self._dram.release(lease)
