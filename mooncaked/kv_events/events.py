"""The engine's prefix cache as KV events: what a router outside the cluster reads.

vLLM's engine publishes three events about its own prefix cache, and routers
built for vLLM (llm-d's precise prefix scorer, Dynamo's KV router, Mooncake's
conductor) keep an index of every engine's blocks from them:

- ``BlockStored``: consecutive full blocks of one sequence entered the cache,
  with the hash of the block before them and their tokens. Routers rebuild
  their own keys from the tokens, so a stored block must come with them.
- ``BlockRemoved``: blocks left the cache.
- ``AllBlocksCleared``: the engine holds no block any more.

The source is the device block pool, the cache vLLM's events describe: a run
``BlockPool.cache_blocks`` publishes is one ``BlockStored``; an eviction is a
``BlockRemoved``. The DRAM and SSD tiers are not told: they key blocks by hash
alone (blocks fetched from peers, put by clients, replayed from the SSD log
after a restart carry no tokens), so a truthful ``BlockStored`` cannot be made
for them; the cluster's gossip index covers them.

Events gather for one event-loop turn (an engine step's land together) and
leave as one batch, numbered in order. The batch is offered to the publisher's
bounded queue; a full queue drops it and counts its events, and the batch's
number stays skipped, so a subscriber sees the gap.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from mooncaked.cache.hashing import BlockHash
from mooncaked.engine.kv_pool import BlockPool, CachedRun

log = structlog.get_logger(__name__)

# vLLM's name for the engine's own prefix cache (its block pool's events carry
# it; offloaded tiers are named otherwise), which routers weigh as the best hit.
MEDIUM_GPU = "GPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events of one loop turn. ``seq`` numbers batches from 0 with no gap but
    a dropped one; ``ts`` is wall-clock seconds, as vLLM stamps its batches."""

    seq: int
    ts: float
    events: tuple[KVEvent, ...]


@dataclass(frozen=True, slots=True)
class SourceStats:
    batches_offered: int
    events_offered: int
    batches_dropped: int
    events_dropped: int
    announced_blocks: int


# Offers a batch to the publisher; False when its queue is full.
Offer = Callable[[EventBatch], bool]


class KVEventSource:
    """The device pool's block events, batched per event-loop turn.

    Listeners run on the event loop (the pool is changed there only) and do
    no more than append; the flush, scheduled with ``call_soon`` by the first
    event of a turn, builds the batch and offers it, never waiting. Encoding
    and sending are the publisher's, off the loop.

    Invariant: ``announced`` holds the hashes a ``BlockStored`` named and no
    ``BlockRemoved`` or ``AllBlocksCleared`` took back since: the blocks a
    subscriber that saw every batch believes this node holds.
    """

    __slots__ = (
        "_attached",
        "_batches_dropped",
        "_batches_offered",
        "_block_size",
        "_events_dropped",
        "_events_offered",
        "_handle",
        "_loop",
        "_offer",
        "_pending",
        "_pool",
        "_seq",
        "_wall_clock",
        "announced",
    )

    def __init__(
        self,
        pool: BlockPool,
        offer: Offer,
        loop: asyncio.AbstractEventLoop,
        *,
        block_size: int,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self._pool = pool
        self._offer = offer
        self._loop = loop
        self._block_size = block_size
        self._wall_clock = wall_clock
        self._seq = itertools.count()
        self._pending: list[KVEvent] = []
        self._handle: asyncio.Handle | None = None
        self._attached = False
        self.announced: set[BlockHash] = set()
        self._batches_offered = 0
        self._events_offered = 0
        self._batches_dropped = 0
        self._events_dropped = 0

    def attach(self) -> None:
        """Start listening to the pool. Blocks cached before are not told:
        attach before the engine runs."""
        if self._attached:
            raise RuntimeError("the KV event source is attached already")
        self._pool.run_listeners.append(self._on_run)
        self._pool.listeners.append(self._on_block)
        self._attached = True

    def close(self) -> None:
        """Stop listening and offer what is pending. A subscriber is then told
        the node holds nothing (the cache goes with the process)."""
        if not self._attached:
            return
        self._attached = False
        if self._on_run in self._pool.run_listeners:
            self._pool.run_listeners.remove(self._on_run)
        if self._on_block in self._pool.listeners:
            self._pool.listeners.remove(self._on_block)
        if self.announced:
            self._add(AllBlocksCleared())
        if self._handle is not None:
            self._handle.cancel()
        self.flush()

    def stats(self) -> SourceStats:
        return SourceStats(
            batches_offered=self._batches_offered,
            events_offered=self._events_offered,
            batches_dropped=self._batches_dropped,
            events_dropped=self._events_dropped,
            announced_blocks=len(self.announced),
        )

    # -- the pool's listeners ----------------------------------------------

    def _on_run(self, run: CachedRun) -> None:
        self.announced.update(run.block_hashes)
        self._add(BlockStored(run.block_hashes, run.parent_hash, run.token_ids, self._block_size))

    def _on_block(self, block_hash: BlockHash, stored: bool) -> None:
        # A stored block is told by its run, with its tokens. A removed one
        # never announced (a pipeline stage's layers) means nothing outside.
        if stored or block_hash not in self.announced:
            return
        self.announced.discard(block_hash)
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved):
            # Evictions come one block at a time; one event names them all.
            self._pending[-1] = BlockRemoved((*last.block_hashes, block_hash), last.medium)
        else:
            self._add(BlockRemoved((block_hash,)))

    def _add(self, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self.announced.clear()
        self._pending.append(event)
        if self._handle is None and self._attached:
            self._handle = self._loop.call_soon(self.flush)

    # -- batches -------------------------------------------------------------

    def flush(self) -> None:
        """Offer what is pending as one batch (also run by the scheduled callback)."""
        self._handle = None
        if not self._pending:
            return
        events, self._pending = self._pending, []
        if not self.announced and any(not isinstance(e, BlockStored) for e in events):
            # The turn ended with nothing announced left (a prefix-cache reset,
            # or evictions that took every block): what vLLM says after a reset.
            events = [AllBlocksCleared()]
        batch = EventBatch(next(self._seq), self._wall_clock(), tuple(events))
        if self._offer(batch):
            self._batches_offered += 1
            self._events_offered += len(batch.events)
            return
        self._batches_dropped += 1
        self._events_dropped += len(batch.events)
        if self._batches_dropped == 1 or self._batches_dropped % 1000 == 0:
            log.warning(
                "kv events dropped: the publisher's queue is full",
                batches_dropped=self._batches_dropped,
                events_dropped=self._events_dropped,
            )
