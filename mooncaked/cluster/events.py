"""Block events of every cache tier, batched for gossip."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import structlog

from mooncaked.cluster.block_index import BlockEvent, BlockOp

if TYPE_CHECKING:
    from mooncaked.cache.hashing import BlockHash
    from mooncaked.cache.tiers import Tier

log = structlog.get_logger(__name__)


class BlockEventBatcher:
    """Block events of every tier, published to gossip once per event-loop turn.

    ``publish`` receives a list of ``(hash, tier name, "stored" | "removed")``.
    The first event after a publish schedules the next one with
    ``loop.call_soon``: an engine step's events (all fired synchronously in its
    postprocessing) end up in one batch, and nothing waits on a timer.
    """

    def __init__(
        self, publish: Callable[[list[BlockEvent]], object], loop: asyncio.AbstractEventLoop
    ) -> None:
        self._publish = publish
        self._loop = loop
        self._pending: list[BlockEvent] = []
        self._handle: asyncio.Handle | None = None
        self._closed = False
        self.num_events = 0
        self.num_batches = 0
        self.num_errors = 0

    def on_device_event(self, block_hash: BlockHash, stored: bool) -> None:
        """A ``BlockPool`` listener: device-tier blocks cached or evicted."""
        self._add((block_hash, "device", BlockOp.STORED if stored else BlockOp.REMOVED))

    def on_store_event(self, block_hash: BlockHash, tier: Tier, stored: bool) -> None:
        """The ``TieredStore.on_block_event`` listener: DRAM and SSD blocks."""
        self._add((block_hash, tier.label, BlockOp.STORED if stored else BlockOp.REMOVED))

    def add_snapshot(self, events: Sequence[BlockEvent]) -> None:
        """Blocks already cached before the batcher was attached (all "stored")."""
        for event in events:
            self._add(event)

    def _add(self, event: BlockEvent) -> None:
        if self._closed:
            return
        self._pending.append(event)
        if self._handle is None:
            self._handle = self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Publish what is pending now (also run by the scheduled callback)."""
        self._handle = None
        if not self._pending:
            return
        events, self._pending = self._pending, []
        try:
            self._publish(events)
        except Exception:
            # A bad event must not break the pool's or the store's bookkeeping,
            # which called us; the index misses this batch, the rest goes on.
            self.num_errors += 1
            log.exception("publishing block events failed", num_events=len(events))
            return
        self.num_events += len(events)
        self.num_batches += 1

    def close(self) -> None:
        """Publish what is pending and take no more events."""
        if self._handle is not None:
            self._handle.cancel()
        self.flush()
        self._closed = True
