"""The target's side of a replica put: rows peers write blocks into, checked
before a block enters DRAM.

A node that holds blocks in DRAM can have them copied to other nodes (a put
with a replica count). The writer pushes the bytes: the target ``reserve``s
rows of its inbox (staging memory in a transfer segment of its own) and
grants the writer write access to exactly those rows, until the grant's
deadline; the writer writes each block into its row and ``commit``s, stating
each block's checksum (``ssd.data_crc``: CRC-32 over hash || bytes). The
target ends the grant, copies each row into a fresh DRAM slot, computes the
checksum on the slot and publishes the block only if it matches: a block
whose bytes do not match is refused and never visible, in the DRAM index or
(through it) in gossip.

Why an inbox of its own rather than writes straight into DRAM slots:

- the DRAM tier stays read-only to peers, as everything that reads it
  assumes: a published slot is never written from outside, so what a
  reader leases is what was checked;
- over RDMA a grant is checked when the memory key is handed out, and the
  key outlives the grant (over TCP each op is checked; shared memory is
  never handed out for a granted segment), so a late or stray write can
  only land in an inbox row, never in a published block; and the check
  runs on the DRAM copy, which no peer can write, so nothing changes
  between the check and the publish.

It costs one host copy per block on the target. A reservation not committed
by its deadline gives its rows back at the next ``reserve`` (a row written
late by an old writer only fails the next block's check). Everything runs on
the event loop except the copies and checksums, which run in a worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog
import torch

from mooncaked.cache.hashing import BlockHash
from mooncaked.cache.ssd import data_crc
from mooncaked.cache.store import Reservation, TieredStore

log = structlog.get_logger(__name__)


class InboxGrants(Protocol):
    """Write access to inbox rows for one peer (the transfer engine's grants)."""

    def open(self, peer: str, rows: Sequence[int], ttl_s: float) -> object: ...

    def close(self, handle: object) -> None: ...


class Outcome(enum.StrEnum):
    """What became of one block of a commit."""

    STORED = "stored"
    # This node had it already (it arrived some other way meanwhile).
    HELD = "held"
    # Its bytes did not match the checksum the writer stated: refused.
    CORRUPT = "corrupt"
    # The writer said its write failed: nothing to check.
    NOT_WRITTEN = "not_written"
    # Every DRAM slot is leased or pinned.
    NO_SLOT = "no_slot"


@dataclass(frozen=True, slots=True)
class InboxReservation:
    """Rows granted to ``source``: ``rows[i]`` receives ``hashes[i]``."""

    reservation_id: int
    source: str
    hashes: tuple[BlockHash, ...]
    rows: tuple[int, ...]
    # Monotonic: past it the rows go back (the grant ended then too).
    deadline: float
    # The writer is outside the cluster view: its rows count against the
    # outsiders' shared cap.
    outside: bool = False


@dataclass(slots=True)
class InboxStats:
    reservations: int = 0
    blocks_reserved: int = 0
    # Reserves that found every row taken.
    refused_full: int = 0
    # Reserves by writers outside the cluster view that found the rows those
    # writers may hold together (max_rows_outside) taken.
    refused_outside: int = 0
    # Blocks a reserve skipped because this node holds them.
    held: int = 0
    stored: int = 0
    corrupt: int = 0
    not_written: int = 0
    no_slot: int = 0
    expired: int = 0
    # Gauges, filled by stats().
    rows_total: int = 0
    rows_free: int = 0


class ReplicaInbox:
    """Inbox rows of one node and the reservations that hold them."""

    def __init__(
        self,
        store: TieredStore,
        rows: torch.Tensor,
        grants: InboxGrants,
        *,
        ttl_s: float,
        max_rows_outside: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``rows``: uint8 ``[num_rows, block_bytes]``, the memory of the
        transfer segment the grants open. ``max_rows_outside``: the rows that
        writers outside the cluster view may hold together (0: none)."""
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != store.block_bytes:
            raise ValueError(
                f"inbox rows must be uint8 [n, {store.block_bytes}], "
                f"got {rows.dtype} {tuple(rows.shape)}"
            )
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_rows_outside < 0:
            raise ValueError(f"max_rows_outside must be >= 0, got {max_rows_outside}")
        self._store = store
        self.max_rows_outside = max_rows_outside
        self.rows = rows
        self.block_bytes = store.block_bytes
        self._grants = grants
        self._ttl_s = ttl_s
        self._clock = clock
        # Popped from the end: row 0 first.
        self._free = list(range(rows.shape[0] - 1, -1, -1))
        self._live: dict[int, tuple[InboxReservation, object]] = {}
        self._next_id = 1
        self._stats = InboxStats()

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])

    def row_offset(self, row: int) -> int:
        """Byte offset of ``row`` in the inbox segment: where the writer writes."""
        return row * self.block_bytes

    # -- reserve -----------------------------------------------------------

    def reserve(
        self, source: str, hashes: Sequence[BlockHash], *, outside: bool = False
    ) -> tuple[InboxReservation | None, list[int]]:
        """Rows for the blocks of ``hashes`` this node lacks, as many as are
        free, granted to ``source``; and the indices of the blocks it holds
        already. None when it lacks some and no row is free (a shortage).
        A writer ``outside`` the cluster view gets at most what the outsiders'
        cap leaves."""
        self._reap()
        held = [i for i, h in enumerate(hashes) if self._held(h)]
        self._stats.held += len(held)
        want = [h for h in dict.fromkeys(hashes) if not self._held(h)]
        if not want:
            return None, held
        n = min(len(want), len(self._free))
        if n == 0:
            self._stats.refused_full += 1
            return None, held
        if outside:
            n = min(n, self.max_rows_outside - self.rows_outside())
            if n <= 0:
                self._stats.refused_outside += 1
                return None, held
        rows = tuple(self._free.pop() for _ in range(n))
        try:
            handle = self._grants.open(source, rows, self._ttl_s)
        except BaseException:
            self._free.extend(reversed(rows))
            raise
        res = InboxReservation(
            self._next_id, source, tuple(want[:n]), rows, self._clock() + self._ttl_s, outside
        )
        self._next_id += 1
        self._live[res.reservation_id] = (res, handle)
        self._stats.reservations += 1
        self._stats.blocks_reserved += n
        return res, held

    def rows_outside(self) -> int:
        """Rows that writers outside the cluster view hold now."""
        return sum(len(res.rows) for res, _ in self._live.values() if res.outside)

    def _held(self, block_hash: BlockHash) -> bool:
        store = self._store
        return store.dram.has(block_hash) or (store.ssd is not None and store.ssd.has(block_hash))

    def _reap(self) -> None:
        now = self._clock()
        for rid in [rid for rid, (res, _) in self._live.items() if res.deadline < now]:
            self._end(rid)
            self._stats.expired += 1

    def _end(self, reservation_id: int) -> InboxReservation | None:
        """End a reservation: its grant closes, its rows go back."""
        entry = self._live.pop(reservation_id, None)
        if entry is None:
            return None
        res, handle = entry
        self._grants.close(handle)
        self._free.extend(reversed(res.rows))
        return res

    # -- commit ------------------------------------------------------------

    def hashes_of(self, reservation_id: int, source: str) -> tuple[BlockHash, ...]:
        """The blocks a live reservation of ``source`` holds rows for (none: ())."""
        entry = self._live.get(reservation_id)
        if entry is None or entry[0].source != source:
            return ()
        return entry[0].hashes

    async def commit(
        self, reservation_id: int, source: str, crcs: Sequence[int | None]
    ) -> list[Outcome]:
        """Check and publish the blocks of a reservation: one outcome each, in
        order. ``crcs[i]`` is the writer's checksum of block i (None: its write
        failed). ValueError for a reservation this source does not hold (or
        that ran out) or a wrong number of checksums."""
        entry = self._live.get(reservation_id)
        if entry is None or entry[0].source != source:
            raise ValueError(
                f"reservation {reservation_id} is not held by {source!r} "
                "(never made, already committed, or past its deadline)"
            )
        res = entry[0]
        if len(crcs) != len(res.hashes):
            raise ValueError(
                f"reservation {reservation_id} holds {len(res.hashes)} blocks, "
                f"got {len(crcs)} checksums"
            )
        # The grant ends first: from here on the writer cannot change a row.
        self._end(reservation_id)
        if res.deadline < self._clock():
            self._stats.expired += 1
            raise ValueError(f"reservation {reservation_id} ran past its deadline")
        outcomes: list[Outcome | None] = [None] * len(res.hashes)
        # (index, row, DRAM reservation of one slot, stated crc)
        todo: list[tuple[int, int, Reservation, int]] = []
        for i, (h, row, crc) in enumerate(zip(res.hashes, res.rows, crcs, strict=True)):
            if crc is None:
                outcomes[i] = Outcome.NOT_WRITTEN
                continue
            if self._store.dram.has(h):
                outcomes[i] = Outcome.HELD
                continue
            one = self._store.reserve([h])
            if one is None:
                outcomes[i] = Outcome.NO_SLOT
                continue
            todo.append((i, row, one, crc))
        if todo:
            await self._check_and_publish(todo, outcomes)
        done = [o if o is not None else Outcome.NOT_WRITTEN for o in outcomes]
        self._count(done)
        return done

    async def _check_and_publish(
        self, todo: list[tuple[int, int, Reservation, int]], outcomes: list[Outcome | None]
    ) -> None:
        store = self._store
        dram = store.dram
        jobs = [(row, r.slots[0], r.hashes[0], crc) for _, row, r, crc in todo]

        def copy_and_check() -> list[bool]:
            ok: list[bool] = []
            for row, slot, h, crc in jobs:
                dst = dram.slot(slot)
                dst.copy_(self.rows[row])
                # Checked on the DRAM copy, which no peer can write.
                ok.append(data_crc(h, dst.numpy()) == crc)
            return ok

        fut = asyncio.get_running_loop().run_in_executor(None, copy_and_check)
        try:
            # Shielded: the thread writes into the slots, which are given back
            # only once it is done, even if the caller stops waiting.
            results = await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda _f: self._abort_all(todo))
            raise
        except BaseException:
            self._abort_all(todo)
            raise
        for (i, _, r, _), ok in zip(todo, results, strict=True):
            if ok:
                store.commit_reserved(r, 1)
                outcomes[i] = Outcome.STORED
            else:
                store.abort_reserved(r)
                outcomes[i] = Outcome.CORRUPT
                log.warning("store.replica_refused", block=r.hashes[0].hex(), why="checksum")

    def _abort_all(self, todo: list[tuple[int, int, Reservation, int]]) -> None:
        for _, _, r, _ in todo:
            self._store.abort_reserved(r)

    def _count(self, outcomes: list[Outcome]) -> None:
        s = self._stats
        for o in outcomes:
            if o is Outcome.STORED:
                s.stored += 1
            elif o is Outcome.CORRUPT:
                s.corrupt += 1
            elif o is Outcome.NOT_WRITTEN:
                s.not_written += 1
            elif o is Outcome.NO_SLOT:
                s.no_slot += 1
            else:
                s.held += 1

    def abort(self, reservation_id: int, source: str) -> bool:
        """Give a reservation back unused; False if ``source`` holds no such one."""
        entry = self._live.get(reservation_id)
        if entry is None or entry[0].source != source:
            return False
        self._end(reservation_id)
        return True

    def close(self) -> None:
        """End every reservation (their grants close)."""
        for rid in list(self._live):
            self._end(rid)

    # -- stats -------------------------------------------------------------

    def stats(self) -> InboxStats:
        self._reap()
        out = dataclasses.replace(self._stats)
        out.rows_total = self.num_rows
        out.rows_free = len(self._free)
        return out

    def check_integrity(self) -> None:
        """RuntimeError if rows are lost or double-booked."""
        booked = [row for res, _ in self._live.values() for row in res.rows]
        if sorted(booked + self._free) != list(range(self.num_rows)):
            raise RuntimeError(
                f"inbox rows: {len(booked)} reserved + {len(self._free)} free != {self.num_rows}"
            )
