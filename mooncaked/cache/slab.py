"""The SSD slab's bookkeeping: which slot holds which block, and in what state.

Each slot is FREE, WRITING (a put's bytes on their way), LIVE (indexed by its
hash, with the data CRC its PUT record carries) or DEAD (removed while reads
were in flight; freed when the last one ends). A live slot nobody reads is in
an LRU queue chosen by its block's pin (``cache/pins.py``): unpinned blocks
in the first, soft-pinned ones in a second asked only when the first is
empty, hard-pinned ones in none; a slot being read is in none either, so it
is never evicted or reused under its reader.

No I/O and no log: the tier (``cache/ssd.py``) moves slots through these
states and writes the record of each change itself.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict

from mooncaked.cache.hashing import BlockHash
from mooncaked.cache.pins import PinOf, PinQueues

# The pin of a hash (None: unpinned), as the store's pin table holds it.


class SlotState(enum.Enum):
    FREE = "free"
    WRITING = "writing"
    LIVE = "live"
    # Removed while reads were in flight; freed when the last one ends.
    DEAD = "dead"


class SlabIndex:
    """Slots of one slab: states, hashes, data CRCs, readers, free list, LRU order."""

    __slots__ = (
        "_free",
        "_index",
        "_lru",
        "_num_dead",
        "_pin_of",
        "_queues",
        "_readers",
        "_slot_crc",
        "_slot_hash",
        "_soft",
        "_state",
        "_writing",
    )

    def __init__(self, num_slots: int, pin_of: PinOf | None = None) -> None:
        """``pin_of`` says which blocks are pinned against eviction; whoever
        changes a pin calls ``requeue`` for its block."""
        # Live blocks not being read, by eviction order (unpinned, soft-pinned).
        self._queues = PinQueues(pin_of)
        self._pin_of = self._queues.pin_of
        self._state = [SlotState.FREE] * num_slots
        self._slot_hash: list[BlockHash | None] = [None] * num_slots
        self._slot_crc = [0] * num_slots
        self._readers = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._index: dict[BlockHash, int] = {}
        self._writing: dict[BlockHash, int] = {}
        self._lru = self._queues.unpinned
        self._soft = self._queues.soft
        self._num_dead = 0

    # -- queries -----------------------------------------------------------

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def has(self, block_hash: BlockHash) -> bool:
        """Stored or being written: a put of it would be redundant."""
        return block_hash in self._index or block_hash in self._writing

    def slot_of(self, block_hash: BlockHash) -> int | None:
        return self._index.get(block_hash)

    def blocks(self) -> list[BlockHash]:
        """Every stored block, in the order it was indexed."""
        return list(self._index)

    def hashes(self) -> list[BlockHash]:
        """Every stored block in eviction order: unpinned least recently used
        first, then soft-pinned, then those no eviction takes (being read,
        hard-pinned)."""
        queued = self._lru.keys() | self._soft.keys()
        kept = [h for h in self._index if h not in queued]
        return [*self._lru, *self._soft, *kept]

    def live_entries(self) -> list[tuple[int, BlockHash, int]]:
        """(slot, hash, data crc) of every stored block, in ``hashes()`` order."""
        out = []
        for h in self.hashes():
            slot = self._index[h]
            out.append((slot, h, self._slot_crc[slot]))
        return out

    def __len__(self) -> int:
        """How many blocks are stored."""
        return len(self._index)

    @property
    def num_free(self) -> int:
        return len(self._free)

    # -- changes -----------------------------------------------------------

    def load(self, index: dict[BlockHash, int], slot_crc: dict[int, int]) -> None:
        """Index what a replayed log holds (``index`` least recent first)."""
        for block_hash, slot in index.items():
            self._state[slot] = SlotState.LIVE
            self._slot_hash[slot] = block_hash
            self._slot_crc[slot] = slot_crc[slot]
            self._index[block_hash] = slot
            self._enqueue(block_hash)
        used = set(index.values())
        self._free = [s for s in range(len(self._state) - 1, -1, -1) if s not in used]

    def take_free(self) -> int | None:
        return self._free.pop() if self._free else None

    def _free_slot(self, slot: int) -> None:
        self._state[slot] = SlotState.FREE
        self._slot_hash[slot] = None
        self._slot_crc[slot] = 0
        self._free.append(slot)

    def victim(self) -> int | None:
        """The slot of the least recently used unpinned block nobody reads, else
        of such a soft-pinned one; None if every block is read or hard-pinned."""
        queue = self._lru or self._soft
        if not queue:
            return None
        return self._index[next(iter(queue))]

    def requeue(self, block_hash: BlockHash) -> None:
        """The pin of ``block_hash`` changed: move it to the queue its pin says."""
        slot = self._index.get(block_hash)
        if slot is not None and self._readers[slot] == 0:
            self._queues.requeue(block_hash)

    def _queue_for(self, block_hash: BlockHash) -> OrderedDict[BlockHash, None] | None:
        return self._queues.queue_for(block_hash)

    def _enqueue(self, block_hash: BlockHash) -> None:
        self._queues.enqueue(block_hash)

    def _dequeue(self, block_hash: BlockHash) -> None:
        self._queues.dequeue(block_hash)

    def begin_write(self, slot: int, block_hash: BlockHash) -> None:
        self._state[slot] = SlotState.WRITING
        self._slot_hash[slot] = block_hash
        self._writing[block_hash] = slot

    def abandon_write(self, slot: int, block_hash: BlockHash) -> None:
        del self._writing[block_hash]
        self._free_slot(slot)

    def publish(self, slot: int, block_hash: BlockHash, crc: int) -> None:
        """A written slot becomes the block's, most recently used."""
        del self._writing[block_hash]
        self._state[slot] = SlotState.LIVE
        self._slot_crc[slot] = crc
        self._index[block_hash] = slot
        self._enqueue(block_hash)

    def begin_read(self, slot: int, block_hash: BlockHash) -> int:
        """Take a live slot out of the LRU queue for a reader; its data CRC."""
        if self._readers[slot] == 0:
            self._dequeue(block_hash)
        self._readers[slot] += 1
        return self._slot_crc[slot]

    def end_read(self, slot: int) -> None:
        self._readers[slot] -= 1
        if self._readers[slot] < 0:
            raise RuntimeError(f"SSD slot {slot} reader count went negative")
        if self._readers[slot] > 0:
            return
        state = self._state[slot]
        if state is SlotState.LIVE:
            h = self._slot_hash[slot]
            if h is None:
                raise RuntimeError(f"live SSD slot {slot} has no hash")
            self._enqueue(h)  # most recently used
        elif state is SlotState.DEAD:
            self._num_dead -= 1
            self._free_slot(slot)

    def unindex(self, slot: int) -> BlockHash:
        """Drop a live slot's block from the index (the slot is freed, or dead
        until its readers end); the block's hash."""
        block_hash = self._slot_hash[slot]
        if block_hash is None or self._state[slot] is not SlotState.LIVE:
            raise RuntimeError(f"unindex of SSD slot {slot} in state {self._state[slot].value}")
        del self._index[block_hash]
        self._dequeue(block_hash)
        if self._readers[slot] > 0:
            self._state[slot] = SlotState.DEAD
            self._num_dead += 1
        else:
            self._free_slot(slot)
        return block_hash

    # -- self-check ----------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError if the bookkeeping disagrees with itself."""
        counts = Counter(self._state)
        problems: list[str] = []
        if counts[SlotState.FREE] != len(self._free) or len(set(self._free)) != len(self._free):
            problems.append(f"{counts[SlotState.FREE]} free slots, free list {len(self._free)}")
        if counts[SlotState.LIVE] != len(self._index):
            problems.append(f"{counts[SlotState.LIVE]} live slots, index {len(self._index)}")
        if counts[SlotState.WRITING] != len(self._writing):
            problems.append(f"{counts[SlotState.WRITING]} writing slots, {len(self._writing)}")
        if counts[SlotState.DEAD] != self._num_dead:
            problems.append(f"{counts[SlotState.DEAD]} dead slots, counter {self._num_dead}")
        for h, slot in self._index.items():
            if self._slot_hash[slot] != h or self._state[slot] is not SlotState.LIVE:
                problems.append(f"index entry {h.hex()} -> slot {slot} is stale")
            want = self._queue_for(h) if self._readers[slot] == 0 else None
            for queue, name in ((self._lru, "unpinned"), (self._soft, "soft-pinned")):
                if (h in queue) != (queue is want):
                    problems.append(
                        f"slot {slot}: readers {self._readers[slot]}, pin {self._pin_of(h)}, "
                        f"vs the {name} LRU queue"
                    )
        for slot in self._free:
            if self._readers[slot]:
                problems.append(f"free slot {slot} has readers")
        if problems:
            raise RuntimeError("SSD tier integrity: " + "; ".join(problems))
