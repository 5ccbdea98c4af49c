"""What one node knows of the cluster: members, their state, and their cached blocks.

Plain data, no I/O: the gossip package (``gossip/``) is the only writer; the
Conductor, the admin API and the simulator read a ``ClusterView``.

The cluster-wide block index is one replica per node, ``NodeBlocks``: a dict
from the 16-byte block hash to a tier bitmask (bit 0 device, bit 1 DRAM, bit 2
SSD; a block may sit in several tiers of one node at once). Each node publishes
its own changes as a versioned stream of ``BlockDelta`` batches. A delta
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
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from mooncaked.cache.hashing import BLOCK_HASH_BYTES
from mooncaked.cache.tiers import Tier
from mooncaked.cluster.costs import NodeCosts
from mooncaked.cluster.forecast import DecodeForecast

log = structlog.get_logger(__name__)


class BlockOp(enum.StrEnum):
    STORED = "stored"
    REMOVED = "removed"


class MemberStatus(enum.StrEnum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    # Announced its own departure (drain or stop); never probed again.
    LEFT = "left"


# Tier -> its bit in a mask; accepts the enum, its int value and its name.
_TIER_BIT: dict[Any, int] = {}
for _t in Tier:
    _TIER_BIT[_t] = 1 << _t.value
    _TIER_BIT[_t.name.lower()] = 1 << _t.value
# Mask -> fastest tier present (index 0 unused: a mask of 0 means absent).
_FASTEST_TIER: tuple[int, ...] = tuple(
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
class NodeLoad:
    """A node's load as gossip spreads it. The wire and JSON forms are derived
    from these fields (``to_list`` / ``from_list`` / ``to_json``): a new field
    is added here only; ``max`` in a field's metadata bounds it on decode."""

    queued_prefill_tokens: int = 0
    running_decode_batch: int = 0
    # Fraction of the device KV pool in use, 0..1.
    kv_usage: float = field(default=0.0, metadata={"max": 1.0})
    # The node's own forecast of how long a new prefill waits before it starts.
    predicted_queue_s: float = 0.0
    # Context tokens held by the running decodes (what a decode step reads).
    decode_context_tokens: int = 0
    # Requests decoding or about to (KV on its way): the batch an arrival joins.
    pending_decode: int = 0

    def to_list(self) -> list[int | float]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def to_json(self) -> dict[str, int | float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True, slots=True)
class LocalState:
    """What the hosting daemon says about itself; polled by the gossip layer."""

    role: str = "both"
    model_id: str = ""
    # host:port of the node's HTTP API (OpenAI, internal and admin routes).
    api_addr: str = ""
    draining: bool = False
    load: NodeLoad = field(default_factory=NodeLoad)
    costs: NodeCosts = field(default_factory=NodeCosts)
    forecast: DecodeForecast = field(default_factory=DecodeForecast)


@dataclass(frozen=True, slots=True)
class NodeState:
    """One node's self-description as spread by gossip.

    ``(generation, version)`` orders updates: generation is fixed for a process
    lifetime and grows across restarts, version grows with every change.
    Segment descriptors travel separately (they are large and rarely change):
    ``segments_version`` here is what the node advertises, ``Member.segments``
    what this replica holds.
    """

    node_id: str
    generation: int
    version: int
    gossip_addr: str
    role: str
    model_id: str
    api_addr: str
    draining: bool
    load: NodeLoad
    block_version: int
    num_blocks: int
    segments_version: int
    costs: NodeCosts = field(default_factory=NodeCosts)
    forecast: DecodeForecast = field(default_factory=DecodeForecast)


@dataclass(slots=True)
class Member:
    """One node as this node sees it. Mutated only by the gossip layer."""

    node_id: str
    addr: tuple[str, int]
    incarnation: int
    generation: int
    status: MemberStatus
    # Monotonic times: when status last changed, and the last evidence of life
    # (a packet from it, or news about it that it must have produced).
    status_since: float
    last_heard: float
    state: NodeState | None = None
    segments: tuple[Mapping[str, Any], ...] = ()
    segments_version: int = 0

    @property
    def is_up(self) -> bool:
        """Alive or suspect: still a probe target and a holder of blocks."""
        return self.status is MemberStatus.ALIVE or self.status is MemberStatus.SUSPECT


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
        out = []
        for start in range(0, n, max_entries):
            end = min(n, start + max_entries)
            out.append(
                BlockDelta(
                    self.node_id,
                    self.generation,
                    self.from_version + start,
                    self.from_version + end,
                    self.hashes[start * BLOCK_HASH_BYTES : end * BLOCK_HASH_BYTES],
                    self.masks[start:end],
                    max(0, min(self.num_upserts, end) - start),
                )
            )
        return out

    def chunks(self, max_entries: int) -> list[BlockDelta]:
        """Pieces of at most ``max_entries`` that ``join_chunks`` reassembles.

        Every piece keeps the whole delta's versions, so a piece alone must not
        be applied; this is how a big snapshot crosses a bounded TCP message.
        """
        n = self.num_entries
        if n <= max_entries:
            return [self]
        out = []
        for start in range(0, n, max_entries):
            end = min(n, start + max_entries)
            out.append(
                BlockDelta(
                    self.node_id,
                    self.generation,
                    self.from_version,
                    self.to_version,
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


@dataclass(slots=True)
class ClusterCounters:
    """Monotonic counters of the gossip layer, shown by /admin/cluster."""

    packets_sent: int = 0
    bytes_sent: int = 0
    packets_received: int = 0
    bytes_received: int = 0
    dropped_oversize: int = 0
    dropped_bad_mac: int = 0
    dropped_malformed: int = 0
    # Signed and well-formed, but a value out of bounds or a broken invariant.
    dropped_invalid: int = 0
    dropped_blocked: int = 0
    dropped_broadcasts: int = 0
    handler_errors: int = 0
    probes: int = 0
    indirect_probes: int = 0
    # Failed probes not held against the target because this node ran late.
    probes_inconclusive: int = 0
    suspicions_raised: int = 0
    refutations: int = 0
    syncs_ok: int = 0
    syncs_failed: int = 0
    pulls_ok: int = 0
    pulls_failed: int = 0
    block_deltas_applied: int = 0
    block_entries_applied: int = 0
    block_gaps: int = 0

    def to_json(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


class ClusterView:
    """This node's view of the cluster; the gossip layer keeps it current.

    Readers must treat members, states and indexes as read-only. Dead and left
    members stay listed (with their last state) until reaped, but hold no
    blocks: their index replicas are dropped when they go down.
    """

    def __init__(
        self,
        self_id: str,
        clock: Callable[[], float],
        counters: ClusterCounters | None = None,
    ) -> None:
        self.self_id = self_id
        self._clock = clock
        self.counters = counters if counters is not None else ClusterCounters()
        self.members: dict[str, Member] = {}
        self.blocks: dict[str, NodeBlocks] = {}
        # Called with (node id, generation, up) when a member goes down (dead
        # or left) or comes up (joins, returns, restarts): what cuts calls to
        # a lost node over to the next (cluster/watch.py).
        self.member_watchers: list[Callable[[str, int, bool], None]] = []

    def member_event(self, node_id: str, generation: int, up: bool) -> None:
        for watcher in list(self.member_watchers):
            try:
                watcher(node_id, generation, up)
            except Exception:
                # A watcher's bug must not break membership.
                log.exception("member watcher failed", node=node_id)

    def get(self, node_id: str) -> Member | None:
        return self.members.get(node_id)

    def member_at(self, api_addr: str) -> Member | None:
        """The up member whose state announces the HTTP API ``host:port``, if any
        (a dead one's address may have been taken by a newer process)."""
        for m in self.members.values():
            if m.is_up and m.state is not None and m.state.api_addr == api_addr:
                return m
        return None

    def up_members(self) -> list[Member]:
        return [m for m in self.members.values() if m.is_up]

    def schedulable(self) -> list[Member]:
        """Alive members with a known state that are not draining (self included)."""
        return [
            m
            for m in self.members.values()
            if m.status is MemberStatus.ALIVE and m.state is not None and not m.state.draining
        ]

    def longest_prefix(
        self, hashes: Sequence[bytes], *, tiers: int = ALL_TIERS_MASK
    ) -> dict[str, PrefixMatch]:
        """Per node (self included) that holds ``hashes[0]``: its leading run of held blocks.

        ``tiers`` (a mask, see ``tier_mask``) counts only blocks held in those
        tiers: ``tier_mask("dram", "ssd")`` gives what a peer can lease, since
        device blocks cannot be. Each block is counted under its fastest tier
        among ``tiers``. Nodes holding none of the prefix are left out. Down
        nodes hold nothing. Cost: one dict lookup per node for the first
        block, then one per matched block.
        """
        out: dict[str, PrefixMatch] = {}
        if not hashes:
            return out
        tiers &= ALL_TIERS_MASK
        first = hashes[0]
        fastest = _FASTEST_TIER
        for node_id, index in self.blocks.items():
            masks = index.masks
            if not masks.get(first, 0) & tiers:
                continue
            counts = [0, 0, 0]
            n = 0
            for h in hashes:
                m = masks.get(h, 0) & tiers
                if not m:
                    break
                counts[fastest[m]] += 1
                n += 1
            out[node_id] = PrefixMatch(n, (counts[0], counts[1], counts[2]))
        return out

    def longest_prefixes(
        self, hashes: Sequence[bytes], tiers: int
    ) -> tuple[dict[str, PrefixMatch], dict[str, PrefixMatch]]:
        """``longest_prefix(hashes)`` and ``longest_prefix(hashes, tiers=tiers)``
        in one pass over the nodes (the Conductor asks both of every request)."""
        every: dict[str, PrefixMatch] = {}
        some: dict[str, PrefixMatch] = {}
        if not hashes:
            return every, some
        tiers &= ALL_TIERS_MASK
        first = hashes[0]
        fastest = _FASTEST_TIER
        for node_id, index in self.blocks.items():
            masks = index.masks
            m0 = masks.get(first, 0)
            if not m0:
                continue
            counts = [0, 0, 0]
            sub = [0, 0, 0]
            n = k = 0
            within = bool(m0 & tiers)
            for h in hashes:
                m = masks.get(h, 0)
                if not m:
                    break
                counts[fastest[m]] += 1
                n += 1
                if within:
                    t = m & tiers
                    if t:
                        sub[fastest[t]] += 1
                        k += 1
                    else:
                        within = False
            every[node_id] = PrefixMatch(n, (counts[0], counts[1], counts[2]))
            if k:
                some[node_id] = PrefixMatch(k, (sub[0], sub[1], sub[2]))
        return every, some

    def check_integrity(self) -> None:
        """Raises RuntimeError if the view contradicts itself."""
        me = self.members.get(self.self_id)
        if me is None or self.self_id not in self.blocks:
            raise RuntimeError(f"the view lacks its own node {self.self_id!r}")
        stray = set(self.blocks) - set(self.members)
        if stray:
            raise RuntimeError(f"block indexes of unknown members: {sorted(stray)}")
        for node_id, m in self.members.items():
            if m.node_id != node_id:
                raise RuntimeError(f"member {m.node_id!r} filed under {node_id!r}")
            index = self.blocks.get(node_id)
            if not m.is_up and index is not None and len(index) and node_id != self.self_id:
                raise RuntimeError(f"{node_id} is {m.status.value} but still holds blocks")

    def num_cached_blocks(self, node_id: str) -> int:
        index = self.blocks.get(node_id)
        return 0 if index is None else len(index)

    def to_json(self) -> dict[str, Any]:
        """The /admin/cluster document."""
        now = self._clock()
        nodes = []
        counts = {s.value: 0 for s in MemberStatus}
        for m in sorted(self.members.values(), key=lambda m: m.node_id):
            counts[m.status.value] += 1
            index = self.blocks.get(m.node_id)
            st = m.state
            nodes.append(
                {
                    "node_id": m.node_id,
                    "self": m.node_id == self.self_id,
                    "status": m.status.value,
                    "gossip_addr": f"{m.addr[0]}:{m.addr[1]}",
                    "incarnation": m.incarnation,
                    "generation": m.generation,
                    "status_age_s": round(max(0.0, now - m.status_since), 3),
                    "last_heard_s": round(max(0.0, now - m.last_heard), 3),
                    "cached_blocks": 0 if index is None else len(index),
                    "block_version": 0 if index is None else index.version,
                    "segments_version": m.segments_version,
                    "segments": list(m.segments),
                    "state": None if st is None else _state_json(st),
                }
            )
        up = [m for m in self.members.values() if m.is_up and m.state is not None]
        return {
            "self": self.self_id,
            "summary": {
                "members": len(self.members),
                "by_status": counts,
                "by_role": _count_by(m.state.role for m in up if m.state is not None),
                "cached_blocks": sum(len(b) for b in self.blocks.values()),
                "queued_prefill_tokens": sum(
                    m.state.load.queued_prefill_tokens for m in up if m.state is not None
                ),
                "running_decode_batch": sum(
                    m.state.load.running_decode_batch for m in up if m.state is not None
                ),
            },
            "nodes": nodes,
            "counters": self.counters.to_json(),
        }


def _count_by(values: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _state_json(st: NodeState) -> dict[str, Any]:
    return {
        "generation": st.generation,
        "version": st.version,
        "role": st.role,
        "model_id": st.model_id,
        "api_addr": st.api_addr,
        "draining": st.draining,
        "load": st.load.to_json(),
        "block_version": st.block_version,
        "num_blocks": st.num_blocks,
        "segments_version": st.segments_version,
        "costs": st.costs.to_json(),
        "forecast": {
            "batch": list(st.forecast.batch),
            "context_tokens": list(st.forecast.context_tokens),
        },
    }
