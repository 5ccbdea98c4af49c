"""Node: one mooncaked daemon, owner of every subsystem's lifecycle.

Start-up is an ordered list of paired steps (start, stop). ``start()`` runs
them in order; if one fails, the steps already started are stopped in reverse
and the error propagates. ``stop()`` unwinds every started step in reverse.
A new subsystem (transfer engine, gossip, tiered store) is one more step in
``_steps()``, placed after what it depends on.

Start order: ``http`` (so /health answers while the model loads), ``model``
(build the engine), ``transfer`` (the transfer engine on ``[transfer]``),
``store`` (the tiered KV cache, its DRAM pool in a transfer segment peers can
read, and the peer fetcher), ``engine`` (attach the store, start the step
loop), ``cluster`` (gossip on ``[cluster]``: join the seeds, publish this
node's state, its DRAM segment and every block event of its tiers; peer
fetches then find holders through the cluster-wide block index), ``serving``.

Drain order (the stop half of the steps, newest first):

1. ``serving``: close the gate: new generation requests get 503 and /ready
   turns 503, so a load balancer stops sending; gossip announces
   ``draining`` at once, so other nodes stop placing work here; wait up to
   ``server.drain_timeout_s`` for the requests in flight to finish (peers
   may still lease this node's cached blocks meanwhile).
2. ``cluster``: stop publishing block events, leave the cluster (peers mark
   this node "left" and drop its blocks from their index, so no new fetch
   comes here), close the gossip sockets.
3. ``engine``: close the engine, which aborts whatever is still running
   (those streams end with finish reason "abort") and stops its step loop.
4. ``store``: wait for peer fetches in flight, end the leases granted to
   peers, finish queued offloads and SSD writes (the engine may have queued
   some on its way out), close the SSD tier.
5. ``transfer``: close the transfer engine, withdrawing the DRAM segment.
6. ``model``: nothing left to do (the engine was closed in 3).
7. ``http``: stop listening, then give handlers a short grace to write
   their last bytes before their connections are closed.

``run()`` adds the signals: the first SIGTERM/SIGINT starts that drain and
``run`` returns 0 once it is done; a second one exits at once with
``EXIT_FORCED``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from mooncaked.api.admin import AdminAPI, CacheAdmin
from mooncaked.api.internal import Holding, InternalAPI
from mooncaked.api.metrics import ApiMetrics
from mooncaked.api.openai import Gate, OpenAIAPI, api_middleware
from mooncaked.config import Config

if TYPE_CHECKING:
    from mooncaked.api.internal import InternalClient
    from mooncaked.cache.peer import LeaseDesk, PeerFetcher
    from mooncaked.cache.store import TieredStore
    from mooncaked.cluster.gossip.service import ClusterService
    from mooncaked.cluster.local import BlockEventBatcher, ClusterSnapshot
    from mooncaked.cluster.state import BlockEvent, ClusterView
    from mooncaked.engine.core import EngineCore, EngineStats
    from mooncaked.transfer import TransferEngine

EngineFactory = Callable[[Config], "EngineCore"]

# Exit status when a second signal cuts a drain short.
EXIT_FORCED = 3
# Handlers still writing when the server stops get this long (seconds) before
# their connections are closed; by then the engine has ended their streams.
_HTTP_SHUTDOWN_GRACE_S = 2.0
# Largest request body accepted (a long prompt as JSON token ids).
_MAX_BODY_BYTES = 64 * 1024 * 1024
# The transfer segment the DRAM tier's slots live in; peers read it.
DRAM_SEGMENT = "kv.dram"
# The engine waits this much longer for a peer fetch than the fetcher's own
# bound, so the fetcher gives up (and counts it) first.
_PREFETCH_GRACE_S = 0.5
# Listen addresses that name no single interface, so no use to a peer.
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


def _default_engine_factory(config: Config) -> EngineCore:
    from mooncaked.engine.core import EngineCore

    return EngineCore(config)


@dataclass(slots=True)
class Step:
    """One subsystem's paired start and stop."""

    name: str
    start: Callable[[], Awaitable[None]]
    stop: Callable[[], Awaitable[None]]


class Node:
    def __init__(
        self,
        config: Config,
        *,
        engine_factory: EngineFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._engine_factory = engine_factory or _default_engine_factory
        self._clock = clock
        self._started_at = clock()
        self._engine: EngineCore | None = None
        # Built by the "model" step, started by the "engine" step.
        self._built_engine: EngineCore | None = None
        self._transfer: TransferEngine | None = None
        self._store: TieredStore | None = None
        self._lease_desk: LeaseDesk | None = None
        self._peer_fetcher: PeerFetcher | None = None
        self._peer_client: InternalClient | None = None
        self._holding: Holding | None = None
        self._peer_urls: tuple[str, ...] = ()
        self._cluster: ClusterService | None = None
        self._block_events: BlockEventBatcher | None = None
        self._ready = False
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self._started: list[Step] = []
        self._stopping = False
        self._stop_lock = asyncio.Lock()
        self._log = structlog.get_logger(__name__).bind(node=self.node_id)

        self.gate = Gate()
        self.metrics = ApiMetrics(self._engine_stats)
        self.openai = OpenAIAPI(lambda: self._engine, self.metrics, self.gate, clock)
        self.admin = AdminAPI(self)
        # Routes of subsystems added later (/admin/cluster, /admin/cache/...);
        # append before start().
        self.extra_routes: list[web.RouteDef] = []
        self._add_cache_endpoints()
        self._add_cluster_endpoints()

    # ------------------------------------------------------------ accessors

    @property
    def config(self) -> Config:
        return self._config

    @property
    def node_id(self) -> str:
        if self._config.node.id:
            return self._config.node.id
        port = self._port if self._port is not None else self._config.server.port
        return f"{socket.gethostname()}-{port}"

    @property
    def engine(self) -> EngineCore | None:
        """The running engine; None before start-up finished and after stop."""
        return self._engine

    @property
    def listening(self) -> bool:
        return self._runner is not None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the node is not listening; call start() first")
        return self._port

    @property
    def url(self) -> str:
        host = self._config.server.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def ready(self) -> bool:
        return self._ready and not self.gate.closed

    @property
    def draining(self) -> bool:
        return self.gate.closed

    @property
    def num_inflight(self) -> int:
        return self.gate.num_inflight

    def uptime_s(self) -> float:
        return self._clock() - self._started_at

    def _engine_stats(self) -> EngineStats | None:
        return self._engine.stats() if self._engine is not None else None

    @property
    def store(self) -> TieredStore | None:
        """The tiered KV cache (DRAM, SSD); None before its step and after stop."""
        return self._store

    @property
    def transfer(self) -> TransferEngine | None:
        return self._transfer

    @property
    def peer_fetcher(self) -> PeerFetcher | None:
        return self._peer_fetcher

    @property
    def lease_desk(self) -> LeaseDesk | None:
        return self._lease_desk

    @property
    def cluster(self) -> ClusterService | None:
        """The gossip subsystem; None before its step and after stop."""
        return self._cluster

    @property
    def api_addr(self) -> str:
        """host:port other nodes reach this node's HTTP API at (announced by gossip)."""
        host = self._config.server.host
        if host in _WILDCARD_HOSTS:
            # Listening everywhere: the gossip address is one peers reach.
            host = self._config.cluster.gossip_host
            if host in _WILDCARD_HOSTS:
                host = socket.gethostname()
        if ":" in host:
            host = f"[{host}]"
        return f"{host}:{self.port}"

    # ------------------------------------------------------------ lifecycle

    def _steps(self) -> list[Step]:
        return [
            # HTTP first: /health and /ready answer while the model loads.
            Step("http", self._start_http, self._stop_http),
            Step("model", self._build_engine, self._drop_engine),
            Step("transfer", self._start_transfer, self._stop_transfer),
            Step("store", self._start_store, self._stop_store),
            Step("engine", self._start_engine, self._stop_engine),
            Step("cluster", self._start_cluster, self._stop_cluster),
            Step("serving", self._start_serving, self._drain),
        ]

    async def start(self) -> None:
        """Starts every step in order; on failure, unwinds those started and raises."""
        if self._started or self._stopping:
            raise RuntimeError("a Node starts once; build a new one to start again")
        self._started_at = self._clock()
        for step in self._steps():
            try:
                await step.start()
            except BaseException:
                self._log.error("start-up failed", step=step.name)
                await self._unwind()
                raise
            self._started.append(step)
        self._log.info("node ready", url=self.url, model=self._engine_name())

    async def stop(self) -> None:
        """Drains and stops every started step, newest first. Safe to call twice."""
        async with self._stop_lock:
            await self._unwind()

    async def _unwind(self) -> None:
        self._stopping = True
        while self._started:
            step = self._started.pop()
            try:
                await step.stop()
            except Exception:
                # Keep going: a step that fails to stop must not leak the others.
                self._log.exception("stop failed", step=step.name)
        self._log.info("node stopped")

    def _engine_name(self) -> str | None:
        return self._engine.model_name if self._engine is not None else None

    async def _start_http(self) -> None:
        app = web.Application(
            middlewares=[api_middleware(self.metrics)], client_max_size=_MAX_BODY_BYTES
        )
        app.add_routes(self.admin.routes())
        app.add_routes(self.openai.routes())
        app.add_routes(self.extra_routes)
        # handler_cancellation: a client that disconnects cancels its handler,
        # whose finally aborts the request in the engine.
        runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=_HTTP_SHUTDOWN_GRACE_S,
        )
        await runner.setup()
        cfg = self._config.server
        site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._port = _bound_port(runner, cfg.port)
        self._log = self._log.bind(node=self.node_id)
        self._log.info("listening", url=self.url)

    async def _stop_http(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _build_engine(self) -> None:
        self._log.info("loading model", path=self._config.model.path)
        t0 = self._clock()
        # Loading reads weights and builds tensors for seconds or minutes:
        # off the loop, so /health keeps answering meanwhile.
        self._built_engine = await asyncio.to_thread(self._engine_factory, self._config)
        self._log.info("model loaded", load_s=round(self._clock() - t0, 3))

    async def _drop_engine(self) -> None:
        # Only an engine that never started is still here; close it all the same.
        engine, self._built_engine = self._built_engine, None
        if engine is not None:
            await engine.close()

    async def _start_engine(self) -> None:
        engine = self._built_engine
        if engine is None:
            raise RuntimeError("the engine step ran before the model step")
        self._attach_store(engine)
        try:
            await engine.start()
        except BaseException:
            await engine.close()
            self._built_engine = None
            raise
        self._built_engine = None
        self._engine = engine
        self._log.info(
            "engine started", model=engine.model_name, max_model_len=engine.max_model_len
        )

    async def _stop_engine(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            # Aborts what the drain left running; their streams end now.
            await engine.close()

    # ------------------------------------------------------------- KV cache

    def _add_cache_endpoints(self) -> None:
        """/admin/cache/*, the "store" status section, cache metrics and the
        internal lease RPC; all answer 503 (or report nothing) until the store runs."""
        self.cache_admin = CacheAdmin(self)
        self.extra_routes.extend(self.cache_admin.routes())
        self.admin.add_status_section("store", self.cache_admin.status_section)
        self.metrics.add_cache_collector(self.cache_admin.snapshot)
        self.internal = InternalAPI(
            secret=self._config.node.cluster_secret.encode(),
            node_id=lambda: self.node_id,
            holding=lambda: self._holding,
        )
        self.extra_routes.extend(self.internal.routes())

    async def _start_transfer(self) -> None:
        from mooncaked.transfer import TransferEngine

        # After "http": the node id includes the bound port.
        transfer = TransferEngine(
            self._config.transfer, self.node_id, self._config.node.cluster_secret.encode()
        )
        await transfer.start()
        self._transfer = transfer

    async def _stop_transfer(self) -> None:
        transfer, self._transfer = self._transfer, None
        if transfer is not None:
            await transfer.close()

    async def _start_store(self) -> None:
        engine, transfer = self._built_engine, self._transfer
        if engine is None or transfer is None:
            raise RuntimeError("the store step needs the model and transfer steps first")
        try:
            await self._open_store(engine, transfer)
        except BaseException:
            # A step that fails is not unwound by the node: undo our half here.
            await self._stop_store()
            raise

    async def _open_store(self, engine: EngineCore, transfer: TransferEngine) -> None:
        from mooncaked.api.internal import InternalClient, TransferBlockReader
        from mooncaked.cache.dram import BlockLayout
        from mooncaked.cache.peer import LeaseDesk, PeerFetcher
        from mooncaked.cache.store import TieredStore
        from mooncaked.cluster.local import ClusterHolders

        cfg = self._config.store
        layout = BlockLayout.from_kv_caches(engine.runner.kv_caches)
        num_slots = TieredStore.dram_slots_for(cfg, layout)
        backing = None
        if num_slots:
            # Shared memory registered with the transfer engine: peers read the
            # slots they lease, over shm when on this host, else tcp or rdma.
            backing = transfer.allocate(DRAM_SEGMENT, num_slots * layout.block_bytes).view
        store = TieredStore(layout, cfg, dram_backing=backing)
        self._store = store
        await store.start()
        desk = LeaseDesk(store, max_leases=cfg.peer_max_leases)
        self._lease_desk = desk
        client = InternalClient(
            secret=self._config.node.cluster_secret.encode(),
            node_id=lambda: self.node_id,
            block_bytes=layout.block_bytes,
            layout=layout.fingerprint(),
        )
        await client.start()
        self._peer_client = client
        # A node listed among its own peers would only ever miss.
        self._peer_urls = tuple(u for u in cfg.peers if u.rstrip("/") != self.url)
        # Holders from the cluster's block index once gossip runs; the
        # configured peers when it names nobody (or before it runs).
        locator = ClusterHolders(self._cluster_view, static=self._peer_urls)
        self._peer_fetcher = PeerFetcher(
            store,
            locator,
            client,
            TransferBlockReader(transfer, DRAM_SEGMENT),
            timeout_s=cfg.peer_fetch_timeout_s,
            max_fetches=cfg.peer_max_fetches,
            device_prefix=lambda hashes: len(engine.pool.longest_cached_prefix(hashes)),
        )
        if num_slots:
            self._holding = Holding(
                desk=desk,
                block_bytes=layout.block_bytes,
                layout=layout.fingerprint(),
                segment=transfer.descriptor(DRAM_SEGMENT).to_dict(),
                transfer_address=transfer.address,
            )
        self._log.info(
            "store started",
            dram_slots=num_slots,
            ssd=cfg.ssd_path or None,
            peers=len(self._peer_urls),
            transfer=transfer.address,
        )

    async def _stop_store(self) -> None:
        # Stop leasing first, then let fetches in flight land (they write into
        # DRAM slots), then close the store itself.
        self._holding = None
        fetcher, self._peer_fetcher = self._peer_fetcher, None
        if fetcher is not None:
            await fetcher.close()
        client, self._peer_client = self._peer_client, None
        if client is not None:
            await client.close()
        desk, self._lease_desk = self._lease_desk, None
        if desk is not None:
            desk.close()
        store, self._store = self._store, None
        if store is not None:
            await store.close()

    def _attach_store(self, engine: EngineCore) -> None:
        store, fetcher = self._store, self._peer_fetcher
        if store is None:
            return
        cfg = self._config.store
        # A request waits for a prefetch only when the fetcher would ask
        # someone (a holder in the index, or configured peers).
        engine.attach_store(
            store,
            prefetch=fetcher.fetch if fetcher is not None else None,
            prefetch_timeout_s=cfg.peer_fetch_timeout_s + _PREFETCH_GRACE_S,
            prefetch_wanted=fetcher.would_ask if fetcher is not None else None,
        )

    # -------------------------------------------------------------- cluster

    def _add_cluster_endpoints(self) -> None:
        """/admin/cluster, /admin/cluster/prefix (and the test hooks when
        ``cluster.test_hooks``), the "cluster" status section and gossip
        metrics; all answer 503 (or report nothing) until gossip runs."""
        from mooncaked.cluster.routes import cluster_routes

        self.extra_routes.extend(
            cluster_routes(lambda: self._cluster, test_hooks=self._config.cluster.test_hooks)
        )
        self.admin.add_status_section("cluster", self._cluster_status)
        self.metrics.add_cluster_collector(self._cluster_snapshot)

    def _cluster_view(self) -> ClusterView | None:
        return self._cluster.view if self._cluster is not None else None

    def _cluster_snapshot(self) -> ClusterSnapshot | None:
        from mooncaked.cluster.local import cluster_snapshot

        service, batcher = self._cluster, self._block_events
        if service is None or batcher is None:
            return None
        return cluster_snapshot(service, batcher)

    def _cluster_status(self) -> dict[str, Any] | None:
        snap = self._cluster_snapshot()
        return None if snap is None else snap.status()

    async def _start_cluster(self) -> None:
        from mooncaked.cluster.gossip.service import ClusterService
        from mooncaked.cluster.local import LoadMeter

        engine = self._engine
        if engine is None:
            raise RuntimeError("the cluster step ran before the engine step")
        cfg = self._config
        meter = LoadMeter(
            role=cfg.node.role,
            api_addr=self.api_addr,
            engine=lambda: self._engine,
            draining=lambda: self.draining,
            clock=time.monotonic,
        )
        service = ClusterService(
            cfg.cluster, self.node_id, cfg.node.cluster_secret.encode(), local_state=meter
        )
        # start() closes the service itself when it fails.
        joined = await service.start()
        self._cluster = service
        try:
            self._attach_block_events(service, engine)
            transfer = self._transfer
            if transfer is not None and self._holding is not None:
                # Where peers read this node's DRAM slots from.
                service.set_segments([transfer.descriptor(DRAM_SEGMENT).to_dict()])
        except BaseException:
            # A step that fails is not unwound by the node: undo our half here.
            self._detach_block_events()
            self._cluster = None
            await service.close()
            raise
        self._log.info(
            "cluster joined",
            gossip=f"{cfg.cluster.gossip_host}:{service.gossip_port}",
            seeds=len(cfg.cluster.seeds),
            seeds_answered=joined,
            api=self.api_addr,
        )

    def _attach_block_events(self, service: ClusterService, engine: EngineCore) -> None:
        from mooncaked.cluster.local import BlockEventBatcher
        from mooncaked.cluster.state import BlockOp

        batcher = BlockEventBatcher(service.publish_block_events, asyncio.get_running_loop())
        self._block_events = batcher
        # Listeners first, then what is cached already, in one go: no event
        # can fall in between (all of it runs on the loop, without awaiting).
        engine.pool.listeners.append(batcher.on_device_event)
        snapshot: list[BlockEvent] = [
            (h, "device", BlockOp.STORED) for h in engine.pool.cached_blocks
        ]
        store = self._store
        if store is not None:
            store.on_block_event = batcher.on_store_event
            snapshot += [(h, "dram", BlockOp.STORED) for h in store.dram.cached_hashes()]
            if store.ssd is not None:
                snapshot += [(h, "ssd", BlockOp.STORED) for h in store.ssd.hashes()]
        batcher.add_snapshot(snapshot)

    def _detach_block_events(self) -> None:
        batcher, self._block_events = self._block_events, None
        if batcher is None:
            return
        engine, store = self._engine, self._store
        if engine is not None and batcher.on_device_event in engine.pool.listeners:
            engine.pool.listeners.remove(batcher.on_device_event)
        if store is not None and store.on_block_event == batcher.on_store_event:
            store.on_block_event = None
        batcher.close()

    async def _stop_cluster(self) -> None:
        service = self._cluster
        if service is None:
            return
        self._detach_block_events()
        try:
            # Peers see "left" at once and drop this node's blocks from their
            # index, instead of suspecting it for seconds after it is gone.
            await service.leave()
        finally:
            self._cluster = None
            await service.close()

    # -------------------------------------------------------------- serving

    async def _start_serving(self) -> None:
        self._ready = True

    async def _drain(self) -> None:
        self._ready = False
        self.gate.close()
        if self._cluster is not None:
            # Announce "draining" now rather than at the next gossip round.
            self._cluster.refresh_state()
        timeout = self._config.server.drain_timeout_s
        if self.gate.num_inflight:
            self._log.info("draining", inflight=self.gate.num_inflight, timeout_s=timeout)
        try:
            await asyncio.wait_for(self.gate.wait_idle(), timeout)
        except TimeoutError:
            self._log.warning("drain timed out; aborting the rest", inflight=self.gate.num_inflight)
            return
        engine = self._engine
        if engine is not None:
            # Idle: a good moment for the pool's self-check.
            try:
                engine.check_integrity()
            except RuntimeError:
                self._log.exception("KV pool integrity check failed at shutdown")
        self._log.info("drained")

    # -------------------------------------------------------------- signals

    async def run(self, on_ready: Callable[[Node], None] | None = None) -> int:
        """Start, serve until SIGTERM/SIGINT, drain and stop; returns the exit status.

        A signal during start-up takes effect once start-up finished. A second
        signal exits the process at once with ``EXIT_FORCED``.
        """
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()

        def on_signal(signum: int) -> None:
            name = signal.Signals(signum).name
            if stop_requested.is_set():
                self._log.warning("second signal: exiting without drain", signal=name)
                sys.stderr.flush()
                os._exit(EXIT_FORCED)
            self._log.info("signal: draining", signal=name)
            stop_requested.set()

        signals = (signal.SIGINT, signal.SIGTERM)
        for sig in signals:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            await self.start()
            if on_ready is not None:
                on_ready(self)
            await stop_requested.wait()
            await self.stop()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
        return 0


def _bound_port(runner: web.AppRunner, configured: int) -> int:
    # With port 0 the OS picks one; read it back from the listening socket.
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            return int(addr[1])
    return configured
