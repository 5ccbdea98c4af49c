"""The plain data of a prompt's KV handoff between nodes.

A request placed on a decode node carries the prefill nodes to ask
(``PrefillSource``: each a ``PrefillTarget`` with what the entry forecast
of it, a ``PrefillOffer``); the decode node grants one of them blocks of
its KV cache (a ``KVGrant``, addressed through the ``KVLayout`` of its KV
segment), and the prefill node's request carries that grant. ``Handoff``
is the one value a ``Request`` holds for all of it.

Values only, free of torch, sockets and HTTP: the entry's router and the
Conductor build them, the engine's KV connectors read them, the wire
encodes them.
"""

from __future__ import annotations

from dataclasses import dataclass

# Furthest out a placement's "KV in by" forecast for a handoff may be: the
# decode node refuses more, the entry clamps to it.
MAX_KV_READY_IN_S = 3600.0


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
class PrefillTarget:
    node_id: str
    # The prefill node's API, e.g. "http://10.0.0.5:8000".
    url: str
    # Whether it may pull a longer prefix from peers (else it recomputes).
    fetch: bool = True
    # Late binding: what the entry forecast of it (None: it takes the request).
    offer: PrefillOffer | None = None


@dataclass(frozen=True, slots=True)
class PrefillSource:
    """A decode-side request's ``Handoff.source``: the prefill nodes to ask, in
    order, and (late binding) the round trip one more hop costs."""

    targets: tuple[PrefillTarget, ...]
    hop_s: float = 0.0


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

    def __post_init__(self) -> None:
        if self.source is not None and self.sink is not None:
            raise ValueError("a request either receives its prompt's KV or sends it, not both")
        if isinstance(self.output_offset, bool) or self.output_offset < 0:
            raise ValueError(f"output_offset must be an integer >= 0, got {self.output_offset!r}")


NO_HANDOFF = Handoff()


def kv_ready_at(ready_in_s: float, now: float) -> float:
    """``Handoff.kv_ready_at`` for KV expected ``ready_in_s`` from ``now`` (0: unknown)."""
    return now + ready_in_s if ready_in_s > 0.0 else 0.0
