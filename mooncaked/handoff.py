"""The plain data of a prompt's KV handoff between nodes.

A request placed on a decode node carries the prefill nodes to ask
(``PrefillSource``: each a ``PrefillTarget`` with what the entry forecast
of it, a ``PrefillOffer``); the decode node grants one of them blocks of
its KV cache (a ``KVGrant``, addressed through the ``KVLayout`` of its KV
segment), and the prefill node's request carries that grant. A target
may be a pipelined prefill group (its ``StageRef``s, each a ``LayerSpan``
of the model): every stage writes its own layers into the grant, and on
each stage the request carries a ``StageJob`` (where computing starts, the
chunks, the ``ActGrant``s its activations arrive in and leave into).
``Handoff`` is the one value a ``Request`` holds for all of it.

Values only, free of torch, sockets and HTTP: the entry's router and the
Conductor build them, the engine's KV connectors read them, the wire
encodes them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

# Furthest out a placement's "KV in by" forecast for a handoff may be: the
# decode node refuses more, the entry clamps to it.
MAX_KV_READY_IN_S = 3600.0
# Longest a request may ask its prompt's KV to be retained (a week), and the
# most holders it may ask for.
MAX_RETAIN_S = 7 * 24 * 3600.0
MAX_REPLICAS = 16


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Where the KV of (layer, K|V, block, row) sits in a runner's KV buffer.

    Plain numbers, so a peer that writes into this cache can compute every
    byte offset from a grant without seeing the tensors.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    # Bytes of one token's K (or V) in one layer: kv_heads * head_dim * itemsize.
    row_bytes: int

    @property
    def block_bytes(self) -> int:
        """One block of one layer's K (or V)."""
        return self.block_size * self.row_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * 2 * self.num_blocks * self.block_bytes

    def offset(self, layer: int, kv: int, block: int, row: int = 0) -> int:
        """Byte offset of ``row`` of ``block`` in layer ``layer``'s K (kv=0) or V (kv=1)."""
        return (
            (layer * 2 + kv) * self.num_blocks + block
        ) * self.block_bytes + row * self.row_bytes


@dataclass(frozen=True, slots=True)
class PrefillOffer:
    """What the entry forecast of one prefill candidate, model seconds: its
    TTFT, and the parts of it that do not depend on its queue (a fetch of
    a longer prefix, which overlaps the queue, and the compute after it)."""

    ttft_s: float
    move_s: float
    rest_s: float
    # A wait past ``ttft_s`` (as a share of it) that is no news.
    slack: float = 0.0

    def to_list(self) -> list[float]:
        """Its four figures, rounded: how offers travel (``wire.handoff``) and
        how ``/admin/explain`` shows them."""
        return [round(self.ttft_s, 6), round(self.move_s, 6), round(self.rest_s, 6), self.slack]

    def ttft_at(self, queue_s: float) -> float:
        """Its TTFT with this much queued ahead."""
        return max(queue_s, self.move_s) + self.rest_s

    def max_wait_s(self, beat_s: float) -> float:
        """The longest queue at which it takes the request: its TTFT within
        its forecast and slack, or not past ``beat_s`` (what else is left)."""
        return max(self.ttft_s * (1.0 + self.slack), beat_s) - self.rest_s


@dataclass(frozen=True, slots=True)
class KVGrant:
    """Blocks of a decode node's KV cache one prefill node may write, for one request.

    ``block_ids[i]`` holds the request's logical block ``first_block + i``;
    every byte offset follows from ``layout`` (``KVLayout.offset``).
    """

    request_id: str
    node_id: str
    transfer_address: str
    segment: str
    layout: KVLayout
    first_block: int
    block_ids: tuple[int, ...]
    ttl_s: float


@dataclass(frozen=True, slots=True)
class LayerSpan:
    """Layers ``[lo, hi)`` of a model of ``num_layers``: what one stage of a
    pipelined prefill group holds (the embedding on the first, the final
    norm and the head on the last)."""

    lo: int
    hi: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi <= self.num_layers:
            raise ValueError(
                f"layers {self.lo}..{self.hi} are not a range within the model's "
                f"{self.num_layers} layers"
            )

    @property
    def first(self) -> bool:
        return self.lo == 0

    @property
    def last(self) -> bool:
        return self.hi == self.num_layers

    @property
    def count(self) -> int:
        return self.hi - self.lo

    @property
    def whole(self) -> bool:
        return self.first and self.last


def split_layers(num_layers: int, num_stages: int, split: tuple[int, ...] = ()) -> list[LayerSpan]:
    """Each stage's layers: at the ``split`` boundaries (``num_stages - 1``
    ascending layer indices), or as even as they go, earlier stages taking
    the remainder (the last also runs the head). ValueError naming the bad value."""
    if num_stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {num_stages}")
    if not split:
        base, extra = divmod(num_layers, num_stages)
        bounds = [0]
        for s in range(num_stages):
            bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    else:
        if len(split) != num_stages - 1:
            raise ValueError(
                f"split {list(split)} names {len(split)} boundaries; {num_stages} stages "
                f"need {num_stages - 1}"
            )
        bounds = [0, *split, num_layers]
    for lo, hi in itertools.pairwise(bounds):
        if not 0 <= lo < hi <= num_layers:
            raise ValueError(
                f"stage layers {bounds} do not split {num_layers} layers into "
                f"{num_stages} non-empty ranges"
            )
    return [LayerSpan(lo, hi, num_layers) for lo, hi in itertools.pairwise(bounds)]


@dataclass(frozen=True, slots=True)
class StageRef:
    """One stage of a pipelined prefill group, as a placement names it."""

    node_id: str
    # The stage node's API, e.g. "http://10.0.0.5:8000".
    url: str
    # Its layers [layer_lo, layer_hi).
    layer_lo: int
    layer_hi: int


@dataclass(frozen=True, slots=True)
class ActGrant:
    """Rows of a stage's inbound activation segment the stage before it may
    write, for one request: prompt position ``start + i`` is row ``i % block_rows``
    of block ``block_ids[i // block_rows]``, ``row_bytes`` each (one token's
    hidden state in the model's dtype)."""

    # The stage that receives: its node, API (where chunks are announced)
    # and its own id of the request.
    node_id: str
    url: str
    request_id: str
    transfer_address: str
    segment: str
    row_bytes: int
    block_rows: int
    block_ids: tuple[int, ...]
    start: int

    @property
    def end(self) -> int:
        """One past the last position the grant holds."""
        return self.start + len(self.block_ids) * self.block_rows

    def rows(self, lo: int, hi: int) -> list[int]:
        """The segment rows of prompt positions [lo, hi); ValueError outside the grant."""
        if not self.start <= lo <= hi <= self.end:
            raise ValueError(
                f"positions {lo}..{hi} are outside the activation grant's {self.start}..{self.end}"
            )
        br, ids = self.block_rows, self.block_ids
        return [ids[i // br] * br + i % br for i in range(lo - self.start, hi - self.start)]


@dataclass(frozen=True, slots=True)
class StageJob:
    """A request's part on one stage of a pipelined prefill group, on that
    stage's node: where its computing starts (the prefix every stage holds),
    how its prompt is chunked (the head decides), where its activations
    come from and go."""

    index: int
    num_stages: int
    # Prompt positions before ``start`` are cached on every stage: each
    # computes from here, whatever more it holds itself.
    start: int
    # Chunk sizes planned from ``start`` on (the head's; empty: the token
    # budget chunks). Later stages run what arrives.
    chunks: tuple[int, ...] = ()
    # The rows this stage's input arrives in (all but the head).
    act_in: ActGrant | None = None
    # The next stage's rows this stage writes its output into (all but the last).
    act_out: ActGrant | None = None
    # A stage timing its own steps alone (its cost profile): its input is
    # whatever its rows hold, its output goes nowhere.
    probe: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.num_stages:
            raise ValueError(f"stage {self.index} of {self.num_stages} does not exist")
        if (self.act_in is None) != (self.index == 0):
            raise ValueError("every stage but the head takes its input from the stage before")
        if (self.act_out is None) != (self.index == self.num_stages - 1) and not self.probe:
            raise ValueError("every stage but the last sends its output to the next")
        if self.start < 0 or any(c <= 0 for c in self.chunks):
            raise ValueError("a stage job needs start >= 0 and chunk sizes > 0")

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    def chunk_end(self, computed: int) -> int | None:
        """Where the planned chunk that ``computed`` is in ends (None: no plan,
        or past it)."""
        end = self.start
        for c in self.chunks:
            end += c
            if end > computed:
                return end
        return None


@dataclass(frozen=True, slots=True)
class PrefillTarget:
    node_id: str
    # The prefill node's API, e.g. "http://10.0.0.5:8000".
    url: str
    # Whether it may pull a longer prefix from peers (else it recomputes).
    fetch: bool = True
    # Late binding: what the entry forecast of it (None: it takes the request).
    offer: PrefillOffer | None = None
    # A pipelined group: its stages in order, the head first (``node_id`` is
    # the head's); empty: one prefill node.
    stages: tuple[StageRef, ...] = ()

    def __post_init__(self) -> None:
        if self.stages and self.stages[0].node_id != self.node_id:
            raise ValueError("a pipelined prefill target is its head stage")


@dataclass(frozen=True, slots=True)
class PrefillSource:
    """A decode-side request's ``Handoff.source``: the prefill nodes to ask, in
    order, and (late binding) the round trip one more hop costs."""

    targets: tuple[PrefillTarget, ...]
    hop_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Retain:
    """A request's ask that its prompt's KV be kept (``"cache"`` in its body):
    once computed and offloaded, the prompt's full blocks are soft-pinned for
    ``retain_s`` seconds, and copied until ``replicas`` nodes hold them."""

    retain_s: float
    replicas: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.retain_s, bool) or not 0.0 < self.retain_s <= MAX_RETAIN_S:
            raise ValueError(f"retain_s must be in (0, {MAX_RETAIN_S:g}] s, got {self.retain_s!r}")
        if isinstance(self.replicas, bool) or not 1 <= self.replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas must be in 1..{MAX_REPLICAS}, got {self.replicas!r}")


@dataclass(frozen=True, slots=True)
class Handoff:
    """Where a request's prompt KV comes from or goes to, and where its
    output continues from: the one value a ``Request`` carries for
    disaggregated serving (``NO_HANDOFF`` for a request that runs alone)."""

    # Decode node: the prefill nodes to ask for the prompt's KV, in order.
    source: PrefillSource | None = None
    # Prefill node: the decode node's blocks to write the prompt's KV into.
    sink: KVGrant | None = None
    # Whether the KV connectors may pull the prompt's prefix from peers (the
    # Conductor says no when recomputing it is faster).
    peer_fetch: bool = True
    # When the placement expects the source's KV in (the engine's monotonic
    # clock; 0: unknown): the decode node's load forecast counts it from then.
    kv_ready_at: float = 0.0
    # Sampled tokens this request continues from (a resumed stream): seeded
    # sampling picks up at this output index.
    output_offset: int = 0
    # On a stage of a pipelined prefill group: this request's part there.
    stage: StageJob | None = None
    # Keep the prompt's KV once computed (the request asked); None: cache as usual.
    retain: Retain | None = None
    # Decode node: host:port of the memory node placement paired it with for
    # this request's attention (""; the node's own ``offload`` config).
    memory_node: str = ""

    def __post_init__(self) -> None:
        if self.source is not None and self.sink is not None:
            raise ValueError("a request either receives its prompt's KV or sends it, not both")
        if isinstance(self.output_offset, bool) or self.output_offset < 0:
            raise ValueError(f"output_offset must be an integer >= 0, got {self.output_offset!r}")


NO_HANDOFF = Handoff()


def kv_ready_at(ready_in_s: float, now: float) -> float:
    """``Handoff.kv_ready_at`` for KV expected ``ready_in_s`` from ``now`` (0: unknown)."""
    return now + ready_in_s if ready_in_s > 0.0 else 0.0
