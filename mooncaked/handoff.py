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

import math
from dataclasses import dataclass
from typing import Any

# Most blocks one grant may name (a 1M-token prompt in 16-token blocks).
MAX_GRANT_BLOCKS = 1 << 16
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
        return [round(self.ttft_s, 6), round(self.move_s, 6), round(self.rest_s, 6), self.slack]

    @classmethod
    def from_list(cls, raw: Any) -> PrefillOffer:
        """Raises ValueError on anything but four finite numbers >= 0."""
        if not isinstance(raw, list) or len(raw) != 4:
            raise ValueError(f"an offer is [ttft_s, move_s, rest_s, slack], got {raw!r}")
        for v in raw:
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < math.inf:
                raise ValueError(f"an offer's figures must be numbers >= 0, got {raw!r}")
        return cls(float(raw[0]), float(raw[1]), float(raw[2]), float(raw[3]))

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

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "request_id": self.request_id,
            "node_id": self.node_id,
            "transfer_address": self.transfer_address,
            "segment": self.segment,
            "layout": [lay.num_layers, lay.num_blocks, lay.block_size, lay.row_bytes],
            "first_block": self.first_block,
            "block_ids": list(self.block_ids),
            "ttl_s": self.ttl_s,
        }

    @classmethod
    def from_dict(cls, d: Any) -> KVGrant:
        """Parse and check a grant from JSON; ValueError naming what is wrong."""
        if not isinstance(d, dict):
            raise ValueError("'grant' must be an object")

        def num(key: str, value: Any, lo: int, hi: int) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"grant {key!r} must be an integer in {lo}..{hi}")
            return value

        def text(key: str) -> str:
            v = d.get(key)
            if not isinstance(v, str) or not v or len(v) > 256:
                raise ValueError(f"grant {key!r} must be a non-empty string")
            return v

        raw = d.get("layout")
        if not isinstance(raw, list) or len(raw) != 4:
            raise ValueError("grant 'layout' must be [layers, blocks, block_size, row_bytes]")
        layout = KVLayout(
            num_layers=num("layers", raw[0], 1, 1 << 12),
            num_blocks=num("blocks", raw[1], 1, 1 << 30),
            block_size=num("block_size", raw[2], 1, 1 << 16),
            row_bytes=num("row_bytes", raw[3], 1, 1 << 24),
        )
        ids = d.get("block_ids")
        if not isinstance(ids, list) or not 0 < len(ids) <= MAX_GRANT_BLOCKS:
            raise ValueError(f"grant 'block_ids' must list 1..{MAX_GRANT_BLOCKS} blocks")
        block_ids = tuple(num("block_ids", b, 0, layout.num_blocks - 1) for b in ids)
        ttl = d.get("ttl_s")
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= 3600:
            raise ValueError("grant 'ttl_s' must be a number in (0, 3600]")
        return cls(
            request_id=text("request_id"),
            node_id=text("node_id"),
            transfer_address=text("transfer_address"),
            segment=text("segment"),
            layout=layout,
            first_block=num("first_block", d.get("first_block"), 0, 1 << 30),
            block_ids=block_ids,
            ttl_s=float(ttl),
        )


@dataclass(frozen=True, slots=True)
class PrefillTarget:
    node_id: str
    # The prefill node's API, e.g. "http://10.0.0.5:8000".
    url: str
    # Whether it may pull a longer prefix from peers (else it recomputes).
    fetch: bool = True
    # Late binding: what the entry forecast of it (None: it takes the request).
    offer: PrefillOffer | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node_id": self.node_id, "url": self.url, "fetch": self.fetch}
        if self.offer is not None:
            out["offer"] = self.offer.to_list()
        return out

    @classmethod
    def from_dict(cls, raw: Any) -> PrefillTarget:
        """Raises ValueError (or KeyError, TypeError) on a malformed target."""
        if not isinstance(raw, dict):
            raise ValueError(f"a prefill target must be an object, got {raw!r}")
        offer = raw.get("offer")
        return cls(
            str(raw["node_id"]),
            str(raw["url"]),
            raw.get("fetch", True) is not False,
            None if offer is None else PrefillOffer.from_list(offer),
        )


def parse_max_wait_s(raw: Any) -> float:
    """A wire ``max_wait_s``: seconds >= 0, or None (no limit: inf)."""
    if raw is None:
        return math.inf
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not 0.0 <= raw < math.inf:
        raise ValueError(f"'max_wait_s' must be a number of seconds >= 0, got {raw!r}")
    return float(raw)


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
