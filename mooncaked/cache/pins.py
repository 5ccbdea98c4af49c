"""Pins: blocks the store keeps through eviction, by hash, within a budget.

- A **soft** pin has a time to live; its block is evicted last, only when
  nothing unpinned is left to evict (``DramPool`` and the SSD slab keep soft
  pinned blocks in an LRU queue of their own, asked after the unpinned one).
- A **hard** pin (with or without a time to live) is never evicted while it
  lasts: its block sits in no eviction queue at all.

Pins are keyed by block hash, not by slot, so one pin covers the block in
every tier it is in (DRAM and SSD), and survives its moves between them.
Pinning a hash again merges the two: hard wins over soft and the later
deadline wins, so a retention a request asks for never weakens an
operator's hard pin; ``unpin`` ends the pin whatever its kind.

The budget (``store.max_pinned_ratio`` of the DRAM tier's slots) counts every
pinned hash, soft or hard, in whichever tier its block lives: a pin that
would pass it is refused as a whole with ``PinBudgetExceeded``.

Deadlines are wall-clock seconds (``time.time``), not monotonic: pins are
logged to the SSD tier and outlive the process, and a monotonic clock means
nothing to the next one. The table is plain data with no I/O and no clock
of its own: the store moves the eviction queues and writes the log when a
pin changes, and runs ``expire`` at the earliest deadline.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from mooncaked.cache.hashing import BlockHash

# A pin's deadline when it lasts until unpinned.
FOREVER = math.inf
# Longest time to live one pin may ask for (a year): a deadline stays well
# inside what the SSD log's record stores.
MAX_TTL_S = 365 * 24 * 3600.0


class PinKind(enum.IntEnum):
    """Ordered: a stronger pin compares greater (merging keeps the max)."""

    SOFT = 1
    HARD = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(slots=True)
class Pin:
    kind: PinKind
    # Wall-clock seconds; FOREVER: until unpinned.
    deadline: float


class PinBudgetExceeded(ValueError):
    """A pin that would take more blocks than ``store.max_pinned_ratio`` allows."""


def check_ttl(ttl_s: float | None, hard: bool) -> None:
    """ValueError naming a bad ``ttl_s``: a soft pin needs one, any must be in range."""
    if ttl_s is None:
        if not hard:
            raise ValueError("a soft pin needs ttl_s (seconds); only a hard pin may last forever")
        return
    if isinstance(ttl_s, bool) or not 0.0 < ttl_s <= MAX_TTL_S:
        raise ValueError(f"ttl_s must be in (0, {MAX_TTL_S:.0f}] seconds, got {ttl_s!r}")


class PinTable:
    """Pinned hashes, their kinds and deadlines, and the budget they share."""

    __slots__ = ("_heap", "_pins", "budget", "budget_ratio")

    def __init__(self, budget: int, budget_ratio: float) -> None:
        """``budget``: most pinned hashes at once; ``budget_ratio`` is the config
        value it came from, named by a refusal."""
        if budget < 0:
            raise ValueError(f"pin budget must be >= 0 blocks, got {budget}")
        self.budget = budget
        self.budget_ratio = budget_ratio
        self._pins: dict[BlockHash, Pin] = {}
        # (deadline, hash) of every pin that ends; stale entries (a pin merged
        # to a later deadline, or ended) are skipped when popped.
        self._heap: list[tuple[float, BlockHash]] = []

    # -- queries -----------------------------------------------------------

    def kind_of(self, block_hash: BlockHash) -> PinKind | None:
        """The pin of a hash (None: unpinned): what the eviction queues ask."""
        pin = self._pins.get(block_hash)
        return None if pin is None else pin.kind

    def get(self, block_hash: BlockHash) -> Pin | None:
        return self._pins.get(block_hash)

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._pins

    def items(self) -> list[tuple[BlockHash, Pin]]:
        return list(self._pins.items())

    def count(self, kind: PinKind) -> int:
        return sum(1 for p in self._pins.values() if p.kind is kind)

    def next_deadline(self) -> float | None:
        """The earliest deadline of a live pin; None when none ends."""
        heap = self._heap
        while heap:
            deadline, h = heap[0]
            pin = self._pins.get(h)
            if pin is not None and pin.deadline == deadline:
                return deadline
            heapq.heappop(heap)
        return None

    # -- changes -----------------------------------------------------------

    def pin(
        self, hashes: Sequence[BlockHash], kind: PinKind, deadline: float
    ) -> list[tuple[BlockHash, Pin]]:
        """Pin ``hashes`` (merged with pins they have); the pins that changed.

        Raises PinBudgetExceeded, pinning nothing, when the hashes not pinned
        yet would take the table past its budget.
        """
        new = {h for h in hashes if h not in self._pins}
        if len(self._pins) + len(new) > self.budget:
            raise PinBudgetExceeded(
                f"pinning {len(new)} more block(s) would pin {len(self._pins) + len(new)}, "
                f"over the budget of {self.budget} blocks (store.max_pinned_ratio = "
                f"{self.budget_ratio:g} of the DRAM tier; {len(self._pins)} pinned now); "
                "unpin some or raise store.max_pinned_ratio"
            )
        changed: list[tuple[BlockHash, Pin]] = []
        for h in dict.fromkeys(hashes):
            old = self._pins.get(h)
            if old is None:
                pin = Pin(kind, deadline)
            else:
                pin = Pin(max(old.kind, kind), max(old.deadline, deadline))
                if (pin.kind, pin.deadline) == (old.kind, old.deadline):
                    continue
            self._set(h, pin)
            changed.append((h, pin))
        return changed

    def restore(self, block_hash: BlockHash, pin: Pin) -> None:
        """A pin read back from the SSD log at start-up; the budget is not
        checked (it held when the pin was made, and dropping pins the user
        was told of would be worse than running over for a while)."""
        self._set(block_hash, pin)

    def unpin(self, hashes: Iterable[BlockHash]) -> list[BlockHash]:
        """End the pins of ``hashes``; those that were pinned."""
        ended = [h for h in dict.fromkeys(hashes) if self._pins.pop(h, None) is not None]
        return ended

    def expire(self, now: float) -> list[BlockHash]:
        """End every pin whose deadline is ``now`` or earlier; their hashes."""
        ended: list[BlockHash] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, h = heapq.heappop(heap)
            pin = self._pins.get(h)
            if pin is not None and pin.deadline == deadline:
                del self._pins[h]
                ended.append(h)
        return ended

    def clear(self) -> list[BlockHash]:
        hashes = list(self._pins)
        self._pins.clear()
        self._heap.clear()
        return hashes

    def _set(self, block_hash: BlockHash, pin: Pin) -> None:
        self._pins[block_hash] = pin
        if math.isfinite(pin.deadline):
            heapq.heappush(self._heap, (pin.deadline, block_hash))


# Which pin holds a block, if any (what a tier's eviction order asks).
PinOf = Callable[[BlockHash], "PinKind | None"]


def unpinned(block_hash: BlockHash) -> PinKind | None:
    """The ``PinOf`` of a tier nothing pins."""
    return None


class PinQueues:
    """A tier's eviction order under pins: blocks it may evict now, unpinned
    ones least recently used first (``unpinned``), then soft-pinned ones
    (``soft``), evicted only once no unpinned one is left; hard-pinned blocks
    are in neither, never evicted. The tier decides which of its blocks may
    be evicted at all (none that a reader holds) and keeps them queued here."""

    __slots__ = ("_pin_of", "soft", "unpinned")

    def __init__(self, pin_of: PinOf | None = None) -> None:
        self._pin_of: PinOf = pin_of if pin_of is not None else unpinned
        self.unpinned: OrderedDict[BlockHash, None] = OrderedDict()
        self.soft: OrderedDict[BlockHash, None] = OrderedDict()

    def pin_of(self, block_hash: BlockHash) -> PinKind | None:
        return self._pin_of(block_hash)

    def queue_for(self, block_hash: BlockHash) -> OrderedDict[BlockHash, None] | None:
        """The queue its pin puts a block in; None: no eviction takes it."""
        kind = self._pin_of(block_hash)
        if kind is None:
            return self.unpinned
        return self.soft if kind is PinKind.SOFT else None

    def enqueue(self, block_hash: BlockHash) -> None:
        """A block the tier may evict joins its queue, most recently used."""
        queue = self.queue_for(block_hash)
        if queue is not None:
            queue[block_hash] = None

    def dequeue(self, block_hash: BlockHash) -> None:
        self.unpinned.pop(block_hash, None)
        self.soft.pop(block_hash, None)

    def requeue(self, block_hash: BlockHash) -> None:
        """Its pin changed: into the queue its pin says. A block whose pin
        ended goes first among the unpinned (its retention is over); a newly
        soft-pinned one last among the soft-pinned."""
        self.dequeue(block_hash)
        queue = self.queue_for(block_hash)
        if queue is None:
            return
        queue[block_hash] = None
        if queue is self.unpinned:
            queue.move_to_end(block_hash, last=False)

    def oldest(self) -> BlockHash | None:
        """The next to evict: the least recently used unpinned, else soft-pinned."""
        queue = self.unpinned or self.soft
        return next(iter(queue)) if queue else None

    def __len__(self) -> int:
        return len(self.unpinned) + len(self.soft)
