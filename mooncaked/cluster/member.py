"""A daemon's membership in the cluster, as one async context manager.

Enter: start gossip (join the seeds) with this node's ``LoadMeter`` as its
local state, publish where peers read this node's DRAM slots, and publish
every block event of the device pool and the store's tiers (those cached
already first, in the same loop turn as the listeners are attached, so no
event falls in between). Exit: stop publishing block events, leave (peers
see "left" at once and drop this node's blocks from their index instead of
suspecting it for seconds), close the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from mooncaked.cluster.block_index import BlockEvent, BlockOp
from mooncaked.cluster.events import BlockEventBatcher
from mooncaked.cluster.gossip.service import ClusterService
from mooncaked.cluster.load import CostMeter, LoadMeter
from mooncaked.cluster.memory import offload_info
from mooncaked.cluster.state import ClusterView, MemoryInfo, NodeLoad
from mooncaked.cluster.status import ClusterSnapshot, cluster_snapshot
from mooncaked.config import ClusterConfig, Config
from mooncaked.identity import NodeIdentity

if TYPE_CHECKING:
    from mooncaked.cache.store import TieredStore
    from mooncaked.engine.core import EngineCore
    from mooncaked.engine.kv_pool import BlockPool


class ClusterMember:
    def __init__(
        self,
        config: ClusterConfig,
        node_id: str,
        secret: bytes,
        *,
        meter: LoadMeter,
        pool: BlockPool,
        store: TieredStore | None = None,
        segments: Sequence[Mapping[str, Any]] = (),
        generation: int | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``on_failure`` hears of a gossip loop that died; ``generation`` is
        this process's (default: now in ms), the one its signed calls name."""
        self.service = ClusterService(
            config,
            node_id,
            secret,
            local_state=meter,
            generation=generation,
            on_failure=on_failure,
        )
        self._pool = pool
        self._store = store
        self._segments = list(segments)
        # More entries of the segment list, by who publishes them ("objects").
        self._parts: dict[str, list[Mapping[str, Any]]] = {}
        self.batcher: BlockEventBatcher | None = None
        self.num_seeds_answered = 0

    @property
    def view(self) -> ClusterView:
        return self.service.view

    def set_segments(self, part: str, entries: Sequence[Mapping[str, Any]]) -> None:
        """Replaces ``part``'s entries of the segment list gossip spreads, after
        those given at start (where peers read this node's DRAM slots)."""
        self._parts[part] = list(entries)
        self.service.set_segments([*self._segments, *(e for p in self._parts.values() for e in p)])

    def snapshot(self) -> ClusterSnapshot | None:
        batcher = self.batcher
        return None if batcher is None else cluster_snapshot(self.service, batcher)

    async def __aenter__(self) -> ClusterMember:
        # start() closes the service itself when it fails.
        self.num_seeds_answered = await self.service.start()
        try:
            self._attach_block_events()
            if self._segments:
                self.service.set_segments(self._segments)
        except BaseException:
            self._detach_block_events()
            await self.service.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._detach_block_events()
        try:
            await self.service.leave()
        finally:
            await self.service.close()

    def _attach_block_events(self) -> None:
        batcher = BlockEventBatcher(self.service.publish_block_events, asyncio.get_running_loop())
        self.batcher = batcher
        # Listeners first, then what is cached already, in one go: no event
        # can fall in between (all of it runs on the loop, without awaiting).
        self._pool.listeners.append(batcher.on_device_event)
        snapshot: list[BlockEvent] = [
            (h, "device", BlockOp.STORED) for h in self._pool.cached_blocks
        ]
        store = self._store
        if store is not None:
            store.on_block_event = batcher.on_store_event
            snapshot += [(h, "dram", BlockOp.STORED) for h in store.dram.cached_hashes()]
            if store.ssd is not None:
                snapshot += [(h, "ssd", BlockOp.STORED) for h in store.ssd.hashes()]
        batcher.add_snapshot(snapshot)

    def _detach_block_events(self) -> None:
        batcher, self.batcher = self.batcher, None
        if batcher is None:
            return
        if batcher.on_device_event in self._pool.listeners:
            self._pool.listeners.remove(batcher.on_device_event)
        store = self._store
        if store is not None and store.on_block_event == batcher.on_store_event:
            store.on_block_event = None
        batcher.close()


@contextlib.asynccontextmanager
async def joined(
    config: Config,
    identity: NodeIdentity,
    *,
    api_addr: str,
    engine: Callable[[], EngineCore | None],
    draining: Callable[[], bool],
    costs: CostMeter | None,
    pool: BlockPool,
    store: TieredStore | None,
    segments: Sequence[Mapping[str, Any]],
    on_failure: Callable[[BaseException], None],
    memory_load: Callable[[], NodeLoad] | None = None,
    memory: Callable[[], MemoryInfo] | None = None,
) -> AsyncIterator[ClusterMember]:
    """This node in the cluster of ``[cluster]`` while entered, gossiping the
    load of ``engine`` (None while it is not serving) from ``api_addr``."""
    meter = LoadMeter(
        role=config.node.role,
        api_addr=api_addr,
        engine=engine,
        draining=draining,
        clock=time.monotonic,
        costs=costs,
        pipeline=config.pipeline,
        dram_free=None if store is None else (lambda: store.dram.num_free),
        memory_load=memory_load,
        memory=memory,
        offload=lambda e: offload_info(config, e),
    )
    member = ClusterMember(
        config.cluster,
        identity.node_id,
        identity.secret,
        meter=meter,
        pool=pool,
        store=store,
        segments=segments,
        generation=identity.generation,
        on_failure=on_failure,
    )
    async with member:
        structlog.get_logger(__name__).bind(node=identity.node_id).info(
            "cluster joined",
            gossip=f"{config.cluster.gossip_host}:{member.service.gossip_port}",
            seeds=len(config.cluster.seeds),
            seeds_answered=member.num_seeds_answered,
            api=api_addr,
        )
        yield member
