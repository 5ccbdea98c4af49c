"""What one node knows of the cluster: members, their state, and their cached blocks.

Plain data, no I/O: the gossip package (``gossip/``) is the only writer; the
Conductor, the admin API and the simulator read a ``ClusterView``. The view
holds one replica of the cluster-wide block index per member
(``cluster/block_index.py``, whose names this module re-exports for readers
of the view).
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from mooncaked.cache.tiers import Tier
from mooncaked.cluster.block_index import (
    ALL_TIERS_MASK,
    FASTEST_TIER,
    ApplyResult,
    BlockDelta,
    BlockEvent,
    BlockLog,
    BlockOp,
    NodeBlocks,
    PrefixMatch,
    join_chunks,
    merge_deltas,
    split_hashes,
    tier_mask,
)
from mooncaked.cluster.costs import NodeCosts
from mooncaked.cluster.forecast import DecodeForecast

log = structlog.get_logger(__name__)

# The block index's names, for readers of the view that import them from here.
__all__ = [
    "ALL_TIERS_MASK",
    "ApplyResult",
    "AttentionShape",
    "BlockDelta",
    "BlockEvent",
    "BlockLog",
    "BlockOp",
    "ClusterCounters",
    "ClusterView",
    "LocalState",
    "Member",
    "MemberStatus",
    "MemoryInfo",
    "NodeBlocks",
    "NodeLoad",
    "NodeState",
    "OffloadInfo",
    "PrefixMatch",
    "StageInfo",
    "Tier",
    "join_chunks",
    "merge_deltas",
    "split_hashes",
    "tier_mask",
]


class MemberStatus(enum.StrEnum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    # Announced its own departure (drain or stop); never probed again.
    LEFT = "left"


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
    # DRAM slots of the KV store that hold nothing: where replicas go first.
    dram_free_blocks: int = 0

    def to_list(self) -> list[int | float]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def to_json(self) -> dict[str, int | float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True, slots=True)
class StageInfo:
    """A node's place in a pipelined prefill group, as gossip spreads it.
    Wire form: ``to_list`` / ``cluster.wire``'s decoder."""

    group: str
    index: int
    num_stages: int
    # Its layers [layer_lo, layer_hi) of the model's num_layers.
    layer_lo: int
    layer_hi: int
    num_layers: int
    # Bytes of one token's activations: what crosses to the next stage.
    act_bytes_per_token: int
    # The first chunk of a pipelined prompt (the head's; later chunks level
    # in time), 0: the token budget.
    chunk_tokens: int = 0
    # The most prompt tokens its input rows hold (``pipeline.activation_bytes``;
    # 0: no bound, the head): a longer prompt is refused there.
    max_tokens: int = 0

    def to_list(self) -> list[object]:
        return [
            self.group,
            self.index,
            self.num_stages,
            self.layer_lo,
            self.layer_hi,
            self.num_layers,
            self.act_bytes_per_token,
            self.chunk_tokens,
            self.max_tokens,
        ]

    def to_json(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


# Bytes per value of the KV dtypes a memory node lays out.
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """A model's KV as a memory node lays it out (``offload.wire.KVShape``):
    a memory node serves the compute nodes whose shape is its own."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # torch's name of the KV's dtype ("bfloat16"): equal sizes are not enough.
    dtype: str
    block_size: int

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE.get(self.dtype, 4)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    def to_list(self) -> list[object]:
        return [
            self.num_layers,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.block_size,
        ]

    def to_json(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """What a memory node tells placement: where its attention service
    listens, its KV pool's room and use, and how fast its attention reads KV.
    Wire form: ``to_list`` / ``cluster.wire``'s decoder."""

    # host:port of its attention service (what a compute node connects to).
    attention_addr: str
    # Bytes of KV its pool holds in all, and those free (whole blocks).
    total_bytes: int
    free_bytes: int
    num_seqs: int
    # Bytes/s its attention reads KV at: measured at start-up on a
    # synthetic context, or the operator's figure (``offload.kv_read_bps``).
    kv_read_bps: float
    # The model it serves attention for ("": any whose KV shape fits).
    model: str = ""
    # The KV shape its pool is laid out for (None: none yet; the first
    # compute node to connect sets it).
    shape: AttentionShape | None = None

    def to_list(self) -> list[object]:
        return [
            self.attention_addr,
            self.total_bytes,
            self.free_bytes,
            self.num_seqs,
            self.kv_read_bps,
            self.model,
            None if self.shape is None else self.shape.to_list(),
        ]

    def to_json(self) -> dict[str, object]:
        return {
            "attention_addr": self.attention_addr,
            "total_bytes": self.total_bytes,
            "free_bytes": self.free_bytes,
            "num_seqs": self.num_seqs,
            "kv_read_bps": self.kv_read_bps,
            "model": self.model,
            "shape": None if self.shape is None else self.shape.to_json(),
        }

    def serves(self, model_id: str, shape: AttentionShape) -> bool:
        """Whether a compute node of ``model_id`` whose KV is ``shape`` may use it."""
        if self.model and self.model != model_id:
            return False
        return self.shape is None or self.shape == shape


@dataclass(frozen=True, slots=True)
class OffloadInfo:
    """A compute node that offloads its decode attention to the memory node
    placement picks (``offload.memory_node = "auto"``): its KV shape, which
    prices the q/k/v traffic and must match the memory node's, and the
    micro-batches it cuts a decode batch into."""

    shape: AttentionShape
    micro_batches: int = 1

    def to_list(self) -> list[object]:
        return [self.shape.to_list(), self.micro_batches]

    def to_json(self) -> dict[str, object]:
        return {"shape": self.shape.to_json(), "micro_batches": self.micro_batches}


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
    # A stage of a pipelined prefill group (None: a node of its own).
    stage: StageInfo | None = None
    # A memory node's service and pool (None: not a memory node).
    memory: MemoryInfo | None = None
    # A compute node whose attention placement offloads (None: it does not).
    offload: OffloadInfo | None = None


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
    stage: StageInfo | None = None
    memory: MemoryInfo | None = None
    offload: OffloadInfo | None = None


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
        fastest = FASTEST_TIER
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
        fastest = FASTEST_TIER
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

    def held_run(self, node_id: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` ``node_id`` holds, in any tier."""
        index = self.blocks.get(node_id)
        if index is None:
            return 0
        masks = index.masks
        n = 0
        for h in hashes:
            if not masks.get(h, 0):
                break
            n += 1
        return n

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
                "by_role": dict(Counter(m.state.role for m in up if m.state is not None)),
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
        # A stage of a pipelined prefill group: its group, place and layers.
        "stage": st.stage.to_json() if st.stage is not None else None,
        # A memory node: its attention service, pool and read bandwidth.
        "memory": st.memory.to_json() if st.memory is not None else None,
        # A compute node whose attention placement offloads.
        "offload": st.offload.to_json() if st.offload is not None else None,
    }
