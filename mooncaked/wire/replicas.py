"""The calls of a replica put, writer -> holder, their bodies and their client.

- ``POST /internal/store/reserve`` with a ``ReserveBody`` -> a ``ReserveAnswer``:
  the holder reserves inbox rows for the blocks it lacks and grants the
  writer write access to exactly those rows (``cache/inbox.py``); the answer
  says which of the hashes got a row and at which byte offset of which
  transfer segment, and which the holder has already.
- ``POST /internal/store/commit`` with a ``CommitBody`` (each block's
  checksum as the writer states it, or null for a write that failed; and
  for how long the holder should soft-pin its copies, when the put keeps a
  request's prompt) -> a ``CommitAnswer``: each block stored, held already,
  refused as corrupt, not written, or without a DRAM slot.
- ``POST /internal/store/drop`` with a ``DropBody`` -> a ``DropAnswer``: the
  holder drops its copies (lowering a replica count: pinned ones are kept;
  a remove: pins end too).

Every call is signed for its holder's id and generation (``mooncaked.rpc``).
``ReplicaClient`` makes them; ``ReplicaDesk`` is what a holder answers from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import structlog

from mooncaked.cache.hashing import BlockHash, parse_hex_hashes
from mooncaked.cache.inbox import Outcome, ReplicaInbox
from mooncaked.cache.pins import MAX_TTL_S, PinBudgetExceeded
from mooncaked.cache.store import TieredStore
from mooncaked.rpc import Target, derive_key
from mooncaked.wire import fields
from mooncaked.wire.calls import CallFailed, SignedCalls
from mooncaked.wire.paths import (
    MAX_LOOKUP_HASHES,
    REPLICA_COMMIT_PATH,
    REPLICA_DROP_PATH,
    REPLICA_RESERVE_PATH,
)

# The transfer segment a node's replica inbox lives in; writers write it
# under a grant and read nothing.
INBOX_SEGMENT = "kv.inbox"
# Most bytes one block may have (as the lease calls bound it).
_MAX_BLOCK_BYTES = 1 << 34
# A checksum is a CRC-32.
_MAX_CRC = 0xFFFFFFFF
_OUTCOMES = {o.value: o for o in Outcome}
# What a holder has after a commit.
_KEPT = (Outcome.STORED, Outcome.HELD)

log = structlog.get_logger(__name__)


class ReplicaError(Exception):
    """A holder could not be asked or did not answer sensibly."""


class WriterRefused(ValueError):
    """This node takes no replicas from the writer named (answered 403)."""


def _hashes(raw: Any, name: str = "hashes") -> tuple[BlockHash, ...]:
    return tuple(parse_hex_hashes(raw, name, MAX_LOOKUP_HASHES))


def _indices(raw: Any, name: str, limit: int) -> tuple[int, ...]:
    values = fields.integers(raw, name, max_len=MAX_LOOKUP_HASHES)
    if any(v >= limit for v in values):
        raise fields.refuse(name, f"indices below {limit}", raw)
    return tuple(values)


@dataclass(frozen=True, slots=True)
class ReserveBody:
    # The writer's node id (the grant names it).
    source: str
    hashes: tuple[BlockHash, ...]
    # The writer's block size and layout (``BlockLayout.fingerprint()``).
    block_bytes: int
    layout: bytes

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "source": self.source,
                "hashes": [h.hex() for h in self.hashes],
                "block_bytes": self.block_bytes,
                "layout": self.layout.hex(),
            }
        )

    @classmethod
    def decode(cls, data: dict[str, Any]) -> ReserveBody:
        """ValueError naming the field that is wrong."""
        layout = data.get("layout")
        try:
            fingerprint = bytes.fromhex(layout) if isinstance(layout, str) else b""
        except ValueError:
            fingerprint = b""
        if not fingerprint:
            raise fields.refuse("layout", "the writer's block layout fingerprint, hex", layout)
        return cls(
            source=fields.text(data.get("source"), "source"),
            hashes=_hashes(data.get("hashes")),
            block_bytes=fields.integer(data.get("block_bytes"), "block_bytes", 1, _MAX_BLOCK_BYTES),
            layout=fingerprint,
        )


@dataclass(frozen=True, slots=True)
class ReserveAnswer:
    node_id: str
    # 0: nothing reserved (every block held already, or no row free).
    reservation_id: int
    # Indices into the hashes asked: those that got a row, and where the
    # row is (a byte offset of ``segment``); and those the holder has.
    reserved: tuple[int, ...]
    offsets: tuple[int, ...]
    held: tuple[int, ...]
    segment: str
    transfer_address: str
    ttl_s: float

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "node_id": self.node_id,
                "reservation_id": self.reservation_id,
                "reserved": list(self.reserved),
                "offsets": list(self.offsets),
                "held": list(self.held),
                "segment": self.segment,
                "transfer_address": self.transfer_address,
                "ttl_s": self.ttl_s,
            }
        )

    @classmethod
    def decode(cls, data: dict[str, Any], num_asked: int) -> ReserveAnswer:
        """ValueError naming the field that is wrong (indices past ``num_asked``)."""
        reserved = _indices(data.get("reserved"), "reserved", num_asked)
        offsets = tuple(fields.integers(data.get("offsets"), "offsets", max_len=len(reserved)))
        if len(offsets) != len(reserved):
            raise fields.refuse("offsets", f"{len(reserved)} offsets", data.get("offsets"))
        return cls(
            node_id=fields.text(data.get("node_id"), "node_id"),
            reservation_id=fields.integer(data.get("reservation_id"), "reservation_id"),
            reserved=reserved,
            offsets=offsets,
            held=_indices(data.get("held"), "held", num_asked),
            segment=fields.text(data.get("segment"), "segment"),
            transfer_address=fields.text(
                data.get("transfer_address"), "transfer_address", empty=True
            ),
            ttl_s=fields.number(data.get("ttl_s"), "ttl_s", unit="seconds"),
        )


@dataclass(frozen=True, slots=True)
class CommitBody:
    source: str
    reservation_id: int
    # The writer's checksum of each reserved block, in order; None: its write failed.
    crcs: tuple[int | None, ...]
    # Soft-pin the copies for this long (a retained prompt's); 0: no pin.
    pin_s: float = 0.0

    def encode(self) -> bytes:
        doc: dict[str, Any] = {
            "source": self.source,
            "reservation_id": self.reservation_id,
            "crcs": self.crcs,
        }
        if self.pin_s:
            doc["pin_s"] = self.pin_s
        return orjson.dumps(doc)

    @classmethod
    def decode(cls, data: dict[str, Any]) -> CommitBody:
        raw = data.get("crcs")
        if not isinstance(raw, list) or len(raw) > MAX_LOOKUP_HASHES:
            raise fields.refuse("crcs", "a list of checksums (or nulls)", raw)
        crcs = tuple(
            None if c is None else fields.integer(c, f"crcs[{i}]", 0, _MAX_CRC)
            for i, c in enumerate(raw)
        )
        return cls(
            source=fields.text(data.get("source"), "source"),
            reservation_id=fields.integer(data.get("reservation_id"), "reservation_id", 1),
            crcs=crcs,
            pin_s=fields.number(data.get("pin_s", 0.0), "pin_s", 0.0, MAX_TTL_S, unit="seconds"),
        )


@dataclass(frozen=True, slots=True)
class CommitAnswer:
    outcomes: tuple[Outcome, ...]

    def encode(self) -> bytes:
        return orjson.dumps({"outcomes": [o.value for o in self.outcomes]})

    @classmethod
    def decode(cls, data: dict[str, Any]) -> CommitAnswer:
        raw = data.get("outcomes")
        if not isinstance(raw, list) or not all(isinstance(o, str) and o in _OUTCOMES for o in raw):
            raise fields.refuse("outcomes", f"a list of {sorted(_OUTCOMES)}", raw)
        return cls(tuple(_OUTCOMES[o] for o in raw))


@dataclass(frozen=True, slots=True)
class DropBody:
    hashes: tuple[BlockHash, ...]
    # A remove: the blocks' pins end and pinned blocks go too. Else (a
    # lower replica count) pinned blocks are kept.
    unpin: bool = False

    def encode(self) -> bytes:
        return orjson.dumps({"hashes": [h.hex() for h in self.hashes], "unpin": self.unpin})

    @classmethod
    def decode(cls, data: dict[str, Any]) -> DropBody:
        return cls(_hashes(data.get("hashes")), fields.flag(data.get("unpin", False), "unpin"))


@dataclass(frozen=True, slots=True)
class DropAnswer:
    dropped: int
    kept_pinned: int

    def encode(self) -> bytes:
        return orjson.dumps({"dropped": self.dropped, "kept_pinned": self.kept_pinned})

    @classmethod
    def decode(cls, data: dict[str, Any]) -> DropAnswer:
        return cls(
            fields.integer(data.get("dropped"), "dropped"),
            fields.integer(data.get("kept_pinned"), "kept_pinned"),
        )


@dataclass(frozen=True, slots=True)
class ReplicaDesk:
    """What a holder answers replica calls from, once its store runs."""

    store: TieredStore
    # None: this node takes no replicas (store.replica_inbox_bytes = 0).
    inbox: ReplicaInbox | None
    layout: bytes
    transfer_address: str

    def reserve(self, node_id: str, body: ReserveBody, *, outside: bool = False) -> ReserveAnswer:
        """ValueError when the writer's layout differs or this node takes no
        replicas; WriterRefused for a writer ``outside`` the cluster view when
        this node takes none from outside."""
        inbox = self.inbox
        if outside and (inbox is None or inbox.max_rows_outside == 0):
            raise WriterRefused(
                f"this node takes no replicas from {body.source!r}: it is not an up member "
                "of this node's cluster view, and store.replica_max_rows_outside is 0"
            )
        if (body.block_bytes, body.layout) != (self.store.block_bytes, self.layout):
            raise ValueError(
                f"block layout differs: this node stores {self.store.block_bytes}-byte blocks "
                f"of layout {self.layout.hex()}"
            )
        if inbox is None:
            raise ValueError("this node takes no replicas (store.replica_inbox_bytes = 0)")
        res, held = inbox.reserve(body.source, body.hashes, outside=outside)
        reserved: tuple[int, ...] = ()
        offsets: tuple[int, ...] = ()
        if res is not None:
            first = {h: i for i, h in reversed(list(enumerate(body.hashes)))}
            reserved = tuple(first[h] for h in res.hashes)
            offsets = tuple(inbox.row_offset(r) for r in res.rows)
        return ReserveAnswer(
            node_id=node_id,
            reservation_id=res.reservation_id if res is not None else 0,
            reserved=reserved,
            offsets=offsets,
            held=tuple(held),
            segment=INBOX_SEGMENT,
            transfer_address=self.transfer_address,
            ttl_s=self.store.config.replica_timeout_s,
        )

    async def commit(self, body: CommitBody) -> CommitAnswer:
        """ValueError for a reservation the writer does not hold, or this node
        taking no replicas. The copies a retained prompt's put asks to pin are
        soft-pinned here too, budget allowing (a refusal keeps them unpinned)."""
        inbox = self.inbox
        if inbox is None:
            raise ValueError("this node takes no replicas (store.replica_inbox_bytes = 0)")
        hashes = inbox.hashes_of(body.reservation_id, body.source)
        outcomes = await inbox.commit(body.reservation_id, body.source, body.crcs)
        kept = [h for h, o in zip(hashes, outcomes, strict=True) if o in _KEPT]
        if body.pin_s and kept:
            try:
                self.store.pin(kept, ttl_s=body.pin_s, hard=False)
            except PinBudgetExceeded as exc:
                log.warning("replicas.pin_refused", blocks=len(kept), error=str(exc))
        return CommitAnswer(tuple(outcomes))

    def drop(self, body: DropBody) -> DropAnswer:
        store = self.store
        pins = store.retention.pins
        keep = [] if body.unpin else [h for h in body.hashes if h in pins]
        kept = set(keep)
        return DropAnswer(store.remove([h for h in body.hashes if h not in kept]), len(keep))


def _who(url: str, target: Target | None) -> str:
    return target.node_id if target is not None else url


class ReplicaClient:
    """The writer's side of the replica calls, each signed for its holder
    (``target``; None: as the holder itself says, for a writer outside the
    cluster view)."""

    def __init__(self, *, secret: bytes) -> None:
        self._calls = SignedCalls(derive_key(secret))

    async def __aenter__(self) -> ReplicaClient:
        await self._calls.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._calls.close()

    async def reserve(
        self, url: str, target: Target | None, body: ReserveBody, timeout_s: float
    ) -> ReserveAnswer:
        data = await self._call(url, target, REPLICA_RESERVE_PATH, body.encode(), timeout_s)
        try:
            return ReserveAnswer.decode(data, len(body.hashes))
        except ValueError as exc:
            raise ReplicaError(f"{_who(url, target)}: malformed reserve answer ({exc})") from None

    async def commit(
        self, url: str, target: Target | None, body: CommitBody, timeout_s: float
    ) -> CommitAnswer:
        data = await self._call(url, target, REPLICA_COMMIT_PATH, body.encode(), timeout_s)
        try:
            answer = CommitAnswer.decode(data)
        except ValueError as exc:
            raise ReplicaError(f"{_who(url, target)}: malformed commit answer ({exc})") from None
        if len(answer.outcomes) != len(body.crcs):
            raise ReplicaError(
                f"{_who(url, target)}: {len(answer.outcomes)} outcomes for {len(body.crcs)} blocks"
            )
        return answer

    async def drop(self, url: str, target: Target, body: DropBody, timeout_s: float) -> DropAnswer:
        data = await self._call(url, target, REPLICA_DROP_PATH, body.encode(), timeout_s)
        try:
            return DropAnswer.decode(data)
        except ValueError as exc:
            raise ReplicaError(f"{_who(url, target)}: malformed drop answer ({exc})") from None

    async def _call(
        self, url: str, target: Target | None, path: str, raw: bytes, timeout_s: float
    ) -> dict[str, Any]:
        try:
            return await self._calls.post(url, path, raw, timeout_s, target=target)
        except CallFailed as exc:
            raise ReplicaError(f"{_who(url, target)}: {exc}") from None
