"""Eviction by watermark: DRAM is kept below a high mark in the background.

Allocation evicts a block only when it finds no free slot, so a full pool
makes every offload and every peer fetch pay for an eviction (and its
demotion to the SSD) on the spot. With watermarks, when the share of DRAM
slots in use passes ``store.high_watermark``, a background task evicts
blocks in eviction order down to ``store.low_watermark``: unpinned ones,
least recently used first, then soft-pinned ones; never a block leased to a
reader or hard-pinned (``DramPool.evict``). Allocation still evicts as
before when it must.

Event-driven: the store calls ``notice`` when a block lands in DRAM (the
only time usage grows); past the high mark it sets an event the task waits
on. The task evicts in batches and yields to the loop between them, so a
long eviction never stalls the loop.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import structlog

from mooncaked.cache.dram import DramPool

log = structlog.get_logger(__name__)

# Blocks evicted between two yields to the loop.
_BATCH = 64


@dataclass(slots=True)
class WatermarkStats:
    # Times usage passed the high mark and the task ran.
    runs: int = 0
    evictions: int = 0
    # Runs that ended above the low mark: what was left was leased or pinned.
    short_runs: int = 0


class WatermarkEvictor:
    """Keeps one DRAM pool's usage under its high watermark; its task runs ``serve``."""

    def __init__(self, dram: DramPool, *, high: float, low: float) -> None:
        if not 0.0 < low < high <= 1.0:
            raise ValueError(f"watermarks must satisfy 0 < low < high <= 1, got {low} and {high}")
        self._dram = dram
        self.high, self.low = high, low
        n = dram.num_slots
        # Slot counts: past high_slots a run starts, and it evicts to low_slots.
        self.high_slots = math.floor(high * n)
        self.low_slots = math.floor(low * n)
        self._wakeup = asyncio.Event()
        self._closing = False
        self.stats = WatermarkStats()

    @property
    def enabled(self) -> bool:
        return self.high < 1.0 and self._dram.num_slots > 0

    def over(self) -> bool:
        return self._dram.num_used > self.high_slots

    def notice(self) -> None:
        """A block landed in DRAM: wake the task if usage passed the high mark."""
        if self.enabled and self.over():
            self._wakeup.set()

    def run_once(self) -> int:
        """Evict down to the low mark (one batch at most); how many were evicted."""
        excess = self._dram.num_used - self.low_slots
        if excess <= 0:
            return 0
        evicted = len(self._dram.evict(min(excess, _BATCH)))
        self.stats.evictions += evicted
        return evicted

    async def serve(self) -> None:
        """The task: each time usage passes the high mark, evict to the low mark."""
        while not self._closing:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self._closing:
                return
            if not self.over():
                continue
            self.stats.runs += 1
            while True:
                evicted = self.run_once()
                if evicted < _BATCH or self._closing:
                    break
                # A yield, not a wait: other work (a lease, a load) runs
                # between batches of evictions and their demotion copies.
                await asyncio.sleep(0)
            if self._dram.num_used > self.low_slots:
                self.stats.short_runs += 1
                log.info(
                    "store.watermark_short",
                    used=self._dram.num_used,
                    low=self.low_slots,
                    why="the rest is leased or pinned",
                )

    def stop(self) -> None:
        """End the task at its next wakeup (now, if it waits)."""
        self._closing = True
        self._wakeup.set()
