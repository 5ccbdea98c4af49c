"""The tiered store: lookup, load, offload and eviction across DRAM and SSD.

The engine asks the store, by chained block hash, for what its device pool
lacks:

- ``lookup(hashes)``: the longest cached prefix and the tier of each block.
- ``load(hashes, dst)``: copy that prefix into device blocks (or host rows).
  SSD blocks are read off the event loop into DRAM slots (promoted), then
  everything is copied to the destination in one scatter. Returns how many
  blocks it loaded: a block can vanish between lookup and load, and the
  caller computes the rest.
- ``offload(hashes, src)``: device -> DRAM in the background after a prefill
  or when a request finishes (``cache/offload.py``). The queue is bounded: a
  full queue drops the request (counted) and returns None, so the engine never
  waits on the cache. The returned future resolves once the source blocks have
  been copied: only then may the engine reuse them.

Blocks move down on their own: with ``ssd_write_through`` every block stored in
DRAM is also written to the SSD in the background, and a block evicted from
DRAM that the SSD lacks is copied out (demoted) before its slot is reused.
Both go through one bounded SSD write queue (``cache/ssd_writer.py``); a full
queue drops (and counts).

Sources and targets (``DeviceBlocks`` or host rows) and the copies between
them and DRAM slots are ``cache/buffers.py``'s; the counters are
``cache/stats.py``'s. This module re-exports the names its callers use.

Every tier change is reported to ``on_block_event(hash, tier, stored)`` (the
cluster-wide block index listens).

Leases: a local load leases the DRAM slots it copies from; peers lease slots
through ``dram.lease`` and read them at ``dram.slot_offset(slot)`` in
``dram.buffer``, and a lease that outlives ``lease_timeout_s`` is reclaimed.
A holder first ``promote``s SSD blocks so that a peer finds them in DRAM.

Fills from outside (a peer's blocks read into local DRAM by the transfer
engine): ``reserve`` takes PENDING slots, the bytes land in them, and
``commit_reserved`` publishes the ones that arrived (or ``abort_reserved``
gives them all back).

What the store keeps on purpose (``retention``, ``cache/retention.py``):
soft and hard pins within ``max_pinned_ratio`` of the DRAM tier, logged to
the SSD tier so that they survive a restart. Eviction respects them, and a
background task (``cache/watermark.py``) keeps DRAM usage under
``high_watermark``. ``remove`` drops blocks (and their pins) from both tiers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from mooncaked.cache.buffers import (
    BlockBuffer,
    DeviceBlocks,
    Source,
    check_buffer,
    copy_out,
)
from mooncaked.cache.dram import Clock, DramPool, Lease, physical_memory_bytes
from mooncaked.cache.hashing import BlockHash
from mooncaked.cache.layout import BlockLayout, gather_blocks, scatter_blocks
from mooncaked.cache.offload import Offloader
from mooncaked.cache.pins import PinTable
from mooncaked.cache.retention import PinLog, PinResult, PinStats, Retention
from mooncaked.cache.ssd import SsdTier
from mooncaked.cache.ssd_writer import NO_DEADLINE, SsdWriter
from mooncaked.cache.stats import StoreStats, TierStats
from mooncaked.cache.tiers import Tier
from mooncaked.cache.watermark import WatermarkEvictor
from mooncaked.config import StoreConfig
from mooncaked.tasks import TaskSet

log = structlog.get_logger(__name__)

__all__ = [
    "BlockEventListener",
    "BlockLayout",
    "DeviceBlocks",
    "Reservation",
    "StoreHit",
    "StoreStats",
    "Tier",
    "TierStats",
    "TieredStore",
    "gather_blocks",
    "scatter_blocks",
]


# (hash, tier, stored: True | removed: False)
BlockEventListener = Callable[[BlockHash, Tier, bool], None]


@dataclass(frozen=True, slots=True)
class StoreHit:
    """The longest cached prefix of a lookup: ``tiers[i]`` holds block ``i``."""

    tiers: tuple[Tier, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)

    def num_in(self, tier: Tier) -> int:
        return sum(1 for t in self.tiers if t is tier)


@dataclass(frozen=True, slots=True)
class Reservation:
    """PENDING DRAM slots for blocks being filled from outside the store.

    ``slots[i]`` receives ``hashes[i]`` at byte ``dram.slot_offset(slots[i])``
    of ``dram.buffer``.
    """

    hashes: tuple[BlockHash, ...]
    slots: tuple[int, ...]
    generation: int

    @property
    def num_blocks(self) -> int:
        return len(self.slots)


class TieredStore:
    """DRAM and SSD tiers of the KV block cache behind one facade."""

    def __init__(
        self,
        layout: BlockLayout,
        config: StoreConfig,
        *,
        clock: Clock = time.monotonic,
        on_block_event: BlockEventListener | None = None,
        pin_memory: bool | None = None,
        dram_backing: Any = None,
        on_failure: Callable[[BaseException], None] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``on_failure`` hears of a background worker (offload, SSD writer) that
        died: the store cannot offload or persist any more. ``wall_clock``
        times pins, which outlive the process."""
        self.layout = layout
        self.config = config
        self.block_bytes = layout.block_bytes
        self.on_block_event = on_block_event
        self._stats = StoreStats()
        num_slots = self.dram_slots_for(config, layout)
        pins = PinTable(math.floor(config.max_pinned_ratio * num_slots), config.max_pinned_ratio)
        self.dram = DramPool(
            layout,
            num_slots,
            clock=clock,
            pin_memory=pin_memory,
            backing=dram_backing,
            lease_timeout_s=config.lease_timeout_s,
            on_stored=self._dram_stored,
            on_removed=self._dram_removed,
            pin_of=pins.kind_of,
        )
        self.ssd: SsdTier | None = None
        if config.ssd_path:
            stride = SsdTier.stride_for(self.block_bytes)
            self.ssd = SsdTier(
                config.ssd_path,
                self.block_bytes,
                config.ssd_bytes // stride,
                layout_tag=layout.fingerprint(),
                io_threads=config.ssd_io_threads,
                verify_on_open=config.ssd_verify_on_start,
                on_stored=self._ssd_stored,
                on_removed=self._ssd_removed,
                on_failure=on_failure,
                pin_of=pins.kind_of,
                pins=PinLog(pins),
                restore_pins=lambda replayed: self.retention.restore(replayed),
            )
        self._ssd_writer = SsdWriter(self.dram, self.ssd, self._stats, config)
        self.retention = Retention(
            pins, self.dram, self.ssd, self._ssd_writer, wall_clock=wall_clock
        )
        self.watermark = WatermarkEvictor(
            self.dram, high=config.high_watermark, low=config.low_watermark
        )
        self._offloader = Offloader(
            self.dram, self._ssd_writer, self._stats, config.offload_queue, self._run_copy
        )
        self._tasks = TaskSet("store", on_failure=on_failure)
        self._workers: list[asyncio.Task[None]] = []
        self._copy_executor: ThreadPoolExecutor | None = None
        self._generation = 0
        self._started = False
        self._closing = False

    @staticmethod
    def dram_slots_for(config: StoreConfig, layout: BlockLayout) -> int:
        """DRAM slots the config gives blocks of ``layout``: what a ``dram_backing``
        must hold, times ``layout.block_bytes``."""
        dram_bytes = config.dram_bytes
        if dram_bytes == 0 and config.dram_fraction > 0:
            dram_bytes = int(config.dram_fraction * physical_memory_bytes())
        return dram_bytes // layout.block_bytes

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Open the SSD tier (replaying its log) and start the background workers."""
        if self._started:
            raise RuntimeError("TieredStore.start called twice")
        if self.ssd is not None:
            await self.ssd.open()
            self.retention.replayed(self.ssd.report.pins)
        self.retention.start()
        self._copy_executor = ThreadPoolExecutor(2, thread_name_prefix="store-copy")
        self._workers.append(self._spawn(self._offloader.serve(), "store-offload"))
        if self.ssd is not None:
            for i in range(max(1, self.config.ssd_io_threads // 2)):
                self._workers.append(self._spawn(self._ssd_writer.serve(), f"store-ssd-writer-{i}"))
        if self.watermark.enabled:
            self._spawn(self.watermark.serve(), "store-watermark")
        self._started = True
        log.info(
            "store.started",
            block_bytes=self.block_bytes,
            dram_slots=self.dram.num_slots,
            ssd_slots=self.ssd.num_slots if self.ssd else 0,
            ssd_blocks=self.ssd.num_blocks if self.ssd else 0,
        )

    async def close(self) -> None:
        """Finish queued offloads, write every queued block to the SSD, close it.

        Order: no new offloads; the offload worker drains its queue (that may
        queue SSD writes); the SSD writers drain theirs; in-flight loads and
        promotions end; the SSD log is appended and fsynced.
        """
        if not self._started or self._closing:
            return
        self._closing = True
        self.watermark.stop()
        self.retention.close()
        try:
            await self._offloader.stop_one()
            if self._workers:
                await self._workers[0]
            for _ in self._workers[1:]:
                await self._ssd_writer.stop_one()
            for task in self._workers[1:]:
                await task
        finally:
            # Loads and promotions in flight; a failed one was logged already.
            await self._tasks.wait()
            if self.ssd is not None:
                await self.ssd.close()
            if self._copy_executor is not None:
                self._copy_executor.shutdown(wait=True)
            self.dram.close()
            self._started = False
        log.info("store.closed")

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """A background task the store owns: kept, awaited on close, failure logged."""
        return self._tasks.spawn(coro, name)

    def _check_started(self) -> None:
        if not self._started or self._closing:
            raise RuntimeError("TieredStore is not running: await start() first (and not close())")

    # -- lookup ------------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash], *, record_stats: bool = True) -> StoreHit:
        """The longest prefix of ``hashes`` held in DRAM or on the SSD, and where.

        With ``record_stats`` the per-tier hit and miss counters move: a block
        counts as a DRAM miss when it is not in DRAM, and as an SSD miss when it
        is in neither tier or follows the end of the prefix. Peer and
        scheduler queries pass ``record_stats=False``.
        """
        hit = StoreHit(tuple(self._tiers_of_prefix(hashes)))
        if record_stats:
            num_dram = hit.num_in(Tier.DRAM)
            num_ssd = hit.num_in(Tier.SSD)
            self._stats.dram.hits += num_dram
            self._stats.dram.misses += len(hashes) - num_dram
            if self.ssd is not None:
                self._stats.ssd.hits += num_ssd
                self._stats.ssd.misses += len(hashes) - num_dram - num_ssd
        return hit

    def _tiers_of_prefix(self, hashes: Sequence[BlockHash]) -> list[Tier]:
        """The tier of each block of the longest prefix of ``hashes`` held here."""
        tiers: list[Tier] = []
        for h in hashes:
            if self.dram.contains(h):
                tiers.append(Tier.DRAM)
            elif self.ssd is not None and self.ssd.contains(h):
                tiers.append(Tier.SSD)
            else:
                break
        return tiers

    # -- load --------------------------------------------------------------

    async def load(
        self, hashes: Sequence[BlockHash], dst: BlockBuffer, *, owner: str = "local-load"
    ) -> int:
        """Copy the longest cached prefix of ``hashes`` into ``dst``; how many blocks.

        ``dst`` is device blocks (``block_ids[i]`` receives ``hashes[i]``) or a
        uint8 ``[n, block_bytes]`` tensor. Blocks found only on the SSD are read
        off the event loop and kept in DRAM too. Blocks past the returned count
        are untouched. If the caller is cancelled, ``dst`` is undefined.
        """
        self._check_started()
        check_buffer(dst, len(hashes), "dst", self.layout)
        if not hashes:
            return 0
        dram = self.dram
        # Decide every block's source in one step on the loop: nothing can
        # change between the checks and the leases.
        plan = self._tiers_of_prefix(hashes)
        if not plan:
            return 0
        leases: list[Lease] = []
        self._lease_in_dram(hashes, plan, owner, leases)
        try:
            sources = await self._promote_from_ssd(hashes, plan, leases, owner)
            n = len(sources)
            if n == 0:
                return 0
            await self._run_copy(copy_out, sources, dram, dst)
        finally:
            for lease in leases:
                dram.release(lease)
        num_dram = sum(1 for t, _ in sources if t is Tier.DRAM)
        num_ssd = n - num_dram
        self._stats.loads += 1
        self._stats.blocks_loaded += n
        self._stats.dram.bytes_read += num_dram * self.block_bytes
        self._stats.ssd.bytes_read += num_ssd * self.block_bytes
        return n

    async def _promote_from_ssd(
        self,
        hashes: Sequence[BlockHash],
        plan: list[Tier],
        leases: list[Lease],
        owner: str,
    ) -> list[Source]:
        """Read the plan's SSD blocks; each block's source: (tier it came from,
        DRAM slot or staging row). Cut at the first block that failed."""
        dram, ssd = self.dram, self.ssd
        dram_slots = iter(leases[0].slot_ids) if leases else iter(())
        # (index in hashes, hash, DRAM slot or None, buffer read into)
        reads: list[tuple[int, BlockHash, int | None, torch.Tensor]] = []
        sources: list[Source] = []
        for i, (h, tier) in enumerate(zip(hashes, plan, strict=False)):
            if tier is Tier.DRAM:
                sources.append((Tier.DRAM, next(dram_slots)))
                continue
            slot = None if dram.has(h) else dram.allocate(h)
            buf = (
                dram.slot(slot)
                if slot is not None
                else torch.empty(self.block_bytes, dtype=torch.uint8)
            )
            reads.append((i, h, slot, buf))
            # A promoted block is copied out of its DRAM slot (leased once
            # committed); the others out of their staging buffer.
            sources.append((Tier.SSD, slot if slot is not None else buf))
        if not reads or ssd is None:
            return sources

        async def read_all() -> list[bool | BaseException]:
            return await asyncio.gather(
                *(ssd.get(h, buf) for _, h, _, buf in reads), return_exceptions=True
            )

        task = self._spawn(read_all(), "store-ssd-promote")
        try:
            # Shielded: reads fill DRAM slots, which must be committed or
            # aborted only after every read has landed, even if we are cancelled.
            results = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: self._finish_promotion(reads, t.result(), None, ""))
            raise
        cut = self._finish_promotion(reads, results, leases, owner)
        return sources[:cut] if cut is not None else sources

    def _finish_promotion(
        self,
        reads: list[tuple[int, BlockHash, int | None, torch.Tensor]],
        results: list[bool | BaseException],
        leases: list[Lease] | None,
        owner: str,
    ) -> int | None:
        """Commit the DRAM slots read well, abort the rest; lease the committed ones
        into ``leases`` when given. The index of the first failed block, or None."""
        cut: int | None = None
        committed: list[BlockHash] = []
        for (i, h, slot, _), ok in zip(reads, results, strict=True):
            if isinstance(ok, BaseException):
                log.error("store.ssd_read_failed", block=h.hex(), error=repr(ok))
                ok = False
            if not ok and cut is None:
                cut = i
            if slot is None:
                continue
            if ok:
                self.dram.commit(slot)
                committed.append(h)
            else:
                self.dram.abort(slot)
        if leases is not None:
            self._lease_all(
                committed, owner, leases, "promoted DRAM blocks vanished before their lease"
            )
        return cut

    def _lease_in_dram(
        self, hashes: Sequence[BlockHash], plan: list[Tier], owner: str, leases: list[Lease]
    ) -> None:
        """Lease the blocks ``plan`` finds in DRAM into ``leases``."""
        dram_hashes = [h for h, t in zip(hashes, plan, strict=False) if t is Tier.DRAM]
        self._lease_all(
            dram_hashes, owner, leases, "DRAM blocks vanished between the check and the lease"
        )

    def _lease_all(
        self, hashes: list[BlockHash], owner: str, leases: list[Lease], vanished: str
    ) -> None:
        """Lease every one of ``hashes`` (all checked in DRAM, in this step on the
        loop) into ``leases``; RuntimeError ``vanished`` if one is not there."""
        if not hashes:
            return
        lease = self.dram.lease(hashes, owner, NO_DEADLINE)
        if lease is None or lease.num_blocks != len(hashes):
            raise RuntimeError(vanished)
        leases.append(lease)

    async def promote(self, hashes: Sequence[BlockHash], *, owner: str = "promote") -> int:
        """Read the SSD blocks of the cached prefix of ``hashes`` into DRAM; how
        many leading blocks of ``hashes`` are in DRAM afterwards.

        A holder calls this before it leases blocks to a peer, which can only
        read DRAM slots. Stops at the first block that found no DRAM slot or
        failed its read.
        """
        self._check_started()
        dram = self.dram
        plan = self._tiers_of_prefix(hashes)
        leases: list[Lease] = []
        if Tier.SSD in plan:
            # Leased while the SSD reads run, so allocating slots for them
            # cannot evict the DRAM blocks of the same prefix.
            self._lease_in_dram(hashes, plan, owner, leases)
            try:
                await self._promote_from_ssd(hashes, plan, leases, owner)
            finally:
                for lease in leases:
                    dram.release(lease)
        n = 0
        for h in hashes:
            if not dram.contains(h):
                break
            n += 1
        return n

    # -- fills from outside --------------------------------------------------

    def reserve(self, hashes: Sequence[BlockHash]) -> Reservation | None:
        """PENDING DRAM slots for the leading blocks of ``hashes``; None if not one.

        Stops at the first block DRAM already has (or is filling) and when no
        slot can be had. The caller fills the slots' bytes, then calls
        ``commit_reserved`` or ``abort_reserved`` exactly once.
        """
        self._check_started()
        slots: list[int] = []
        for h in hashes:
            if self.dram.has(h):
                break
            slot = self.dram.allocate(h)
            if slot is None:
                break
            slots.append(slot)
        if not slots:
            return None
        return Reservation(tuple(hashes[: len(slots)]), tuple(slots), self._generation)

    def commit_reserved(self, reservation: Reservation, num_filled: int) -> int:
        """Publish the first ``num_filled`` slots of a reservation and give back the
        rest; how many were published. Nothing is published if ``clear()`` ran
        since ``reserve``."""
        if not 0 <= num_filled <= reservation.num_blocks:
            raise ValueError(f"num_filled must be in 0..{reservation.num_blocks}, got {num_filled}")
        if reservation.generation != self._generation:
            num_filled = 0
        for i, slot in enumerate(reservation.slots):
            if i >= num_filled:
                self.dram.abort(slot)
                continue
            h = self.dram.commit(slot)
            self._stats.dram.bytes_written += self.block_bytes
            if not self._closing:
                self._ssd_writer.stored_in_dram(h)
        return num_filled

    def abort_reserved(self, reservation: Reservation) -> None:
        """Give back every slot of a reservation (its fill failed or was abandoned)."""
        self.commit_reserved(reservation, 0)

    # -- offload -----------------------------------------------------------

    def offload(self, hashes: Sequence[BlockHash], src: BlockBuffer) -> asyncio.Future[int] | None:
        """Queue a copy of blocks into DRAM; None when the queue is full (dropped).

        The future resolves to how many blocks were stored once ``src`` has been
        read: the caller keeps the source blocks unchanged until then. Blocks
        already cached are only marked as recently used.
        """
        self._check_started()
        check_buffer(src, len(hashes), "src", self.layout)
        return self._offloader.submit(hashes, src)

    async def _run_copy(self, fn: Callable[..., None], *args: Any) -> None:
        if self._copy_executor is None:
            raise RuntimeError("TieredStore is not running")
        await asyncio.get_running_loop().run_in_executor(self._copy_executor, fn, *args)

    # -- tier events -------------------------------------------------------

    def _dram_stored(self, block_hash: BlockHash) -> None:
        self._stats.dram.blocks_stored += 1
        if block_hash in self.retention.pins and self._ssd_writer.wants(block_hash):
            # A pinned block (pinned while on its way in) goes to the SSD too,
            # write-through or not: its pin must find it after a restart.
            self._ssd_writer.queue(block_hash, None)
        self.watermark.notice()
        self._emit(block_hash, Tier.DRAM, True)

    def _dram_removed(self, block_hash: BlockHash, slot: int, evicted: bool) -> None:
        self._stats.dram.blocks_removed += 1
        if evicted:
            self._stats.dram.evictions += 1
            self._ssd_writer.demote(block_hash, slot)
        self._emit(block_hash, Tier.DRAM, False)

    def _ssd_stored(self, block_hash: BlockHash) -> None:
        self._stats.ssd.blocks_stored += 1
        self._stats.ssd.bytes_written += self.block_bytes
        self._emit(block_hash, Tier.SSD, True)

    def _ssd_removed(self, block_hash: BlockHash, evicted: bool) -> None:
        self._stats.ssd.blocks_removed += 1
        if evicted:
            self._stats.ssd.evictions += 1
        self._emit(block_hash, Tier.SSD, False)

    def _emit(self, block_hash: BlockHash, tier: Tier, stored: bool) -> None:
        if self.on_block_event is None:
            return
        try:
            self.on_block_event(block_hash, tier, stored)
        except Exception as exc:
            # A listener's bug must not break the pools' bookkeeping mid-change.
            self._stats.event_listener_errors += 1
            log.error("store.block_event_listener_failed", error=repr(exc), exc_info=exc)

    # -- operations --------------------------------------------------------

    async def clear(self) -> int:
        """Drop every cached block in both tiers and every queued offload and SSD
        write; how many blocks were dropped. Offloads in flight store nothing."""
        self._check_started()
        self._generation += 1
        self._offloader.clear()
        self._ssd_writer.clear()
        self.retention.clear()
        removed = self.dram.clear()
        if self.ssd is not None:
            removed += await self.ssd.clear()
        log.info("store.cleared", blocks=removed)
        return removed

    def stats(self) -> StoreStats:
        """A snapshot of the counters, with the gauges filled in."""
        s = self._stats
        out = dataclasses.replace(
            s, dram=dataclasses.replace(s.dram), ssd=dataclasses.replace(s.ssd)
        )
        out.dram.used_blocks = self.dram.num_cached
        out.dram.capacity_blocks = self.dram.num_slots
        out.dram.block_bytes = self.block_bytes
        out.dram_leases = self.dram.num_leases
        out.dram_expired_leases = self.dram.num_expired_leases
        out.watermark_runs = self.watermark.stats.runs
        out.watermark_evictions = self.watermark.stats.evictions
        if self.ssd is not None:
            out.ssd.used_blocks = self.ssd.num_blocks
            out.ssd.capacity_blocks = self.ssd.num_slots
            out.ssd.block_bytes = self.block_bytes
            out.ssd_corrupt_dropped = self.ssd.num_corrupt
            out.ssd_io_errors = self.ssd.num_io_errors
        return out

    # -- retention -----------------------------------------------------------

    def pin(self, hashes: Sequence[BlockHash], *, ttl_s: float | None, hard: bool) -> PinResult:
        """Pin the blocks of ``hashes`` this node holds (``Retention.pin``)."""
        self._check_started()
        return self.retention.pin(hashes, ttl_s=ttl_s, hard=hard)

    def unpin(self, hashes: Sequence[BlockHash]) -> int:
        return self.retention.unpin(hashes)

    def pin_stats(self) -> PinStats:
        return self.retention.stats(self.block_bytes)

    def remove(self, hashes: Sequence[BlockHash]) -> int:
        """Drop blocks (and their pins) from both tiers; how many blocks this
        node held. A block leased to a reader stays readable until its lease
        ends, as with ``clear``."""
        self._check_started()
        self.retention.unpin(hashes)
        self._ssd_writer.forget(hashes)
        removed = 0
        for h in dict.fromkeys(hashes):
            held = self.dram.remove(h)
            if self.ssd is not None:
                held = self.ssd.remove(h) or held
            removed += held
        return removed

    def tiers_of(self, block_hash: BlockHash) -> tuple[Tier, ...]:
        """The tiers that hold a block now (DRAM first)."""
        tiers = [Tier.DRAM] if self.dram.contains(block_hash) else []
        if self.ssd is not None and self.ssd.contains(block_hash):
            tiers.append(Tier.SSD)
        return tuple(tiers)

    def check_integrity(self) -> None:
        """Raise RuntimeError if a tier's bookkeeping disagrees with itself."""
        self.dram.check_integrity()
        if self.ssd is not None:
            self.ssd.check_integrity()
        self._ssd_writer.check_integrity()

    async def flush(self) -> None:
        """Wait until every queued offload is in DRAM and every queued SSD write is
        on the SSD (in its log, not yet fsynced: ``ssd.sync()`` does that)."""
        self._check_started()
        # Offloads first: they queue SSD writes.
        await self._offloader.join()
        await self._ssd_writer.join()
