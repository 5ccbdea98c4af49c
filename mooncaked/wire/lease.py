"""The lease calls of peer block fetches, reader -> holder, and their client.

- ``POST /internal/cache/lookup`` with a ``LookupBody`` -> a ``LookupAnswer``:
  the longest prefix of the hashes the holder has, leased for ``ttl_s``
  under ``lease_id``, each block's byte offset in its DRAM segment
  (``lease_id`` 0 and no offsets when it has none).
- ``POST /internal/cache/release`` with a ``ReleaseBody`` -> a
  ``ReleaseAnswer``; ``released`` false means the lease had lapsed and what
  the reader read must be discarded.
- ``GET /internal/identity`` (unsigned) -> the node's ``Target``: what a call
  to it must be signed for, for callers that know it by URL only.

``LeaseClient`` (the ``PeerClient`` of ``mooncaked.cache.peer``) makes these
calls, each signed for its peer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from mooncaked.cache.hashing import BlockHash, parse_hex_hashes
from mooncaked.cache.peer import Grant, LeaseDesk, Offer, PeerError
from mooncaked.rpc import Target, derive_key
from mooncaked.transfer import SegmentDescriptor, SegmentError
from mooncaked.wire import fields
from mooncaked.wire.calls import CallFailed, SignedCalls
from mooncaked.wire.paths import LOOKUP_PATH, MAX_LOOKUP_HASHES, RELEASE_PATH

# Most bytes one block of a layout may have (a layer's K and V of 16 tokens
# in a wide model are far below it).
_MAX_BLOCK_BYTES = 1 << 34


@dataclass(frozen=True, slots=True)
class LookupBody:
    hashes: tuple[BlockHash, ...]
    # The reader's block size and layout (``BlockLayout.fingerprint()``):
    # a holder with another refuses (409).
    block_bytes: int
    layout: bytes
    # The reader's node id, as the caller says it (the holder caps leases by it).
    reader: str
    ttl_s: float

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "hashes": [h.hex() for h in self.hashes],
                "block_bytes": self.block_bytes,
                "layout": self.layout.hex(),
                "reader": self.reader,
                "ttl_s": self.ttl_s,
            }
        )

    @classmethod
    def decode(cls, data: dict[str, Any]) -> LookupBody:
        """ValueError naming the field that is wrong."""
        layout = data.get("layout")
        try:
            fingerprint = bytes.fromhex(layout) if isinstance(layout, str) else None
        except ValueError:
            fingerprint = None
        if not fingerprint:
            raise fields.refuse("layout", "the reader's block layout fingerprint, hex", layout)
        return cls(
            hashes=tuple(parse_hex_hashes(data.get("hashes"), "hashes", MAX_LOOKUP_HASHES)),
            block_bytes=fields.integer(data.get("block_bytes"), "block_bytes", 1, _MAX_BLOCK_BYTES),
            layout=fingerprint,
            reader=fields.text(data.get("reader"), "reader"),
            ttl_s=fields.number(data.get("ttl_s"), "ttl_s", above=True, unit="seconds"),
        )


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    node_id: str
    # 0 and no offsets: the holder has none of the prefix.
    lease_id: int
    offsets: tuple[int, ...]
    ttl_s: float
    block_bytes: int
    # The holder's DRAM segment the offsets are in, and where to read it.
    segment: SegmentDescriptor
    transfer_address: str

    def offer(self, peer: str) -> Offer | None:
        """What the reader reads, from ``peer`` (None: nothing leased)."""
        if not self.offsets:
            return None
        return Offer(
            peer=peer,
            node_id=self.node_id,
            lease_id=self.lease_id,
            offsets=self.offsets,
            block_bytes=self.block_bytes,
            segment=self.segment.name,
            transfer_address=self.transfer_address,
        )

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "node_id": self.node_id,
                "lease_id": self.lease_id,
                "offsets": list(self.offsets),
                "ttl_s": self.ttl_s,
                "block_bytes": self.block_bytes,
                "segment": self.segment.to_dict(),
                "transfer_address": self.transfer_address,
            }
        )

    @classmethod
    def decode(cls, data: dict[str, Any]) -> LookupAnswer:
        """ValueError naming the field that is wrong."""
        try:
            segment = SegmentDescriptor.from_dict(fields.obj(data.get("segment"), "segment"))
        except SegmentError as exc:
            raise ValueError(f"'segment': {exc}") from None
        return cls(
            node_id=fields.text(data.get("node_id"), "node_id"),
            lease_id=fields.integer(data.get("lease_id"), "lease_id"),
            offsets=tuple(
                fields.integers(data.get("offsets"), "offsets", max_len=MAX_LOOKUP_HASHES)
            ),
            ttl_s=fields.number(data.get("ttl_s"), "ttl_s", unit="seconds"),
            block_bytes=fields.integer(data.get("block_bytes"), "block_bytes", 1, _MAX_BLOCK_BYTES),
            segment=segment,
            transfer_address=fields.text(data.get("transfer_address"), "transfer_address"),
        )


@dataclass(frozen=True, slots=True)
class Holding:
    """What a holder answers lookups from, once its store and transfer engine run."""

    desk: LeaseDesk
    block_bytes: int
    # BlockLayout.fingerprint(): readers with another layout are refused.
    layout: bytes
    # The DRAM pool's transfer segment.
    segment: SegmentDescriptor
    transfer_address: str

    def answer(self, node_id: str, grant: Grant | None) -> LookupAnswer:
        """The answer to a lookup that leased ``grant`` (None: nothing held)."""
        return LookupAnswer(
            node_id=node_id,
            lease_id=grant.lease_id if grant else 0,
            offsets=tuple(grant.offsets) if grant else (),
            ttl_s=grant.ttl_s if grant else 0.0,
            block_bytes=self.block_bytes,
            segment=self.segment,
            transfer_address=self.transfer_address,
        )


@dataclass(frozen=True, slots=True)
class ReleaseBody:
    """A reader gives a lease back once it read the slots, or gave up on them."""

    lease_id: int

    def encode(self) -> bytes:
        return orjson.dumps({"lease_id": self.lease_id})

    @classmethod
    def decode(cls, data: dict[str, Any]) -> ReleaseBody:
        return cls(fields.integer(data.get("lease_id"), "lease_id", 1))


@dataclass(frozen=True, slots=True)
class ReleaseAnswer:
    # False: the lease had lapsed; what was read must be discarded.
    released: bool

    def encode(self) -> bytes:
        return orjson.dumps({"released": self.released})

    @classmethod
    def decode(cls, data: dict[str, Any]) -> ReleaseAnswer:
        return cls(fields.flag(data.get("released"), "released"))


class LeaseClient:
    """The reader's side of the lease calls (a ``PeerClient``), each signed for
    its peer as ``wire.calls.SignedCalls`` signs it."""

    def __init__(
        self,
        *,
        secret: bytes,
        node_id: Callable[[], str],
        block_bytes: int,
        layout: bytes,
        targets: Callable[[str], Target | None] = lambda peer: None,
    ) -> None:
        self._node_id = node_id
        self._block_bytes = block_bytes
        self._layout = layout
        self._calls = SignedCalls(derive_key(secret), targets=targets)

    async def start(self) -> None:
        await self._calls.start()

    async def close(self) -> None:
        await self._calls.close()

    async def __aenter__(self) -> LeaseClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def lookup(
        self, peer: str, hashes: Sequence[BlockHash], ttl_s: float, timeout_s: float
    ) -> Offer | None:
        body = LookupBody(tuple(hashes), self._block_bytes, self._layout, self._node_id(), ttl_s)
        data = await self._call(peer, LOOKUP_PATH, body.encode(), timeout_s)
        try:
            return LookupAnswer.decode(data).offer(peer)
        except ValueError as exc:
            raise PeerError(f"{peer}: malformed lookup answer ({exc})") from None

    async def release(self, offer: Offer, timeout_s: float) -> bool:
        body = ReleaseBody(offer.lease_id).encode()
        data = await self._call(offer.peer, RELEASE_PATH, body, timeout_s)
        try:
            return ReleaseAnswer.decode(data).released
        except ValueError as exc:
            raise PeerError(f"{offer.peer}: malformed release answer ({exc})") from None

    async def _call(self, peer: str, path: str, raw: bytes, timeout_s: float) -> dict[str, Any]:
        try:
            return await self._calls.post(peer, path, raw, timeout_s)
        except CallFailed as exc:
            raise PeerError(str(exc)) from None
