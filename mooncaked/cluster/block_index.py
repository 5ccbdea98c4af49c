"""The cluster-wide block index: which node holds which block, in which tiers.

The index is one replica per node, ``NodeBlocks``: a dict from the 16-byte
block hash to a tier bitmask (bit 0 device, bit 1 DRAM, bit 2 SSD; a block may
sit in several tiers of one node at once). Each node publishes its own
changes (``BlockLog``) as a versioned stream of ``BlockDelta`` batches. A delta
carries *absolute* masks (0 = gone), coalesced so a hash appears at most once
in it, upserts first and removals last. That choice makes applying a batch two
C-level loops (``dict.update`` over the upserts, ``pop`` over the removals)
instead of one Python step per event, and it makes overlap harmless: a delta
``[from, to)`` may be applied to any replica at version ``v`` with
``from <= v < to``, since every hash it names ends at its value as of ``to``.
Only a gap (``from > v``) needs a pull.

Versions count entries of the flushed batches, so a batch can be cut at any
entry into sub-deltas that still chain (``[a, a+k)``, ``[a+k, b)``): that is
how a batch too big for one datagram still travels by gossip.

Memory (measured with tracemalloc, CPython 3.11, x86-64, ``tools/bench_gossip.py``):
a replica of 1M blocks costs about 91 MB (the dict and its 1M 16-byte ``bytes``
keys; the masks are cached small ints), i.e. ~91 bytes per block per node that
holds it. The cluster pays that once per (node, block) pair in every node's
view, so N nodes each caching B blocks cost ~91·N·B bytes on every node:
100 nodes with 1M blocks each is ~9.1 GB per node, which is where a shared
interned key table or a numpy open-addressing table would be the next step.
Applying deltas from the wire runs at about 2.3M events per CPU second (same
benchmark, 1,000-event batches); the dict insertions themselves dominate.

Plain data, no I/O: the gossip package replicates it, ``ClusterView``
(``cluster/state.py``) holds one replica per member.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mooncaked.cache.hashing import BLOCK_HASH_BYTES
from mooncaked.cache.tiers import Tier


class BlockOp(enum.StrEnum):
    STORED = "stored"
    REMOVED = "removed"


# Tier -> its bit in a mask; accepts the enum, its int value and its name.
_TIER_BIT: dict[Any, int] = {}
for _t in Tier:
    _TIER_BIT[_t] = 1 << _t.value
    _TIER_BIT[_t.name.lower()] = 1 << _t.value
# Mask -> the value of the fastest tier in it (index 0 unused: a mask of 0 means absent).
FASTEST_TIER: tuple[int, ...] = tuple(
    0 if m == 0 else next(t for t in range(3) if m & (1 << t)) for m in range(8)
)
ALL_TIERS_MASK = 0b111

BlockEvent = tuple[bytes, "Tier | int | str", "BlockOp | str"]


def tier_mask(*tiers: Tier | int | str) -> int:
    """The bitmask of some tiers, by enum, value or name ("device", "dram", "ssd")."""
    mask = 0
    for t in tiers:
        bit = _TIER_BIT.get(t)
        if bit is None:
            raise ValueError(f"unknown tier {t!r}; use a Tier or one of device, dram, ssd")
        mask |= bit
    return mask


@dataclass(frozen=True, slots=True)
class BlockDelta:
    """A batch of one node's block-index changes, ``[from_version, to_version)``.

    ``hashes`` holds ``n`` packed 16-byte hashes, ``masks`` ``n`` tier bitmasks;
    entries ``[0, num_upserts)`` have nonzero masks, the rest are removals. A
    snapshot replaces the replica instead of patching it.
    """

    node_id: str
    generation: int
    from_version: int
    to_version: int
    hashes: bytes
    masks: bytes
    num_upserts: int
    is_snapshot: bool = False

    @property
    def num_entries(self) -> int:
        return len(self.masks)

    def split(self, max_entries: int) -> list[BlockDelta]:
        """Cut a fresh (uncoalesced-across-batches) delta into chained pieces.

        Only valid when ``to_version - from_version == num_entries``, i.e. a
        batch as flushed, never a merged or snapshot delta.
        """
        n = self.num_entries
        if self.is_snapshot or self.to_version - self.from_version != n:
            raise RuntimeError("only a freshly flushed batch can be split by version")
        if n <= max_entries:
            return [self]
        return self._pieces(max_entries, chained=True)

    def chunks(self, max_entries: int) -> list[BlockDelta]:
        """Pieces of at most ``max_entries`` that ``join_chunks`` reassembles.

        Every piece keeps the whole delta's versions, so a piece alone must not
        be applied; this is how a big snapshot crosses a bounded TCP message.
        """
        if self.num_entries <= max_entries:
            return [self]
        return self._pieces(max_entries, chained=False)

    def _pieces(self, max_entries: int, *, chained: bool) -> list[BlockDelta]:
        """Consecutive pieces of at most ``max_entries``, upserts kept first in
        each; ``chained`` pieces carry versions of their own, the others the
        whole delta's."""
        n = self.num_entries
        out = []
        for start in range(0, n, max_entries):
            end = min(n, start + max_entries)
            if chained:
                versions = (self.from_version + start, self.from_version + end)
            else:
                versions = (self.from_version, self.to_version)
            out.append(
                BlockDelta(
                    self.node_id,
                    self.generation,
                    *versions,
                    self.hashes[start * BLOCK_HASH_BYTES : end * BLOCK_HASH_BYTES],
                    self.masks[start:end],
                    max(0, min(self.num_upserts, end) - start),
                    self.is_snapshot,
                )
            )
        return out


def join_chunks(pieces: Sequence[BlockDelta]) -> BlockDelta:
    """Reassemble ``BlockDelta.chunks`` output; raises ValueError if they do not belong together."""
    if not pieces:
        raise ValueError("join_chunks needs at least one piece")
    first = pieces[0]
    if len(pieces) == 1:
        return first
    ident = (
        first.node_id,
        first.generation,
        first.from_version,
        first.to_version,
        first.is_snapshot,
    )
    up_h: list[bytes] = []
    up_m: list[bytes] = []
    rm_h: list[bytes] = []
    for p in pieces:
        if (p.node_id, p.generation, p.from_version, p.to_version, p.is_snapshot) != ident:
            raise ValueError("block delta pieces of different deltas cannot be joined")
        cut = p.num_upserts * BLOCK_HASH_BYTES
        up_h.append(p.hashes[:cut])
        up_m.append(p.masks[: p.num_upserts])
        rm_h.append(p.hashes[cut:])
    num_upserts = sum(p.num_upserts for p in pieces)
    num_entries = sum(p.num_entries for p in pieces)
    return BlockDelta(
        first.node_id,
        first.generation,
        first.from_version,
        first.to_version,
        b"".join(up_h) + b"".join(rm_h),
        b"".join(up_m) + bytes(num_entries - num_upserts),
        num_upserts,
        first.is_snapshot,
    )


def split_hashes(packed: bytes) -> list[bytes]:
    """Packed 16-byte hashes -> a list of ``bytes`` (numpy does the slicing in C)."""
    if not packed:
        return []
    return np.frombuffer(packed, dtype=f"V{BLOCK_HASH_BYTES}").tolist()


class ApplyResult(enum.Enum):
    APPLIED = "applied"
    # Already covered by this replica (a duplicate or an older generation).
    STALE = "stale"
    # Starts past this replica's version: a batch is missing, pull to repair.
    GAP = "gap"


class NodeBlocks:
    """One node's block index as replicated here: hash -> tier bitmask."""

    __slots__ = ("generation", "masks", "version")

    def __init__(self, generation: int = 0) -> None:
        self.generation = generation
        self.version = 0
        self.masks: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self.masks)

    def reset(self, generation: int) -> None:
        self.generation = generation
        self.version = 0
        self.masks = {}

    def apply(self, delta: BlockDelta) -> ApplyResult:
        if delta.generation < self.generation:
            return ApplyResult.STALE
        if delta.generation > self.generation:
            # The node restarted: whatever it held before is gone or re-announced.
            self.reset(delta.generation)
        if delta.is_snapshot:
            if delta.to_version < self.version:
                return ApplyResult.STALE
            keys = split_hashes(delta.hashes)
            n_up = delta.num_upserts
            self.masks = dict(zip(keys[:n_up], delta.masks[:n_up], strict=True))
            self.version = delta.to_version
            return ApplyResult.APPLIED
        if delta.to_version <= self.version:
            return ApplyResult.STALE
        if delta.from_version > self.version:
            return ApplyResult.GAP
        keys = split_hashes(delta.hashes)
        n_up = delta.num_upserts
        masks = self.masks
        if n_up:
            masks.update(zip(keys[:n_up], delta.masks[:n_up], strict=True))
        pop = masks.pop
        for key in keys[n_up:]:
            pop(key, None)
        self.version = delta.to_version
        return ApplyResult.APPLIED

    def snapshot(self, node_id: str) -> BlockDelta:
        masks = self.masks
        return BlockDelta(
            node_id,
            self.generation,
            0,
            self.version,
            b"".join(masks.keys()),
            bytes(masks.values()),
            len(masks),
            is_snapshot=True,
        )


def merge_deltas(deltas: Sequence[BlockDelta]) -> BlockDelta:
    """Coalesce consecutive deltas of one node into one (later entries win)."""
    if not deltas:
        raise ValueError("merge_deltas needs at least one delta")
    first, last = deltas[0], deltas[-1]
    if len(deltas) == 1:
        return first
    merged: dict[bytes, int] = {}
    for d in deltas:
        keys = split_hashes(d.hashes)
        merged.update(zip(keys, d.masks, strict=True))
    return _delta_from_dict(
        first.node_id, first.generation, first.from_version, last.to_version, merged
    )


def _delta_from_dict(
    node_id: str, generation: int, from_version: int, to_version: int, entries: dict[bytes, int]
) -> BlockDelta:
    ups = [k for k, m in entries.items() if m]
    rms = [k for k, m in entries.items() if not m]
    masks = bytes(m for m in entries.values() if m) + bytes(len(rms))
    return BlockDelta(
        node_id,
        generation,
        from_version,
        to_version,
        b"".join(itertools.chain(ups, rms)),
        masks,
        len(ups),
    )


class BlockLog:
    """The publishing side of this node's own block index.

    ``record`` updates the local replica at once (so the local Conductor sees
    it) and remembers the net change per hash; ``flush`` turns those into one
    delta batch and keeps recent batches so a lagging peer gets a delta rather
    than a full snapshot.
    """

    def __init__(
        self, node_id: str, generation: int, index: NodeBlocks, max_log_entries: int
    ) -> None:
        if index.generation != generation:
            raise RuntimeError("the local index must carry this process's generation")
        self.node_id = node_id
        self.generation = generation
        self.index = index
        self.max_log_entries = max_log_entries
        self._pending: dict[bytes, int] = {}
        self._log: deque[BlockDelta] = deque()
        self._log_entries = 0
        # Version of the oldest batch still in the log (0: the log is complete).
        self._log_start = 0
        self.num_events = 0

    @property
    def version(self) -> int:
        return self.index.version

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def record(self, events: Iterable[BlockEvent]) -> int:
        """Apply local (hash, tier, stored|removed) events; returns how many changed a mask."""
        masks = self.index.masks
        pending = self._pending
        tier_bit = _TIER_BIT
        changed = 0
        seen = 0
        for block_hash, tier, op in events:
            seen += 1
            bit = tier_bit.get(tier)
            if bit is None:
                raise ValueError(f"unknown tier {tier!r}; use a Tier or one of device, dram, ssd")
            if len(block_hash) != BLOCK_HASH_BYTES:
                raise ValueError(
                    f"block hashes are {BLOCK_HASH_BYTES} bytes, got {len(block_hash)}"
                )
            old = masks.get(block_hash, 0)
            if op == "stored":
                new = old | bit
            elif op == "removed":
                new = old & ~bit
            else:
                raise ValueError(f"unknown block op {op!r}; use 'stored' or 'removed'")
            if new == old:
                continue
            if new:
                masks[block_hash] = new
            else:
                del masks[block_hash]
            pending[block_hash] = new
            changed += 1
        self.num_events += seen
        return changed

    def flush(self) -> BlockDelta | None:
        """Seal the pending changes as the next batch; None when nothing changed."""
        if not self._pending:
            return None
        entries, self._pending = self._pending, {}
        start = self.index.version
        delta = _delta_from_dict(
            self.node_id, self.generation, start, start + len(entries), entries
        )
        self.index.version = delta.to_version
        self._log.append(delta)
        self._log_entries += delta.num_entries
        while self._log_entries > self.max_log_entries and len(self._log) > 1:
            old = self._log.popleft()
            self._log_entries -= old.num_entries
            self._log_start = self._log[0].from_version
        return delta

    def since(self, generation: int, version: int) -> BlockDelta | None:
        """What a replica at ``(generation, version)`` needs; None if it is current.

        A delta from the log when the log reaches back that far, else a snapshot.
        Pending (unflushed) changes are not included: they go out with the next
        flush, under the version they will get then.
        """
        if generation == self.generation and version == self.index.version:
            return None
        if (
            generation != self.generation
            or version < self._log_start
            or version > self.index.version
        ):
            return self.index.snapshot(self.node_id)
        needed = [d for d in self._log if d.to_version > version]
        return merge_deltas(needed)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a block-hash sequence one node holds, counted from the start."""

    num_blocks: int
    # Of those, how many sit (at best) in each tier: device, DRAM, SSD.
    tier_blocks: tuple[int, int, int]

    @property
    def slowest_tier(self) -> Tier:
        for t in (Tier.SSD, Tier.DRAM, Tier.DEVICE):
            if self.tier_blocks[t]:
                return t
        return Tier.DEVICE
