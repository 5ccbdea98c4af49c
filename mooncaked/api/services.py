"""What the API handlers read of a node: one holder of its running subsystems.

The node fills each slot as its subsystem starts and clears it as it stops,
so a handler reads None (and answers 503 or reports nothing) while that part
is loading or gone. Handlers hold the ``Services`` and read it at request
time; they never reach into the node itself, so this package never imports
the daemon. The transfer engine is seen through ``TransferStatus``, so the
API never imports the transfer layer either.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from mooncaked.api.gate import Gate
from mooncaked.api.metrics import ApiMetrics
from mooncaked.config import Config
from mooncaked.identity import NodeIdentity
from mooncaked.router import Router
from mooncaked.wire.pipeline import StageClient

if TYPE_CHECKING:
    from mooncaked.cache.peer import LeaseDesk, PeerFetcher
    from mooncaked.cache.service import KVCache
    from mooncaked.cache.store import TieredStore
    from mooncaked.cluster.gossip.service import ClusterService
    from mooncaked.cluster.load import CostMeter
    from mooncaked.cluster.member import ClusterMember
    from mooncaked.cluster.state import ClusterView
    from mooncaked.cluster.status import ClusterSnapshot
    from mooncaked.engine.core import EngineCore, EngineStats
    from mooncaked.engine.kv_receiver import KVReceiver
    from mooncaked.engine.kv_sender import KVSender
    from mooncaked.engine.offload.server import AttentionServer
    from mooncaked.kv_events.service import KVEvents, KVEventsStats
    from mooncaked.objects.service import ObjectStore
    from mooncaked.wire.lease import Holding
    from mooncaked.wire.replicas import ReplicaDesk
    from mooncaked.wire.replicator import Replicator


class TransferCounters(Protocol):
    """A snapshot of the transfer engine's counters (a ``TransferMetrics``)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]
    bytes_read: int
    bytes_written: int
    ops_done: int
    ops_failed: int
    batches: int
    queued_slices: int
    bytes_by_transport: Mapping[str, int]


class TransferStatus(Protocol):
    """What the API reads of the transfer engine."""

    @property
    def address(self) -> str: ...
    def metrics(self) -> TransferCounters: ...


class Lifecycle:
    """The node's state as health checks see it (loading, serving, draining,
    failed, stopping) and the one way to ask it to stop.

    ``stop`` is the node's: it drains and leaves every subsystem.
    """

    def __init__(self, clock: Callable[[], float], stop: Callable[[], Awaitable[None]]) -> None:
        self.gate = Gate()
        self._clock = clock
        self._started_at = clock()
        self._serving = False
        self._stop = stop
        self._stop_task: asyncio.Future[None] | None = None
        self.failure: BaseException | None = None
        self.failed = asyncio.Event()
        self.stop_requested = asyncio.Event()
        # Under the node's run(), which stops it once asked; else a request stops it here.
        self.supervised = False
        self.stopping = False

    def start_clock(self) -> None:
        self._started_at = self._clock()

    def uptime_s(self) -> float:
        return self._clock() - self._started_at

    def set_serving(self, serving: bool) -> None:
        self._serving = serving

    @property
    def ready(self) -> bool:
        return self._serving and not self.gate.closed and self.failure is None

    @property
    def draining(self) -> bool:
        return self.gate.closed

    @property
    def num_inflight(self) -> int:
        return self.gate.num_inflight

    def fail(self, exc: BaseException) -> bool:
        """Records the first failure; False for any later one."""
        if self.failure is not None:
            return False
        self.failure = exc
        self._serving = False
        self.failed.set()
        return True

    def request_drain(self) -> bool:
        """Start the drain and stop of the node (as SIGTERM); False if it had begun."""
        if self.stop_requested.is_set() or self.stopping:
            return False
        self.stop_requested.set()
        if not self.supervised:
            # Not under run(): stop in the background, as run() would.
            self._stop_task = asyncio.ensure_future(self._stop())
        return True

    async def wait_stop(self) -> None:
        """Returns once a stop was requested or a subsystem failed."""
        async with asyncio.TaskGroup() as tg:
            waits = [tg.create_task(self.stop_requested.wait()), tg.create_task(self.failed.wait())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for t in waits:
                t.cancel()


@dataclass(slots=True)
class Services:
    config: Config
    identity: NodeIdentity
    lifecycle: Lifecycle
    metrics: ApiMetrics
    router: Router
    # A pipeline stage's calls to the next one, signed like the router's.
    stage_client: StageClient
    # Each None until its subsystem runs, and again once it stopped.
    transfer: TransferStatus | None = None
    engine: EngineCore | None = None
    cache: KVCache | None = None
    # What this node answers peers' lease lookups from (None: it lends nothing).
    holding: Holding | None = None
    # What it answers replica calls from (None: it takes none), and what
    # puts its own blocks on other nodes.
    desk: ReplicaDesk | None = None
    replicator: Replicator | None = None
    receiver: KVReceiver | None = None
    sender: KVSender | None = None
    # The engine's cost model (cluster/costs.py, fitted by cluster/fit.py).
    costs: CostMeter | None = None
    member: ClusterMember | None = None
    # Named objects shared peer to peer (registered, fetched, coordinated).
    objects: ObjectStore | None = None
    # KV events out in vLLM's format (None: cluster.kv_events_endpoint is empty).
    kv_events: KVEvents | None = None
    # A memory node's attention service (None on other roles).
    attention: AttentionServer | None = None

    @classmethod
    def build(
        cls,
        config: Config,
        identity: NodeIdentity,
        lifecycle: Lifecycle,
        clock: Callable[[], float],
    ) -> Services:
        """The holder of a node not started yet, with its metrics and its router."""
        services: Services
        # The router sits below the API: it reads the holder through getters.
        router = Router(
            node_id=lambda: services.node_id,
            secret=identity.secret,
            engine=lambda: services.engine,
            view=lambda: services.cluster_view(),
            clock=clock,
            conductor=config.conductor,
            slo=config.slo,
            block_size=config.kv.block_size,
            # Each entry draws its own: entries that share a view must not
            # make the same choice among near-equal nodes.
            rng=random.Random(secrets.randbits(64)),
        )
        stage_client = StageClient(
            key=router.key, session=router.session, targets=router.target_of, watch=router.watch
        )
        services = cls(config, identity, lifecycle, ApiMetrics(), router, stage_client)
        return services

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    @property
    def store(self) -> TieredStore | None:
        return self.cache.store if self.cache is not None else None

    @property
    def peer_fetcher(self) -> PeerFetcher | None:
        return self.cache.fetcher if self.cache is not None else None

    @property
    def lease_desk(self) -> LeaseDesk | None:
        return self.cache.desk if self.cache is not None else None

    @property
    def cluster(self) -> ClusterService | None:
        return self.member.service if self.member is not None else None

    def cluster_view(self) -> ClusterView | None:
        return self.member.view if self.member is not None else None

    def is_up_member(self, node_id: str) -> bool:
        """Another node this one's cluster view knows as up."""
        view = self.cluster_view()
        member = view.get(node_id) if view is not None else None
        return member is not None and member.is_up and node_id != self.node_id

    def cluster_snapshot(self) -> ClusterSnapshot | None:
        return self.member.snapshot() if self.member is not None else None

    def cluster_status(self) -> dict[str, Any] | None:
        snap = self.cluster_snapshot()
        return None if snap is None else snap.status()

    def kv_events_stats(self) -> KVEventsStats | None:
        return self.kv_events.stats() if self.kv_events is not None else None

    def kv_events_status(self) -> dict[str, Any] | None:
        return self.kv_events.status_section() if self.kv_events is not None else None

    def engine_stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    def queue_s(self) -> float:
        """How long a prompt queued now waits here, as this node prices it."""
        return self.costs.queue_s() if self.costs is not None else 0.0

    def requests_in_flight(self) -> list[dict[str, Any]]:
        """This node's requests: as entry (``role`` "entry", nodes named) and as
        the engine running them (``role`` "engine", with its phase here)."""
        out: list[dict[str, Any]] = [
            {**r, "role": "entry"} for r in self.router.requests_in_flight()
        ]
        engine = self.engine
        if engine is not None:
            me = self.node_id
            for r in engine.requests_in_flight():
                out.append({**r, "role": "engine", "decode_node": me})
        return out
