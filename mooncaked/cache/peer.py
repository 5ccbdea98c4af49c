"""Cached KV blocks from peers: the reader pulls, the holder only leases.

Holder side, ``LeaseDesk``: a peer asks for a prefix of block hashes; the
desk promotes SSD blocks of it to DRAM, leases the longest prefix found in
DRAM for a short time-to-live and answers with each block's byte offset in
the DRAM pool (a segment the transfer engine exposes). Nothing else of the
holder's CPU is spent on the transfer: the reader moves the bytes.

Reader side, ``PeerFetcher.fetch(hashes)``:

1. count the leading blocks already local (device prefix cache, DRAM, SSD);
2. ask the holders of the rest (``HolderLocator``) for leases, keep the
   longest offer and give the others back;
3. reserve local DRAM slots and read the leased slots into them in one
   transfer batch;
4. release the lease: a holder that says the lease had lapsed may have
   reused the slots while they were read, so those bytes are discarded;
5. publish the slots in the local DRAM tier.

Every failure (peer down, transfer failed, lease lapsed, timeout) is logged
and counted and only means the prompt is computed instead; ``fetch`` never
raises. The wire (HTTP control calls, the transfer engine) sits behind the
``PeerClient`` and ``BlockReader`` protocols, implemented in
``mooncaked.api.internal``; who holds what sits behind ``HolderLocator``
(static peer URLs from the config, or the cluster block index:
``mooncaked.cluster.holders.ClusterHolders``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from mooncaked.cache.dram import Clock, Lease, pop_expired
from mooncaked.cache.hashing import BlockHash
from mooncaked.cache.store import Reservation, TieredStore
from mooncaked.tasks import TaskSet

log = structlog.get_logger(__name__)

__all__ = [
    "BlockReader",
    "FetchStats",
    "Grant",
    "HolderLocator",
    "LeaseDesk",
    "LeaseStats",
    "Offer",
    "PeerClient",
    "PeerError",
    "PeerFetcher",
    "ReaderKind",
    "ReaderRefused",
    "StaticPeers",
]


class PeerError(Exception):
    """A peer could not be asked or did not answer sensibly (down, refused, garbled)."""


# -- holder side ---------------------------------------------------------------


class ReaderKind(enum.Enum):
    """How the holder treats the reader a lookup names.

    The name is the caller's word: every holder of the cluster secret can sign
    any name. A cap per name alone would let one caller take every lease under
    names made up for the purpose, so only names the holder can check get a
    cap of their own.
    """

    # An up member of this node's cluster view: its own per-reader cap.
    MEMBER = "member"
    # Anyone else (a node that lists this one in ``store.peers`` without
    # gossip, or one the view has not heard of yet): one cap shared by all.
    OUTSIDER = "outsider"
    # Never leased to (a name that cannot be an honest reader's).
    REFUSED = "refused"


class ReaderRefused(ValueError):
    """This node leases nothing to the reader named (answered 403)."""


@dataclass(frozen=True, slots=True)
class Grant:
    """Blocks leased to a reader: the first ``len(offsets)`` hashes it asked for."""

    lease_id: int
    # Byte offset of each block in the DRAM pool's buffer.
    offsets: tuple[int, ...]
    ttl_s: float

    @property
    def num_blocks(self) -> int:
        return len(self.offsets)


@dataclass(slots=True)
class LeaseStats:
    granted: int = 0
    blocks_granted: int = 0
    # Lookups that found no block in DRAM or on the SSD.
    empty: int = 0
    # Lookups turned away because peer_max_leases leases were out.
    refused: int = 0
    # Lookups turned away because their reader held peer_max_leases_per_reader.
    refused_reader: int = 0
    # Lookups by readers outside the cluster view turned away because those
    # readers together held peer_max_leases_outside.
    refused_outside: int = 0
    # Lookups refused outright (403): a reader this node never leases to.
    refused_unknown: int = 0
    released: int = 0
    # Leases whose time ran out before their release (the reader was told).
    lapsed: int = 0
    # Gauge, filled by stats().
    active: int = 0


class LeaseDesk:
    """Leases DRAM blocks to readers on other nodes; bounded, each with a deadline."""

    def __init__(
        self,
        store: TieredStore,
        *,
        max_leases: int,
        max_leases_per_reader: int | None = None,
        max_leases_outside: int | None = None,
        classify: Callable[[str], ReaderKind] | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        """``max_leases_per_reader`` (default ``max_leases``) keeps one member
        from holding every lease and starving the others; ``max_leases_outside``
        (default ``max_leases_per_reader``; 0 refuses them) bounds what every
        reader outside the cluster holds together. ``classify`` tells members
        from outsiders; without it every reader is an outsider."""
        if max_leases <= 0:
            raise ValueError(f"max_leases must be > 0, got {max_leases}")
        per_reader = max_leases if max_leases_per_reader is None else max_leases_per_reader
        if per_reader <= 0:
            raise ValueError(f"max_leases_per_reader must be > 0, got {per_reader}")
        outside = per_reader if max_leases_outside is None else max_leases_outside
        if outside < 0:
            raise ValueError(f"max_leases_outside must be >= 0, got {outside}")
        self._store = store
        self._max_leases = max_leases
        self._max_per_reader = per_reader
        self._max_outside = outside
        self._classify = classify if classify is not None else _everyone_outside
        self._clock = clock
        self._leases: dict[int, Lease] = {}
        # Lease id -> the member it counts against; None: the outsiders' share.
        self._bucket_of: dict[int, str | None] = {}
        self._stats = LeaseStats()

    async def grant(self, hashes: Sequence[BlockHash], reader: str, ttl_s: float) -> Grant | None:
        """Lease the longest prefix of ``hashes`` this node has; None when it has
        none or too many leases are out. Raises ReaderRefused for a reader this
        node never leases to."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        kind = self._classify(reader)
        if kind is ReaderKind.REFUSED or (kind is ReaderKind.OUTSIDER and not self._max_outside):
            self._stats.refused_unknown += 1
            log.warning("peer.reader_refused", reader=reader, kind=kind.value)
            why = (
                "it names this node itself"
                if kind is ReaderKind.REFUSED
                else "it is not an up member of this node's cluster view, and "
                "store.peer_max_leases_outside is 0"
            )
            raise ReaderRefused(f"this node leases no blocks to reader {reader!r}: {why}")
        bucket = reader if kind is ReaderKind.MEMBER else None
        if self._over_cap(reader, bucket):
            return None
        owner = f"peer:{reader}"
        # Peers read DRAM slots only: blocks on the SSD come up first.
        await self._store.promote(hashes, owner=owner)
        # Checked again: other lookups may have been granted while this one
        # waited, and concurrent calls must not add up past a cap.
        if self._over_cap(reader, bucket):
            return None
        ttl = min(ttl_s, self._store.config.lease_timeout_s)
        lease = self._store.dram.lease(hashes, owner, ttl)
        if lease is None:
            self._stats.empty += 1
            return None
        self._leases[lease.lease_id] = lease
        self._bucket_of[lease.lease_id] = bucket
        self._stats.granted += 1
        self._stats.blocks_granted += lease.num_blocks
        dram = self._store.dram
        return Grant(lease.lease_id, tuple(dram.slot_offset(s) for s in lease.slot_ids), ttl)

    def _over_cap(self, reader: str, bucket: str | None) -> bool:
        """Whether a lease to ``reader`` (counted against ``bucket``) would pass
        a cap; counts the refusal."""
        self._end_lapsed()
        if len(self._leases) >= self._max_leases:
            self._stats.refused += 1
            return True
        held = sum(1 for b in self._bucket_of.values() if b == bucket)
        if bucket is None and held >= self._max_outside:
            self._stats.refused_outside += 1
            log.warning("peer.outside_lease_cap", reader=reader, limit=self._max_outside)
            return True
        if bucket is not None and held >= self._max_per_reader:
            self._stats.refused_reader += 1
            log.warning("peer.reader_lease_cap", reader=reader, limit=self._max_per_reader)
            return True
        return False

    def release(self, lease_id: int) -> bool:
        """End a lease; False when it had lapsed (or never existed): the reader must
        then discard what it read."""
        lease = self._leases.pop(lease_id, None)
        self._bucket_of.pop(lease_id, None)
        if lease is None:
            return False
        # Past its deadline the slots may already have gone to other blocks,
        # whether or not the pool has reaped the lease yet.
        in_time = self._clock() <= lease.deadline
        held = self._store.dram.release(lease)
        if in_time and held:
            self._stats.released += 1
            return True
        self._stats.lapsed += 1
        return False

    def close(self) -> int:
        """End every lease (readers' releases will say lapsed); how many ended."""
        leases = list(self._leases.values())
        self._leases.clear()
        self._bucket_of.clear()
        for lease in leases:
            self._store.dram.release(lease)
        return len(leases)

    def _end_lapsed(self) -> None:
        for lease in pop_expired(self._leases, self._clock()):
            self._bucket_of.pop(lease.lease_id, None)
            self._store.dram.release(lease)
            self._stats.lapsed += 1
            log.warning(
                "peer.lease_lapsed",
                owner=lease.owner,
                lease_id=lease.lease_id,
                num_blocks=lease.num_blocks,
            )

    @property
    def num_active(self) -> int:
        return len(self._leases)

    def stats(self) -> LeaseStats:
        # Lapsed leases end here too, not only at the next grant: a reader
        # cut off before its release would otherwise count as active, and
        # hold its DRAM slots, for as long as no other reader asks.
        self._end_lapsed()
        out = dataclasses.replace(self._stats)
        out.active = len(self._leases)
        return out


def _everyone_outside(reader: str) -> ReaderKind:
    return ReaderKind.OUTSIDER


# -- reader side ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Offer:
    """A holder's answer: blocks leased to us, where to read them, whom to release."""

    # Who was asked (an HTTP base URL) and the transfer identity it answered with.
    peer: str
    node_id: str
    lease_id: int
    # Byte offset of block i (of the hashes asked for) in the holder's segment.
    offsets: tuple[int, ...]
    block_bytes: int
    segment: str
    transfer_address: str

    @property
    def num_blocks(self) -> int:
        return len(self.offsets)


class HolderLocator(Protocol):
    """Who may hold a prefix of blocks: peers to ask, best first."""

    def holders(self, hashes: Sequence[BlockHash]) -> list[str]: ...


class PeerClient(Protocol):
    """The control calls to a holder. Both raise PeerError when the peer cannot
    be asked or answers nonsense."""

    async def lookup(
        self, peer: str, hashes: Sequence[BlockHash], ttl_s: float, timeout_s: float
    ) -> Offer | None: ...

    async def release(self, offer: Offer, timeout_s: float) -> bool: ...


class BlockReader(Protocol):
    async def read(self, offer: Offer, local_offsets: Sequence[int], timeout_s: float) -> int:
        """Copy block i of the offer to byte ``local_offsets[i]`` of the local DRAM
        pool; how many leading blocks landed. Returns (or raises) only once
        nothing writes into those bytes any more."""
        ...


@dataclass(frozen=True, slots=True)
class StaticPeers:
    """Every configured peer may hold anything: ask them all."""

    urls: tuple[str, ...]

    def holders(self, hashes: Sequence[BlockHash]) -> list[str]:
        return list(self.urls)


@dataclass(slots=True)
class FetchStats:
    # fetch() calls that asked peers, and how they ended.
    fetches: int = 0
    ok: int = 0
    failed: int = 0
    # No peer had the next block.
    missed: int = 0
    # Over peer_max_fetches: computed instead, nobody asked.
    skipped: int = 0
    # fetch() calls that found no peer to ask. The engine checks would_ask()
    # first, so a prompt that no peer holds normally never gets here.
    nobody_to_ask: int = 0
    # The caller stopped waiting at peer_fetch_timeout_s.
    timed_out: int = 0
    # Reads discarded because the holder said the lease had lapsed.
    lapsed: int = 0
    # Fetches that went on from another holder after the first could not
    # give every block (it failed, died mid-read, or its lease lapsed).
    failovers: int = 0
    # Peers that could not be asked or answered nonsense.
    lookup_errors: int = 0
    blocks: int = 0
    bytes: int = 0
    # Gauge, filled by stats().
    inflight: int = 0


# The lease a reader asks for outlives its own deadline by this much, so a
# fetch that ends at its deadline still finds the lease held.
_LEASE_MARGIN_S = 5.0
# Offers a fetch keeps: the one it reads and a standby from another holder.
_KEPT_OFFERS = 2


class PeerFetcher:
    """Pulls the blocks of a prompt's prefix from peers into the local DRAM tier."""

    def __init__(
        self,
        store: TieredStore,
        locator: HolderLocator,
        client: PeerClient,
        reader: BlockReader,
        *,
        timeout_s: float,
        max_fetches: int,
        device_prefix: Callable[[Sequence[BlockHash]], int] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_fetches <= 0:
            raise ValueError(f"max_fetches must be > 0, got {max_fetches}")
        self._store = store
        self._locator = locator
        self._client = client
        self._reader = reader
        self._timeout_s = timeout_s
        self._max_fetches = max_fetches
        # Leading blocks the engine's device prefix cache holds already.
        self.device_prefix = device_prefix
        self._stats = FetchStats()
        # Told of every completed fetch: (holder node id, bytes, seconds from
        # the lease request to the data in DRAM); a cost model learns each
        # link's effective bandwidth from it.
        self.on_read: Callable[[str, int, float], None] | None = None
        self._tasks = TaskSet("peer-fetch", on_failure=self._task_failed)
        # First block of each fetch in flight: a second request for the same
        # prefix waits for it instead of leasing the same blocks again.
        self._inflight: dict[BlockHash, asyncio.Task[None]] = {}
        self._closing = False

    def local_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``hashes`` on this node: device, then DRAM or SSD."""
        n = self.device_prefix(hashes) if self.device_prefix is not None else 0
        return n + self._store.lookup(hashes[n:], record_stats=False).num_blocks

    def would_ask(self, hashes: Sequence[BlockHash]) -> bool:
        """Whether ``fetch(hashes)`` would ask any peer; no I/O. The engine asks
        on arrival, so a prompt that no peer holds is never held back."""
        if self._closing:
            return False
        start = self.local_prefix(hashes)
        return start < len(hashes) and bool(self._locator.holders(hashes[start:]))

    async def fetch(self, hashes: Sequence[BlockHash]) -> int:
        """Bring the blocks of ``hashes`` that peers hold into local DRAM; how many
        leading blocks of ``hashes`` are local afterwards. Never raises."""
        try:
            return await self._fetch_bounded(list(hashes))
        except Exception as exc:
            # A bug here must cost a recompute, never the request.
            log.error("peer.fetch_failed", error=repr(exc), exc_info=exc)
            return self.local_prefix(hashes)

    async def _fetch_bounded(self, hashes: list[BlockHash]) -> int:
        start = self.local_prefix(hashes)
        if self._closing or start >= len(hashes):
            return start
        holders = self._locator.holders(hashes[start:])
        if not holders:
            self._stats.nobody_to_ask += 1
            return start
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        task = self._inflight.get(hashes[start])
        if task is None:
            if len(self._inflight) >= self._max_fetches:
                self._stats.skipped += 1
                return start
            task = self._spawn(self._fetch(hashes, start, holders, deadline), "peer-fetch")
            first = hashes[start]
            self._inflight[first] = task
            task.add_done_callback(lambda _t: self._inflight.pop(first, None))
        try:
            async with asyncio.timeout_at(deadline):
                # Shielded: the fetch fills reserved slots and must finish (or
                # give them back) on its own even when its caller stops waiting.
                await asyncio.shield(task)
        except TimeoutError:
            self._stats.timed_out += 1
            log.warning("peer.fetch_timed_out", timeout_s=self._timeout_s, first_block=start)
        return self.local_prefix(hashes)

    async def _fetch(
        self, hashes: list[BlockHash], start: int, holders: list[str], deadline: float
    ) -> None:
        self._stats.fetches += 1
        fetch_started = time.monotonic()
        want = hashes[start:]
        offers, num_errors = await self._offers(want, holders, deadline)
        if not offers:
            # Nobody could be asked: a failure; everybody answered "none": a miss.
            if num_errors:
                self._stats.failed += 1
            else:
                self._stats.missed += 1
            return
        reservation = self._store.reserve(want[: offers[0].num_blocks])
        if reservation is None:
            # DRAM got the next block meanwhile (or has no slot to spare).
            await asyncio.gather(*(self._release(o, deadline) for o in offers))
            self._stats.missed += 1
            return
        try:
            num_read = await self._read_all(
                want, reservation, offers, holders, deadline, fetch_started
            )
        except BaseException:
            self._store.abort_reserved(reservation)
            raise
        stored = self._store.commit_reserved(reservation, num_read)
        if stored:
            self._stats.ok += 1
            self._stats.blocks += stored
            self._stats.bytes += stored * self._store.block_bytes
            log.info("peer.fetched", peer=offers[0].peer, blocks=stored, first_block=start)
        else:
            self._stats.failed += 1

    async def _read_all(
        self,
        want: list[BlockHash],
        reservation: Reservation,
        offers: list[Offer],
        holders: list[str],
        deadline: float,
        fetch_started: float,
    ) -> int:
        """The reserved blocks read from the best offer; what it could not give
        (its holder failed or died mid-read, its lease lapsed) read from the
        standby offer kept for that, then from holders not asked yet, within
        the same deadline. How many leading reserved blocks hold good bytes."""
        n = reservation.num_blocks
        # Offers not read from yet, with the index in ``want`` of their first block.
        pending = [(0, o) for o in offers]
        asked = {o.peer for o in offers}
        valid = 0
        reads = 0
        try:
            while valid < n:
                if not pending:
                    rest = [p for p in holders if p not in asked]
                    if not rest or self._left(deadline) <= 0.001:
                        break
                    asked.update(rest)
                    more, _ = await self._offers(want[valid:n], rest, deadline)
                    pending = [(valid, o) for o in more]
                    continue
                first, offer = pending.pop(0)
                if reads:
                    self._stats.failovers += 1
                    log.info("peer.read_failover", peer=offer.peer, from_block=valid)
                reads += 1
                got = await self._read_from(offer, first, reservation, valid, deadline)
                if got > valid and self.on_read is not None:
                    # The whole fetch, lease round trip included: what a
                    # request waiting for it waits.
                    self.on_read(
                        offer.node_id,
                        (got - valid) * offer.block_bytes,
                        time.monotonic() - fetch_started,
                    )
                valid = got
        finally:
            # Standby offers never needed: given back.
            if pending:
                await asyncio.gather(*(self._release(o, deadline) for _, o in pending))
        return valid

    async def _read_from(
        self, offer: Offer, first: int, reservation: Reservation, valid: int, deadline: float
    ) -> int:
        """Read ``offer``'s blocks from reserved block ``valid`` on (the offer's
        block 0 is reserved block ``first``) and release its lease; the number
        of leading reserved blocks that hold good bytes afterwards. A lease
        that lapsed (or a holder that cannot say) discards this read."""
        end = min(reservation.num_blocks, first + offer.num_blocks)
        if end <= valid:
            await self._release(offer, deadline)
            return valid
        dram = self._store.dram
        local = [dram.slot_offset(s) for s in reservation.slots[valid:end]]
        part = dataclasses.replace(offer, offsets=offer.offsets[valid - first : end - first])
        try:
            num_read = await self._reader.read(part, local, self._left(deadline))
            num_read = min(max(num_read, 0), end - valid)
        except Exception as exc:
            log.warning("peer.read_failed", peer=offer.peer, error=repr(exc))
            num_read = 0
        if num_read < end - valid:
            log.warning("peer.read_short", peer=offer.peer, wanted=end - valid, read=num_read)
        if not await self._release(offer, deadline):
            if num_read:
                self._stats.lapsed += 1
                log.warning("peer.lease_lapsed_discarding", peer=offer.peer, blocks=num_read)
            return valid
        return valid + num_read

    async def _offers(
        self, want: list[BlockHash], holders: list[str], deadline: float
    ) -> tuple[list[Offer], int]:
        """The longest offer and a standby (the next longest, from another
        holder: a read that the first cannot finish goes on there), the others
        released; and how many holders failed."""
        ttl = self._timeout_s + _LEASE_MARGIN_S
        left = self._left(deadline)
        answers = await asyncio.gather(
            *(self._client.lookup(peer, want, ttl, left) for peer in holders),
            return_exceptions=True,
        )
        offers: list[Offer] = []
        num_errors = 0
        for peer, answer in zip(holders, answers, strict=True):
            if isinstance(answer, BaseException):
                num_errors += 1
                if not isinstance(answer, PeerError | TimeoutError):
                    log.error("peer.lookup_bug", peer=peer, error=repr(answer), exc_info=answer)
                else:
                    log.warning("peer.lookup_failed", peer=peer, error=str(answer))
                self._stats.lookup_errors += 1
                continue
            if answer is None:
                continue
            if answer.block_bytes != self._store.block_bytes or answer.num_blocks > len(want):
                log.warning(
                    "peer.offer_mismatch",
                    peer=peer,
                    block_bytes=answer.block_bytes,
                    num_blocks=answer.num_blocks,
                )
                self._stats.lookup_errors += 1
                num_errors += 1
                await self._release(answer, deadline)
                continue
            offers.append(answer)
        # Longest first; among equals, as the locator ranked the holders.
        offers.sort(key=lambda o: -o.num_blocks)
        kept, losers = offers[:_KEPT_OFFERS], offers[_KEPT_OFFERS:]
        if losers:
            await asyncio.gather(*(self._release(o, deadline) for o in losers))
        return kept, num_errors

    async def _release(self, offer: Offer, deadline: float) -> bool:
        """Give a lease back; whether it still held (False when the peer cannot say)."""
        try:
            # A lease is worth releasing even a little past the fetch's own
            # deadline: the holder gets its slots back sooner.
            return await self._client.release(offer, max(self._left(deadline), 1.0))
        except (PeerError, TimeoutError) as exc:
            log.warning("peer.release_failed", peer=offer.peer, error=str(exc))
            return False

    def _left(self, deadline: float) -> float:
        return max(0.001, deadline - asyncio.get_running_loop().time())

    # -- lifecycle ---------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        return self._tasks.spawn(coro, name)

    def _task_failed(self, exc: BaseException) -> None:
        self._stats.failed += 1

    async def close(self) -> None:
        """Refuse new fetches and wait for those in flight (each is bounded by its
        deadline), so no transfer writes into the store after this returns."""
        self._closing = True
        await self._tasks.wait()

    def stats(self) -> FetchStats:
        out = dataclasses.replace(self._stats)
        out.inflight = len(self._tasks)
        return out
