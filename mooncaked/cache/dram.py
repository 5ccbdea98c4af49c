"""The DRAM tier: one preallocated host pool of fixed-size block slots.

A slot holds one block in the layout of ``cache/layout.py`` (every layer's K
and V for ``block_size`` tokens), so one slot is one contiguous byte range
that a peer can read at ``slot * block_bytes``.

The pool knows hashes, slots and leases; it never does I/O. Every method runs
on the owner's thread (the event loop); only the bytes inside a slot are
touched from worker threads, and only while the slot is ``PENDING`` (being
filled) or leased (being read). Slot states:

- ``FREE``: on the free list, holds nothing.
- ``PENDING``: reserved by ``allocate`` for one hash and being filled; not
  visible to lookups, never evicted. ``commit`` publishes it, ``abort`` frees it.
- ``CACHED``: visible under its hash. With no lease it sits in an eviction
  queue in LRU order (least recently used first), chosen by its pin
  (``cache/pins.py``): unpinned blocks in the first queue, soft-pinned ones in
  a second that is asked only when the first is empty; a hard-pinned block is
  in none. With leases it is out of every queue, so it can be neither evicted
  nor overwritten.
- ``DEAD``: removed while leased; the hash is already gone from the index and
  the slot goes back to the free list when its last lease ends.

Invariant (``check_integrity``): free + pending + cached + dead == num_slots.

Leases have an owner and a deadline (from the injected clock) so a reader that
died cannot pin a slot forever: ``allocate`` reaps expired leases when it finds
no other slot. ``release`` tells the reader whether its lease still held: a
False means the slot may have been reused under it and what it read must be
discarded.
"""

from __future__ import annotations

import enum
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from mooncaked.cache.hashing import BlockHash
from mooncaked.cache.layout import BlockLayout, KVCaches, gather_blocks, scatter_blocks
from mooncaked.cache.pins import PinOf, PinQueues

log = structlog.get_logger(__name__)

Clock = Callable[[], float]
# (hash) when a block becomes visible in the pool.
StoredListener = Callable[[BlockHash], None]
# (hash, slot, evicted) when a block leaves the index; the slot's bytes are
# still intact during the call (it is reused only after the call returns).
RemovedListener = Callable[[BlockHash, int, bool], None]
# The pin of a hash (None: unpinned), as the store's pin table holds it.

# The layout's names, for callers that import them from here.
__all__ = [
    "BlockLayout",
    "Clock",
    "DramPool",
    "KVCaches",
    "Lease",
    "PinOf",
    "SlotState",
    "gather_blocks",
    "physical_memory_bytes",
    "pop_expired",
    "scatter_blocks",
]


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class SlotState(enum.Enum):
    FREE = "free"
    PENDING = "pending"
    CACHED = "cached"
    DEAD = "dead"


@dataclass(slots=True)
class Lease:
    """Slots a reader may read until it releases the lease or the deadline passes."""

    lease_id: int
    owner: str
    hashes: tuple[BlockHash, ...]
    slot_ids: tuple[int, ...]
    deadline: float

    @property
    def num_blocks(self) -> int:
        return len(self.slot_ids)


def pop_expired(leases: dict[int, Lease], now: float) -> list[Lease]:
    """Take the leases whose deadline passed out of ``leases`` (by lease id)."""
    expired = [lease for lease in leases.values() if lease.deadline < now]
    for lease in expired:
        del leases[lease.lease_id]
    return expired


class DramPool:
    """Fixed-size block slots in one host buffer; hash -> slot, LRU, leases.

    ``backing``: memory to lay the slots in, e.g. a shared mapping (memfd) that
    the transfer engine registers so peers on the same host read slots without
    a socket. By default the pool allocates its own buffer, pinned when CUDA
    is present (``pin_memory=None``), so copies to and from the GPU are DMA.
    (Page-locked memory; the pins of blocks against eviction are ``pin_of``.)
    """

    def __init__(
        self,
        layout: BlockLayout,
        num_slots: int,
        *,
        clock: Clock = time.monotonic,
        pin_memory: bool | None = None,
        backing: Any = None,
        lease_timeout_s: float = 30.0,
        on_stored: StoredListener | None = None,
        on_removed: RemovedListener | None = None,
        pin_of: PinOf | None = None,
    ) -> None:
        """``pin_of`` says which blocks are pinned against eviction; whoever
        changes a pin calls ``requeue`` for its block."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        if lease_timeout_s <= 0:
            raise ValueError(f"lease_timeout_s must be > 0, got {lease_timeout_s}")
        self.layout = layout
        self.block_bytes = layout.block_bytes
        self.num_slots = num_slots
        self.lease_timeout_s = lease_timeout_s
        self._clock = clock
        self.on_stored = on_stored
        self.on_removed = on_removed
        # Cached, unleased blocks by eviction order (unpinned, soft-pinned).
        self._queues = PinQueues(pin_of)
        self._pin_of = self._queues.pin_of
        self._registered = False
        self.buffer = self._allocate_buffer(pin_memory, backing)
        # [num_slots, block_bytes]: row i is slot i, at byte offset i * block_bytes.
        self.slots = self.buffer.view(num_slots, self.block_bytes)

        self._state = [SlotState.FREE] * num_slots
        self._slot_hash: list[BlockHash | None] = [None] * num_slots
        self._num_leases = [0] * num_slots
        # Popped from the end: slot 0 is handed out first.
        self._free = list(range(num_slots - 1, -1, -1))
        self._cached: dict[BlockHash, int] = {}
        self._pending: dict[BlockHash, int] = {}
        self._evictable = self._queues.unpinned
        self._soft = self._queues.soft
        self._leases: dict[int, Lease] = {}
        self._next_lease_id = 1
        self.num_dead = 0
        self.num_evictions = 0
        self.num_expired_leases = 0

    def _allocate_buffer(self, pin_memory: bool | None, backing: Any) -> torch.Tensor:
        size = self.num_slots * self.block_bytes
        cuda = torch.cuda.is_available()
        pin = cuda if pin_memory is None else pin_memory
        if pin and not cuda:
            raise ValueError("pin_memory=True needs CUDA; pass None to pin only when it is present")
        if backing is None or size == 0:
            return torch.empty(size, dtype=torch.uint8, pin_memory=pin and size > 0)
        view = memoryview(backing)
        if view.readonly or not view.c_contiguous:
            raise ValueError("the DRAM pool's backing must be writable, contiguous memory")
        if view.nbytes < size:
            raise ValueError(
                f"the DRAM pool's backing has {view.nbytes} bytes; "
                f"{self.num_slots} slots of {self.block_bytes} need {size}"
            )
        buf = torch.frombuffer(view.cast("B"), dtype=torch.uint8, count=size)
        if pin:
            # Page-locks memory allocated elsewhere, so copies to and from the
            # GPU run as DMA like those of a pinned tensor.
            rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), size, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of the DRAM pool failed with {rc}")
            self._registered = True
        return buf

    def close(self) -> None:
        """Let go of the buffer (unregistering a page-locked backing); the pool is
        unusable afterwards."""
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self._registered = False
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.slots = self.buffer.view(0, self.block_bytes)

    # -- queries ---------------------------------------------------------

    def slot_offset(self, slot: int) -> int:
        """Byte offset of ``slot`` in ``buffer``: what a peer addresses."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        return slot * self.block_bytes

    def slot(self, slot: int) -> torch.Tensor:
        return self.slots[slot]

    def get_slot(self, block_hash: BlockHash) -> int | None:
        """The slot of a visible block; no LRU update."""
        return self._cached.get(block_hash)

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cached

    def has(self, block_hash: BlockHash) -> bool:
        """Visible or being filled: an offload of it would be redundant."""
        return block_hash in self._cached or block_hash in self._pending

    def hash_of(self, slot: int) -> BlockHash | None:
        return self._slot_hash[slot]

    def cached_hashes(self) -> list[BlockHash]:
        """Visible blocks in eviction order: unpinned ones least recently used
        first, then soft-pinned ones, then those no eviction takes (leased or
        hard-pinned)."""
        queued = self._evictable.keys() | self._soft.keys()
        kept = [h for h in self._cached if h not in queued]
        return [*self._evictable, *self._soft, *kept]

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Slots that hold or are filling a block (or are dead): not free."""
        return self.num_slots - len(self._free)

    @property
    def num_evictable(self) -> int:
        """Blocks an eviction may take now: unleased, unpinned or soft-pinned."""
        return len(self._evictable) + len(self._soft)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_leased_slots(self) -> int:
        return sum(1 for n in self._num_leases if n > 0)

    # -- filling slots -----------------------------------------------------

    def can_allocate(self) -> bool:
        return bool(self._free) or bool(self.num_evictable) or self._any_expired()

    def allocate(self, block_hash: BlockHash) -> int | None:
        """Reserve a slot for ``block_hash`` (PENDING); None when every slot is busy.

        Evicts the least recently used unleased block when no slot is free; the
        ``on_removed`` listener sees it (evicted=True) while its bytes are intact.
        """
        if block_hash in self._cached or block_hash in self._pending:
            raise ValueError(f"block {block_hash.hex()} is already in the pool; check has() first")
        slot = self._take_slot()
        if slot is None:
            return None
        self._state[slot] = SlotState.PENDING
        self._slot_hash[slot] = block_hash
        self._pending[block_hash] = slot
        return slot

    def commit(self, slot: int) -> BlockHash:
        """Publish a PENDING slot whose bytes are now in place; it becomes most recent."""
        if self._state[slot] is not SlotState.PENDING:
            raise RuntimeError(f"commit of slot {slot} in state {self._state[slot].value}")
        block_hash = self._slot_hash[slot]
        if block_hash is None:
            raise RuntimeError(f"pending slot {slot} has no hash")
        del self._pending[block_hash]
        self._state[slot] = SlotState.CACHED
        self._cached[block_hash] = slot
        self._enqueue(block_hash)
        if self.on_stored is not None:
            self.on_stored(block_hash)
        return block_hash

    def abort(self, slot: int) -> None:
        """Give back a PENDING slot whose fill failed or was abandoned."""
        if self._state[slot] is not SlotState.PENDING:
            raise RuntimeError(f"abort of slot {slot} in state {self._state[slot].value}")
        block_hash = self._slot_hash[slot]
        if block_hash is not None:
            del self._pending[block_hash]
        self._free_slot(slot)

    def touch(self, hashes: Sequence[BlockHash]) -> None:
        """Mark blocks as just used (most recent last, so pass them in order)."""
        for h in hashes:
            for queue in (self._evictable, self._soft):
                if h in queue:
                    queue.move_to_end(h)

    # -- leases ------------------------------------------------------------

    def lease(
        self, hashes: Sequence[BlockHash], owner: str, ttl_s: float | None = None
    ) -> Lease | None:
        """Lease the longest visible prefix of ``hashes``; None when the first is absent."""
        ttl = self.lease_timeout_s if ttl_s is None else ttl_s
        if ttl <= 0:
            raise ValueError(f"lease ttl_s must be > 0, got {ttl}")
        leased: list[BlockHash] = []
        slot_ids: list[int] = []
        for h in hashes:
            slot = self._cached.get(h)
            if slot is None:
                break
            leased.append(h)
            slot_ids.append(slot)
        if not slot_ids:
            return None
        for h, slot in zip(leased, slot_ids, strict=True):
            if self._num_leases[slot] == 0:
                self._dequeue(h)
            self._num_leases[slot] += 1
        lease = Lease(
            self._next_lease_id, owner, tuple(leased), tuple(slot_ids), self._clock() + ttl
        )
        self._next_lease_id += 1
        self._leases[lease.lease_id] = lease
        return lease

    def renew(self, lease: Lease, ttl_s: float | None = None) -> bool:
        """Push the deadline out; False if the lease already ended."""
        if self._leases.get(lease.lease_id) is not lease:
            return False
        lease.deadline = self._clock() + (self.lease_timeout_s if ttl_s is None else ttl_s)
        return True

    def release(self, lease: Lease) -> bool:
        """End a lease. False if it had already ended (expired and reaped, or released):
        then the slots may have been reused while the reader read them."""
        if self._leases.pop(lease.lease_id, None) is None:
            return False
        self._drop_lease(lease)
        return True

    def release_owner(self, owner: str) -> int:
        """End every lease of ``owner`` (a reader known to be gone); how many ended."""
        mine = [lease for lease in self._leases.values() if lease.owner == owner]
        for lease in mine:
            self.release(lease)
        return len(mine)

    def reap_expired(self) -> int:
        """End the leases whose deadline has passed; how many ended."""
        expired = pop_expired(self._leases, self._clock())
        for lease in expired:
            self._drop_lease(lease)
            log.warning(
                "dram.lease_expired",
                owner=lease.owner,
                lease_id=lease.lease_id,
                num_blocks=lease.num_blocks,
            )
        self.num_expired_leases += len(expired)
        return len(expired)

    def _any_expired(self) -> bool:
        now = self._clock()
        return any(lease.deadline < now for lease in self._leases.values())

    def _drop_lease(self, lease: Lease) -> None:
        # Leases ended in the order they were taken: the first block of a
        # prefix ends up least recent among them, which matches how prefixes
        # are shared (a tail block is needed only together with its prefix).
        for slot in lease.slot_ids:
            n = self._num_leases[slot] - 1
            if n < 0:
                raise RuntimeError(f"slot {slot} lease count went negative")
            self._num_leases[slot] = n
            if n > 0:
                continue
            state = self._state[slot]
            if state is SlotState.CACHED:
                h = self._slot_hash[slot]
                if h is None:
                    raise RuntimeError(f"cached slot {slot} has no hash")
                self._enqueue(h)
            elif state is SlotState.DEAD:
                self.num_dead -= 1
                self._free_slot(slot)
            else:
                raise RuntimeError(f"leased slot {slot} in state {state.value}")

    # -- removal -----------------------------------------------------------

    def remove(self, block_hash: BlockHash) -> bool:
        """Drop a visible block; a leased one stays readable until its leases end."""
        slot = self._cached.get(block_hash)
        if slot is None:
            return False
        self._unindex(slot, evicted=False)
        return True

    def clear(self) -> int:
        """Drop every visible block; pending fills are left to finish or abort."""
        hashes = list(self._cached)
        for h in hashes:
            self.remove(h)
        return len(hashes)

    def _unindex(self, slot: int, *, evicted: bool) -> None:
        block_hash = self._slot_hash[slot]
        if block_hash is None or self._state[slot] is not SlotState.CACHED:
            raise RuntimeError(f"unindex of slot {slot} in state {self._state[slot].value}")
        del self._cached[block_hash]
        self._dequeue(block_hash)
        if self.on_removed is not None:
            self.on_removed(block_hash, slot, evicted)
        if self._num_leases[slot] > 0:
            self._state[slot] = SlotState.DEAD
            self.num_dead += 1
        else:
            self._free_slot(slot)

    def _take_slot(self) -> int | None:
        if not self._free and not self._evictable and self._any_expired():
            # A dead reader's lease frees an unpinned block before a soft
            # pin is broken.
            self.reap_expired()
        if self._free:
            return self._free.pop()
        if self._evict_one() is None:
            return None
        # An unleased victim goes straight back to the free list.
        return self._free.pop()

    def _evict_one(self) -> BlockHash | None:
        """Evict the least recently used unpinned block, else soft-pinned one;
        its hash, or None when every cached block is leased or hard-pinned."""
        queue = self._evictable or self._soft
        if not queue:
            return None
        victim = next(iter(queue))
        self.num_evictions += 1
        self._unindex(self._cached[victim], evicted=True)
        return victim

    def evict(self, num_blocks: int) -> list[BlockHash]:
        """Evict up to ``num_blocks`` blocks in eviction order (unpinned least
        recently used first, soft-pinned last; never leased or hard-pinned
        ones); the hashes evicted. The listener sees each, as for ``allocate``."""
        evicted: list[BlockHash] = []
        while len(evicted) < num_blocks:
            victim = self._evict_one()
            if victim is None:
                break
            evicted.append(victim)
        return evicted

    # -- pins --------------------------------------------------------------

    def requeue(self, block_hash: BlockHash) -> None:
        """The pin of ``block_hash`` changed: move it to the eviction queue its
        pin says (a leased block joins one when its last lease ends)."""
        slot = self._cached.get(block_hash)
        if slot is not None and self._num_leases[slot] == 0:
            self._queues.requeue(block_hash)

    def _queue_for(self, block_hash: BlockHash) -> OrderedDict[BlockHash, None] | None:
        return self._queues.queue_for(block_hash)

    def _enqueue(self, block_hash: BlockHash) -> None:
        self._queues.enqueue(block_hash)

    def _dequeue(self, block_hash: BlockHash) -> None:
        self._queues.dequeue(block_hash)

    def _free_slot(self, slot: int) -> None:
        self._state[slot] = SlotState.FREE
        self._slot_hash[slot] = None
        self._free.append(slot)

    # -- self-check --------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError if the pool's bookkeeping disagrees with itself."""
        counts = dict.fromkeys(SlotState, 0)
        for s in self._state:
            counts[s] += 1
        problems: list[str] = []
        if sum(counts.values()) != self.num_slots:
            problems.append("slot states do not cover the pool")
        if counts[SlotState.FREE] != len(self._free) or len(set(self._free)) != len(self._free):
            problems.append(f"{counts[SlotState.FREE]} free slots but free list {len(self._free)}")
        if counts[SlotState.CACHED] != len(self._cached):
            problems.append(f"{counts[SlotState.CACHED]} cached slots, index {len(self._cached)}")
        if counts[SlotState.PENDING] != len(self._pending):
            problems.append(f"{counts[SlotState.PENDING]} pending slots, {len(self._pending)}")
        if counts[SlotState.DEAD] != self.num_dead:
            problems.append(f"{counts[SlotState.DEAD]} dead slots, counter {self.num_dead}")
        for h, slot in self._cached.items():
            if self._slot_hash[slot] != h or self._state[slot] is not SlotState.CACHED:
                problems.append(f"index entry {h.hex()} -> slot {slot} is stale")
            want = self._queue_for(h) if self._num_leases[slot] == 0 else None
            for queue, name in ((self._evictable, "unpinned"), (self._soft, "soft-pinned")):
                if (h in queue) != (queue is want):
                    problems.append(
                        f"slot {slot}: leases {self._num_leases[slot]}, pin "
                        f"{self._pin_of(h)}, vs the {name} eviction queue"
                    )
        for h, slot in self._pending.items():
            if self._slot_hash[slot] != h or self._state[slot] is not SlotState.PENDING:
                problems.append(f"pending entry {h.hex()} -> slot {slot} is stale")
        if len(self._evictable) + len(self._soft) > len(self._cached):
            problems.append("eviction queues hold blocks that are not cached")
        want = [0] * self.num_slots
        for lease in self._leases.values():
            for slot in lease.slot_ids:
                want[slot] += 1
        if want != self._num_leases:
            problems.append("lease counts disagree with the live leases")
        for slot in self._free:
            if self._num_leases[slot]:
                problems.append(f"free slot {slot} is leased")
        if problems:
            raise RuntimeError("DRAM pool integrity: " + "; ".join(problems))
