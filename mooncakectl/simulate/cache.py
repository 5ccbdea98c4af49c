"""A simulated node's KV block cache: DRAM with LRU and a capacity, and an
optional SSD tier that takes what DRAM evicts.

Blocks are named by their hash (the unit the Conductor's index counts);
each sits in one tier. Every change is also recorded for gossip
(``take_changes``), so the cluster index other nodes read lags as a real
one does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from mooncaked.cache.tiers import Tier
from mooncaked.cluster.state import tier_mask

DRAM_MASK = tier_mask(Tier.DRAM)
SSD_MASK = tier_mask(Tier.SSD)


class BlockCache:
    def __init__(self, dram_blocks: int, ssd_blocks: int = 0) -> None:
        if dram_blocks < 0 or ssd_blocks < 0:
            raise ValueError(
                f"cache capacities must be >= 0 blocks, got dram={dram_blocks} ssd={ssd_blocks}"
            )
        self.dram_blocks = dram_blocks
        self.ssd_blocks = ssd_blocks
        # Least recently used first.
        self._dram: OrderedDict[bytes, None] = OrderedDict()
        self._ssd: OrderedDict[bytes, None] = OrderedDict()
        # hash -> tier mask now (0: gone), since the last take_changes().
        self._changes: dict[bytes, int] = {}
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._dram) + len(self._ssd)

    def prefix(self, hashes: Sequence[bytes], limit: int) -> tuple[int, int]:
        """(leading blocks held, of which on SSD), at most ``limit``; no change."""
        n = ssd = 0
        dram, on_ssd = self._dram, self._ssd
        for h in hashes[:limit]:
            if h in dram:
                n += 1
            elif h in on_ssd:
                n += 1
                ssd += 1
            else:
                break
        return n, ssd

    def use(self, hashes: Sequence[bytes]) -> None:
        """Mark ``hashes`` just used; those on SSD are read back into DRAM."""
        for h in hashes:
            if h in self._dram:
                self._dram.move_to_end(h)
            else:
                self.insert((h,))

    def insert(self, hashes: Sequence[bytes]) -> None:
        """Put ``hashes`` in DRAM as most recently used, evicting the least."""
        if self.dram_blocks == 0:
            return
        dram, changes = self._dram, self._changes
        for h in hashes:
            if h in dram:
                dram.move_to_end(h)
                continue
            if h in self._ssd:
                del self._ssd[h]
            dram[h] = None
            changes[h] = DRAM_MASK
            if len(dram) > self.dram_blocks:
                old, _ = dram.popitem(last=False)
                self._demote(old)

    def _demote(self, h: bytes) -> None:
        if self.ssd_blocks == 0:
            self._changes[h] = 0
            self.num_evicted += 1
            return
        self._ssd[h] = None
        self._changes[h] = SSD_MASK
        if len(self._ssd) > self.ssd_blocks:
            old, _ = self._ssd.popitem(last=False)
            self._changes[old] = 0
            self.num_evicted += 1

    def take_changes(self) -> dict[bytes, int]:
        out, self._changes = self._changes, {}
        return out

    def check_integrity(self) -> None:
        if len(self._dram) > self.dram_blocks or len(self._ssd) > self.ssd_blocks:
            raise RuntimeError("a cache tier holds more blocks than its capacity")
        if self._dram.keys() & self._ssd.keys():
            raise RuntimeError("a block sits in DRAM and on SSD at once")
