"""The daemon's side of gossip: what this node says about itself, and what it asks the index.

- ``LoadMeter`` is the ``local_state`` callback of ``ClusterService``: role,
  model, API address, draining, and the load read off the engine's scheduler.
  Gossip polls it every round (five times a second by default), so it reads
  counters and walks the scheduler's queues once without building anything.
- ``BlockEventBatcher`` collects the block events of the device pool (they
  fire inside the engine step, one per block) and of the DRAM and SSD tiers,
  and hands them to gossip once per event-loop turn: one engine step's
  events become one batch.
- ``ClusterHolders`` is the ``HolderLocator`` of peer fetches: the nodes the
  cluster-wide block index says hold a prompt's prefix in DRAM or on SSD
  (only those blocks can be leased), longest prefix first. When nobody
  does, the static ``store.peers`` are the fallback; with none configured a
  fetch asks nobody and costs no round trip.
- ``ClusterSnapshot`` is what ``/admin/status`` and ``/metrics`` show.

Predicted queue time (``NodeLoad.predicted_queue_s``) is a deliberately simple
estimate: the prompt tokens waiting to be computed, spread over the prefill
share of the step budget (``max_num_batched_tokens`` minus one token per
running decode), times the measured seconds per engine step::

    predicted_queue_s = ceil(queued_prefill_tokens / (budget - decode_batch)) * step_s

``step_s`` is a moving average of wall time per step, sampled between polls
during which the engine had work the whole time (so idle gaps do not count).
Before the first sample it is 0, and so is the prediction.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from mooncaked.cluster.state import (
    BlockEvent,
    BlockOp,
    ClusterCounters,
    ClusterView,
    LocalState,
    MemberStatus,
    NodeLoad,
    Tier,
    tier_mask,
)

if TYPE_CHECKING:
    from mooncaked.cache.hashing import BlockHash
    from mooncaked.cache.store import Tier as StoreTier
    from mooncaked.cluster.gossip.service import ClusterService
    from mooncaked.engine.core import EngineCore
    from mooncaked.engine.scheduler import Scheduler

log = structlog.get_logger(__name__)

# Weight of a new sample in the step-time average.
_STEP_EWMA_ALPHA = 0.3
# Peers asked for one prefix at most: the index may be a little stale, so a
# second and third holder hedge a first that evicted the blocks meanwhile;
# every extra one costs a lease round trip.
MAX_HOLDERS = 3
# What a peer can lease: DRAM slots, and SSD blocks it promotes to DRAM first.
LEASABLE_TIERS = tier_mask(Tier.DRAM, Tier.SSD)
# Store tiers that are this node's own (the store also names "peer").
_OWN_TIERS = frozenset({"device", "dram", "ssd"})


class LoadMeter:
    """``local_state`` for ``ClusterService``: cheap enough to run every gossip round."""

    def __init__(
        self,
        *,
        role: str,
        api_addr: str,
        engine: Callable[[], EngineCore | None],
        draining: Callable[[], bool],
        clock: Callable[[], float],
    ) -> None:
        self._role = role
        self._api_addr = api_addr
        self._engine = engine
        self._draining = draining
        self._clock = clock
        # Seconds per engine step (moving average); 0 until measured.
        self.step_s = 0.0
        # Start of the current busy window: (time, engine.num_steps), or None.
        self._busy_since: tuple[float, int] | None = None

    def __call__(self) -> LocalState:
        engine = self._engine()
        if engine is None:
            return LocalState(role=self._role, api_addr=self._api_addr, draining=self._draining())
        queued, decode = scheduler_load(engine.scheduler)
        self._measure_step(engine.num_steps, busy=bool(queued or decode))
        prefill_share = max(1, engine.config.scheduler.max_num_batched_tokens - decode)
        predicted = math.ceil(queued / prefill_share) * self.step_s if queued else 0.0
        return LocalState(
            role=self._role,
            model_id=engine.model_id,
            api_addr=self._api_addr,
            draining=self._draining(),
            load=NodeLoad(
                queued_prefill_tokens=queued,
                running_decode_batch=decode,
                # Rounded: gossip announces every change, and noise is no news.
                kv_usage=round(engine.pool.usage, 3),
                predicted_queue_s=round(predicted, 3),
            ),
        )

    def _measure_step(self, num_steps: int, *, busy: bool) -> None:
        if not busy:
            self._busy_since = None
            return
        now = self._clock()
        since = self._busy_since
        if since is None:
            self._busy_since = (now, num_steps)
            return
        t0, steps0 = since
        if num_steps <= steps0:
            return  # one long step still running: widen the window
        sample = (now - t0) / (num_steps - steps0)
        if self.step_s == 0.0:
            self.step_s = sample
        else:
            self.step_s += _STEP_EWMA_ALPHA * (sample - self.step_s)
        self._busy_since = (now, num_steps)


def scheduler_load(scheduler: Scheduler) -> tuple[int, int]:
    """(prompt tokens still to compute, requests decoding) of an engine's scheduler.

    Waiting requests count every token not yet computed (a preempted one
    recomputes its output too); a running request counts as decoding once it
    has sampled a token and has only that token left to compute, else as
    prefilling with what it has left. Requests loading cached blocks are not
    counted: the load is short and their tail is unknown until it ends.
    """
    queued = 0
    decode = 0
    for req in scheduler.waiting:
        queued += req.num_tokens - req.num_computed_tokens
    for req in scheduler.running:
        left = req.num_tokens - req.num_computed_tokens
        if left <= 1 and req.output_token_ids:
            decode += 1
        else:
            queued += left
    return queued, decode


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

    def on_store_event(self, block_hash: BlockHash, tier: StoreTier, stored: bool) -> None:
        """The ``TieredStore.on_block_event`` listener: DRAM and SSD blocks."""
        name = tier.value
        if name not in _OWN_TIERS:
            return
        self._add((block_hash, name, BlockOp.STORED if stored else BlockOp.REMOVED))

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


class ClusterHolders:
    """``HolderLocator`` over the cluster-wide block index; static peers as the fallback.

    ``view()`` returns the live ``ClusterView``, or None while gossip is not
    running (then only the static peers are asked). Holders are other alive,
    known members with an API address whose index holds a leading run of the
    asked hashes in DRAM or on SSD; longest run first, then not draining (it
    is about to leave), then fewer SSD blocks (a holder reads those before it
    can lease them), then node id (so the order is deterministic).
    """

    def __init__(
        self,
        view: Callable[[], ClusterView | None],
        *,
        static: Sequence[str] = (),
        max_holders: int = MAX_HOLDERS,
    ) -> None:
        if max_holders <= 0:
            raise ValueError(f"max_holders must be > 0, got {max_holders}")
        self._view = view
        self._static = tuple(static)
        self._max_holders = max_holders

    def holders(self, hashes: Sequence[BlockHash]) -> list[str]:
        view = self._view()
        if view is not None and hashes:
            found = self._from_index(view, hashes)
            if found:
                return found
        return list(self._static)

    def _from_index(self, view: ClusterView, hashes: Sequence[BlockHash]) -> list[str]:
        matches = view.longest_prefix(hashes, tiers=LEASABLE_TIERS)
        ranked: list[tuple[int, bool, int, str, str]] = []
        for node_id, match in matches.items():
            if node_id == view.self_id:
                continue
            m = view.members.get(node_id)
            # Suspects may be dead: asking one could cost the whole fetch deadline.
            if m is None or m.status is not MemberStatus.ALIVE or m.state is None:
                continue
            st = m.state
            if not st.api_addr:
                continue
            ranked.append(
                (-match.num_blocks, st.draining, match.tier_blocks[Tier.SSD], node_id, st.api_addr)
            )
        ranked.sort()
        return [f"http://{addr}" for *_, addr in ranked[: self._max_holders]]


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """What /admin/status and /metrics show of gossip, read in one go."""

    node_id: str
    gossip_addr: str
    incarnation: int
    num_seeds: int
    # Members by status (self included), every status present.
    members: dict[str, int]
    counters: ClusterCounters
    # Entries of every node's replica of the block index, and of this node's own.
    index_blocks: int
    own_blocks: int
    block_events: int
    block_event_errors: int

    def status(self) -> dict[str, Any]:
        """The "cluster" section of /admin/status."""
        c = self.counters
        return {
            "node_id": self.node_id,
            "gossip_addr": self.gossip_addr,
            "incarnation": self.incarnation,
            "seeds": self.num_seeds,
            "members": self.members,
            "index_blocks": self.index_blocks,
            "own_blocks": self.own_blocks,
            "packets": {
                "sent": c.packets_sent,
                "received": c.packets_received,
                "forged": c.dropped_bad_mac,
                "garbage": c.dropped_malformed + c.dropped_oversize,
                "invalid": c.dropped_invalid,
            },
        }


def cluster_snapshot(service: ClusterService, batcher: BlockEventBatcher) -> ClusterSnapshot:
    view = service.view
    members = {s.value: 0 for s in MemberStatus}
    for m in view.members.values():
        members[m.status.value] += 1
    c = service.counters
    return ClusterSnapshot(
        node_id=service.node_id,
        gossip_addr=f"{service.config.gossip_host}:{service.gossip_port}",
        incarnation=service.core.incarnation,
        num_seeds=len(service.config.seeds),
        members=members,
        # A copy: the collector reads it after the loop may have moved on.
        counters=dataclasses.replace(c),
        index_blocks=sum(len(b) for b in view.blocks.values()),
        own_blocks=view.num_cached_blocks(view.self_id),
        block_events=batcher.num_events,
        block_event_errors=batcher.num_errors,
    )
