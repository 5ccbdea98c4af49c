"""Counters of the tiered store, per tier and for the store as a whole.

The store moves these as it works; ``TieredStore.stats()`` returns a copy
with the gauges (used and capacity blocks, leases) filled in, which
``/metrics`` and ``/admin/cache/stats`` render.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TierStats:
    # Lookups: blocks of the usable prefix found here / looked for here and not found.
    hits: int = 0
    misses: int = 0
    # Loads: bytes served out of this tier; stores: bytes written into it.
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    evictions: int = 0
    # Gauges, filled by stats().
    used_blocks: int = 0
    capacity_blocks: int = 0
    block_bytes: int = 0

    @property
    def hit_ratio(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0


@dataclass(slots=True)
class StoreStats:
    dram: TierStats = field(default_factory=TierStats)
    ssd: TierStats = field(default_factory=TierStats)
    loads: int = 0
    blocks_loaded: int = 0
    offloads: int = 0
    offloads_dropped: int = 0
    ssd_writes_queued: int = 0
    ssd_writes_dropped: int = 0
    ssd_demotions: int = 0
    ssd_corrupt_dropped: int = 0
    ssd_io_errors: int = 0
    dram_leases: int = 0
    dram_expired_leases: int = 0
    event_listener_errors: int = 0
    # Eviction by watermark: runs of the background task, blocks it evicted.
    watermark_runs: int = 0
    watermark_evictions: int = 0
