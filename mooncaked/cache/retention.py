"""What the store keeps on purpose: pins, their budget, their log records, their ends.

``Retention`` runs the pin table (``cache/pins.py``) against the tiers:

- ``pin`` pins the blocks this node holds (in DRAM, on the SSD, or on their
  way into either) and reports the others as missing; a pinned block DRAM
  holds and the SSD lacks is queued for an SSD write, so that the pin's block
  is there after a restart too.
- Every change of a pin moves the block to the eviction queue its pin says,
  in both tiers, and is written to the SSD tier's log (``PIN`` / ``UNPIN``
  records), which a compaction rewrites with one ``PIN`` per live pin. At
  start-up the SSD tier replays them into ``restore``: pins of blocks the SSD
  still has come back, those whose deadline passed meanwhile do not.
- A timer runs ``expire`` at the earliest deadline (no polling); an ended pin
  puts its block first in the unpinned eviction queue.

Everything runs on the event loop, like the pools it changes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import structlog

from mooncaked.cache.dram import DramPool
from mooncaked.cache.hashing import BlockHash
from mooncaked.cache.oplog import MAX_PIN_DEADLINE, PinEntry
from mooncaked.cache.pins import FOREVER, Pin, PinBudgetExceeded, PinKind, PinTable, check_ttl
from mooncaked.cache.ssd import SsdTier
from mooncaked.cache.ssd_writer import SsdWriter

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class PinResult:
    """What a pin did: the blocks now pinned, and those this node does not hold."""

    pinned: tuple[BlockHash, ...]
    missing: tuple[BlockHash, ...]


@dataclass(slots=True)
class PinStats:
    # Gauges, filled by stats().
    soft_blocks: int = 0
    hard_blocks: int = 0
    budget_blocks: int = 0
    max_pinned_ratio: float = 0.0
    pinned_bytes: int = 0
    budget_bytes: int = 0
    # Pinned blocks by where they are now (one may be in both tiers).
    in_dram: int = 0
    on_ssd: int = 0
    # Counters.
    pinned: int = 0
    unpinned: int = 0
    expired: int = 0
    refused_budget: int = 0
    restored: int = 0
    # Pins the SSD log held whose block was gone or whose time had run out.
    dropped_on_restore: int = 0
    log_failures: int = 0
    queued_ssd_writes: int = 0


def deadline_seconds(deadline: float) -> int:
    """A deadline as a PIN record stores it: whole seconds, rounded up; 0: forever."""
    if not math.isfinite(deadline):
        return 0
    return min(MAX_PIN_DEADLINE, max(1, math.ceil(deadline)))


class PinLog:
    """The pins as the SSD log's compaction writes them (a ``PinSource``)."""

    __slots__ = ("_pins",)

    def __init__(self, pins: PinTable) -> None:
        self._pins = pins

    def __len__(self) -> int:
        return len(self._pins)

    def entries(self) -> Iterable[PinEntry]:
        return [(h, int(p.kind), deadline_seconds(p.deadline)) for h, p in self._pins.items()]


class Retention:
    """The pins of one store and their effects on its tiers."""

    def __init__(
        self,
        pins: PinTable,
        dram: DramPool,
        ssd: SsdTier | None,
        ssd_writer: SsdWriter,
        *,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.pins = pins
        self._dram, self._ssd, self._ssd_writer = dram, ssd, ssd_writer
        self._wall_clock = wall_clock
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats = PinStats()

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        """Arm the expiry timer (restored pins may end soon)."""
        self._loop = asyncio.get_running_loop()
        self.expire()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._loop = None

    # -- the SSD log's replay ----------------------------------------------------

    def restore(self, replayed: dict[BlockHash, tuple[int, int]]) -> None:
        """Pins the SSD log held, for blocks the SSD has; ended ones are dropped."""
        now = self._wall_clock()
        kinds = {int(k) for k in PinKind}
        for h, (kind, deadline_s) in replayed.items():
            deadline = FOREVER if deadline_s == 0 else float(deadline_s)
            if kind not in kinds or deadline <= now:
                self._stats.dropped_on_restore += 1
                continue
            self.pins.restore(h, Pin(PinKind(kind), deadline))
            self._stats.restored += 1

    def replayed(self, num_in_log: int) -> None:
        """The SSD log held ``num_in_log`` pins: those not restored were for gone blocks."""
        self._stats.dropped_on_restore = num_in_log - self._stats.restored

    # -- pins --------------------------------------------------------------

    def held(self, block_hash: BlockHash) -> bool:
        """In DRAM or on the SSD, or on its way into either."""
        ssd = self._ssd
        return self._dram.has(block_hash) or (ssd is not None and ssd.has(block_hash))

    def pin(self, hashes: Sequence[BlockHash], *, ttl_s: float | None, hard: bool) -> PinResult:
        """Pin the held ones of ``hashes`` for ``ttl_s`` seconds (None: until
        unpinned, hard pins only). ValueError for a bad ttl_s;
        PinBudgetExceeded (a ValueError) when the budget would be passed."""
        check_ttl(ttl_s, hard)
        held = [h for h in dict.fromkeys(hashes) if self.held(h)]
        missing = tuple(h for h in dict.fromkeys(hashes) if not self.held(h))
        deadline = FOREVER if ttl_s is None else self._wall_clock() + ttl_s
        kind = PinKind.HARD if hard else PinKind.SOFT
        try:
            changed = self.pins.pin(held, kind, deadline)
        except PinBudgetExceeded:
            self._stats.refused_budget += 1
            raise
        for h, pin in changed:
            self._apply(h)
            if self._ssd is not None and not self._ssd.log_pin(
                h, int(pin.kind), deadline_seconds(pin.deadline)
            ):
                self._stats.log_failures += 1
            if self._dram.contains(h) and self._ssd_writer.wants(h):
                # The pin is meant to outlive the process: its block must be
                # on the SSD for the restart to find it.
                self._stats.queued_ssd_writes += self._ssd_writer.queue(h, None)
        self._stats.pinned += len(changed)
        self._schedule()
        return PinResult(tuple(held), missing)

    def unpin(self, hashes: Iterable[BlockHash]) -> int:
        """End the pins of ``hashes``; how many there were."""
        ended = self.pins.unpin(hashes)
        self._ended(ended)
        self._stats.unpinned += len(ended)
        return len(ended)

    def expire(self) -> int:
        """End the pins whose deadline passed, and arm the timer for the next."""
        ended = self.pins.expire(self._wall_clock())
        self._ended(ended)
        self._stats.expired += len(ended)
        if ended:
            log.info("store.pins_expired", blocks=len(ended))
        self._schedule()
        return len(ended)

    def clear(self) -> int:
        ended = self.pins.clear()
        self._ended(ended)
        self._schedule()
        return len(ended)

    def _ended(self, hashes: list[BlockHash]) -> None:
        for h in hashes:
            self._apply(h)
            if self._ssd is not None and not self._ssd.log_unpin(h):
                self._stats.log_failures += 1

    def _apply(self, block_hash: BlockHash) -> None:
        """Move the block to the eviction queue its pin says, in both tiers."""
        self._dram.requeue(block_hash)
        if self._ssd is not None:
            self._ssd.requeue(block_hash)

    def _schedule(self) -> None:
        loop = self._loop
        if loop is None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = self.pins.next_deadline()
        if deadline is None:
            return
        delay = max(0.0, deadline - self._wall_clock())
        self._timer = loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        try:
            self.expire()
        except Exception as exc:
            # A bug here must not leave pins that never end: log it, and
            # the next pin change arms the timer again.
            log.error("store.pin_expiry_failed", error=repr(exc), exc_info=exc)

    # -- stats -------------------------------------------------------------

    def stats(self, block_bytes: int) -> PinStats:
        s = self._stats
        pins = self.pins
        out = dataclasses.replace(s)
        out.soft_blocks = pins.count(PinKind.SOFT)
        out.hard_blocks = pins.count(PinKind.HARD)
        out.budget_blocks = pins.budget
        out.max_pinned_ratio = pins.budget_ratio
        out.pinned_bytes = len(pins) * block_bytes
        out.budget_bytes = pins.budget * block_bytes
        ssd = self._ssd
        hashes = [h for h, _ in pins.items()]
        out.in_dram = sum(1 for h in hashes if self._dram.contains(h))
        out.on_ssd = sum(1 for h in hashes if ssd is not None and ssd.contains(h))
        return out
