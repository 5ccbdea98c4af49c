"""Node: one mooncaked daemon, owner of every subsystem's lifecycle.

Each subsystem is an async context manager its own package provides, built
from its config section and the handles it needs; ``start()`` enters them in
order on one ``AsyncExitStack`` (on a failure, those entered already are left
in reverse and the error propagates) and ``stop()`` leaves them newest first.
The API handlers read them from one ``api.services.Services`` holder, filled
as each starts and cleared as it stops.

Drain order (the exits, newest first):

1. serving: close the gate: new generation requests get 503 and /ready
   turns 503, so a load balancer stops sending; gossip announces
   ``draining`` at once, so other nodes stop placing work here; wait up to
   ``server.drain_timeout_s`` for the requests in flight to finish (peers
   may still lease this node's cached blocks meanwhile).
2. cluster: stop publishing block events, leave the cluster (peers mark
   this node "left" and drop its blocks from their index, so no new fetch
   comes here), close the gossip sockets.
3. engine: close the engine, which aborts whatever is still running (those
   streams end with finish reason "abort") and stops its step loop.
4. KV cache: stop leasing, wait for peer fetches in flight, end the leases
   granted to peers, finish queued offloads and SSD writes (the engine may
   have queued some on its way out), close the SSD tier.
5. KV events: stop listening to the device pool, tell subscribers the node
   holds no block, send what is queued, close the socket.
6. objects: cancel the fetches running, withdraw every object copy's
   segments (peers reading one fail over to another holder).
7. transfer: close the transfer engine, withdrawing the DRAM segment.
8. HTTP: stop listening, then give handlers a short grace to write their
   last bytes before their connections are closed.

A subsystem whose background loop dies (the engine's step loop, a store
worker, a transfer accept loop or RDMA poller) calls ``fail``: the node
stops being ready (/ready answers 503 "failed"), the engine has already
ended its requests with an error, and ``run`` drains what is left and
returns ``EXIT_FAILED`` so that systemd restarts the daemon.

``run()`` adds the signals: the first SIGTERM/SIGINT starts that drain and
``run`` returns 0 once it is done; a second one exits at once with
``EXIT_FORCED``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack

import structlog

from mooncaked.api.http import NodeApi, api_addr, api_url, serve_http
from mooncaked.api.server import CappedTCPSite
from mooncaked.api.services import Lifecycle, Services
from mooncaked.cache.peer import PeerFetcher
from mooncaked.cache.store import TieredStore
from mooncaked.cluster.gossip.service import ClusterService
from mooncaked.cluster.load import CostMeter
from mooncaked.cluster.member import joined
from mooncaked.cluster.memory import measure_kv_read_bps, memory_info, memory_load
from mooncaked.config import Config
from mooncaked.engine.core import EngineCore
from mooncaked.engine.kv_pool import BlockPool
from mooncaked.engine.offload.server import AttentionServer
from mooncaked.engine.serving import EngineFactory, load_engine, serving_engine
from mooncaked.identity import NodeIdentity, new_generation
from mooncaked.kv_events.service import publishing
from mooncaked.notify import Notifier
from mooncaked.objects.service import ObjectStore, object_store
from mooncaked.process import EXIT_FAILED, EXIT_FORCED, EXIT_OK
from mooncaked.transfer import TransferEngine
from mooncaked.wire.kv_io import TransferKVSegment, TransferOffloadSegments, handoff_ports
from mooncaked.wire.peer_cache import DRAM_SEGMENT, peer_cache


class Node:
    def __init__(
        self,
        config: Config,
        *,
        engine_factory: EngineFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        generation: int | None = None,
    ) -> None:
        """``generation`` (default: now, in ms since the epoch) tells this
        process from the node's earlier ones (``NodeIdentity``)."""
        self._config = config
        # None: the engine is built with its KV cache in a transfer segment.
        self._engine_factory = engine_factory
        self._clock = clock
        generation = generation if generation is not None else new_generation()
        identity = NodeIdentity.of(config.node, port=config.server.port, generation=generation)
        self.lifecycle = Lifecycle(clock, self.stop)
        self.services = Services.build(config, identity, self.lifecycle, clock)
        self.router = self.services.router
        self.api = NodeApi(self.services, clock)
        # The API's listening site (its refused-connection count), while serving.
        self.http_site: CappedTCPSite | None = None
        self._port: int | None = None
        self._transfer: TransferEngine | None = None
        # A memory node's attention service, while it runs.
        self.attention: AttentionServer | None = None
        self._stack: AsyncExitStack | None = None
        self._stop_lock = asyncio.Lock()
        self._log = structlog.get_logger(__name__).bind(node=self.node_id)

    @property
    def config(self) -> Config:
        return self._config

    @property
    def node_id(self) -> str:
        return self.services.node_id

    # Each None before its subsystem runs and after it stopped.
    @property
    def engine(self) -> EngineCore | None:
        return self.services.engine

    @property
    def store(self) -> TieredStore | None:
        return self.services.store

    @property
    def peer_fetcher(self) -> PeerFetcher | None:
        return self.services.peer_fetcher

    @property
    def cluster(self) -> ClusterService | None:
        return self.services.cluster

    @property
    def transfer(self) -> TransferEngine | None:
        return self._transfer

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the node is not listening; call start() first")
        return self._port

    @property
    def url(self) -> str:
        return api_url(self._config, self.port)

    async def start(self) -> None:
        """Enter every subsystem in order; on failure, leaves those entered and raises."""
        if self._stack is not None or self.lifecycle.stopping:
            raise RuntimeError("a Node starts once; build a new one to start again")
        self.lifecycle.start_clock()
        stack = AsyncExitStack()
        self._stack = stack
        try:
            # HTTP first: /health and /ready answer while the model loads.
            await stack.enter_async_context(self._http())
            stack.push_async_callback(self.router.close)
            if self._config.node.role == "memory":
                # No model, no engine: KV and attention for compute nodes
                # (prefill nodes write prompts' KV into it: a transfer segment).
                transfer = await stack.enter_async_context(self._transfer_engine())
                server = await stack.enter_async_context(self._attention_service(transfer))
                await stack.enter_async_context(self._memory_member(server))
                await stack.enter_async_context(self._serving())
                self._log.info("memory node ready", attention=self.attention_address)
                return
            transfer = await stack.enter_async_context(self._transfer_engine())
            # Before the model: it may be an object to fetch from peers first.
            objects = await stack.enter_async_context(self._objects(transfer))
            # Built, not started: the KV cache is laid out after its blocks.
            engine = await stack.enter_async_context(self._model(transfer, objects))
            # Before the step loop runs: every block the engine caches is told.
            await stack.enter_async_context(self._kv_events(engine))
            await stack.enter_async_context(self._kv_cache(engine, transfer))
            # The step loop starts, its KV connector the cache and the handoff.
            await stack.enter_async_context(self._engine_serving(engine, transfer))
            # Gossip last: peers find this node's blocks once it can serve them.
            await stack.enter_async_context(self._cluster_member(engine, transfer))
            await stack.enter_async_context(self._serving())
        except BaseException:
            self._log.error("start-up failed")
            await self._unwind()
            raise
        engine = self.services.engine
        self._log.info("node ready", url=self.url, model=engine.model_name if engine else None)

    async def stop(self) -> None:
        """Drains and leaves every subsystem, newest first. Safe to call twice."""
        async with self._stop_lock:
            await self._unwind()

    async def _unwind(self) -> None:
        self.lifecycle.stopping = True
        stack, self._stack = self._stack, None
        if stack is not None:
            try:
                await stack.aclose()
            except Exception:
                # Every exit ran (the stack goes on past a failing one); say what broke.
                self._log.exception("stop failed")
        self._log.info("node stopped")

    def fail(self, exc: BaseException) -> None:
        """A subsystem died (its task owner logged why): stop being ready, and
        make ``run`` stop the node and exit non-zero. Safe to call any number of times."""
        if self.lifecycle.fail(exc):
            self._log.error("a subsystem failed; the node stops", error=repr(exc))

    @contextlib.asynccontextmanager
    async def _http(self) -> AsyncIterator[None]:
        cfg = self._config
        async with serve_http(cfg, self.services, self.api.routes()) as site:
            self.http_site, self._port = site, site.port
            # The id is final once the port is known (it may name the port).
            self.services.identity = NodeIdentity.of(
                cfg.node, port=site.port, generation=self.services.identity.generation
            )
            self._log = self._log.bind(node=self.node_id)
            self._log.info("listening", url=self.url)
            try:
                yield
            finally:
                self.http_site = None

    @property
    def attention_address(self) -> str:
        """host:port of a memory node's attention service ("" on other roles)."""
        return self.attention.address if self.attention is not None else ""

    @contextlib.asynccontextmanager
    async def _attention_service(self, transfer: TransferEngine) -> AsyncIterator[AttentionServer]:
        cfg = self._config
        async with AttentionServer(
            segments=TransferOffloadSegments(transfer),
            node_id=self.node_id,
            secret=self.services.identity.secret,
            host=cfg.server.host,
            port=cfg.offload.port,
            pool_bytes=cfg.offload.pool_bytes,
        ) as server:
            self.attention = self.services.attention = server
            try:
                yield server
            finally:
                self.attention = self.services.attention = None

    @contextlib.asynccontextmanager
    async def _memory_member(self, server: AttentionServer) -> AsyncIterator[None]:
        """A memory node in gossip: role "memory", its KV use as load, and
        what placement needs (``cluster.memory``). It caches no prefix
        blocks: an empty pool stands for its block index."""
        cfg, s = self._config, self.services
        bps = cfg.offload.kv_read_bps
        if bps <= 0.0:
            # Before joining: placement never sees this node without a rate.
            bps = await asyncio.to_thread(measure_kv_read_bps)
            self._log.info("memory node read bandwidth measured", kv_read_bps=f"{bps:.3g}")
        # Peers reach the attention service on the host they reach the API on.
        address = api_addr(cfg, int(server.address.rpartition(":")[2]))
        async with joined(
            cfg,
            s.identity,
            api_addr=api_addr(cfg, self.port),
            engine=lambda: None,
            draining=lambda: self.lifecycle.draining,
            costs=None,
            pool=BlockPool(1, enable_prefix_caching=False),
            store=None,
            segments=[],
            on_failure=self.fail,
            memory_load=lambda: memory_load(server),
            memory=lambda: memory_info(server, address, bps, cfg.offload.model),
        ) as member:
            s.member = member
            try:
                yield
            finally:
                s.member = None

    @contextlib.asynccontextmanager
    async def _transfer_engine(self) -> AsyncIterator[TransferEngine]:
        identity = self.services.identity
        async with TransferEngine(
            self._config.transfer, identity.node_id, identity.secret, on_failure=self.fail
        ) as transfer:
            self._transfer = self.services.transfer = transfer
            try:
                yield transfer
            finally:
                self._transfer = self.services.transfer = None

    @contextlib.asynccontextmanager
    async def _objects(self, transfer: TransferEngine) -> AsyncIterator[ObjectStore]:
        s = self.services
        async with object_store(
            self._config,
            node_id=lambda: s.node_id,
            secret=s.identity.secret,
            transfer=transfer,
            view=s.cluster_view,
            api_addr=lambda: api_addr(self._config, self.port),
            # Each node draws its own: fetchers that choose at once choose apart.
            rng=random.Random(secrets.randbits(64)),
        ) as store:
            s.objects = store
            try:
                yield store
            finally:
                s.objects = None

    @contextlib.asynccontextmanager
    async def _model(
        self, transfer: TransferEngine, objects: ObjectStore
    ) -> AsyncIterator[EngineCore]:
        config = self._config
        name = config.model.object_name
        if name is not None:
            # Fetched from peers, then loaded from this node's copy as usual.
            path = await objects.materialize(name)
            model = dataclasses.replace(config.model, path=str(path))
            config = dataclasses.replace(config, model=model)
        kv_segment = TransferKVSegment(transfer)
        engine = await load_engine(
            config,
            self.node_id,
            factory=self._engine_factory,
            kv_allocator=kv_segment.allocate,
            clock=self._clock,
        )
        try:
            kv_segment.register(engine.runner.kv_buffer)
            yield engine
        finally:
            # A built engine is closed even if it never starts (its executor).
            await engine.close()

    @contextlib.asynccontextmanager
    async def _kv_events(self, engine: EngineCore) -> AsyncIterator[None]:
        s = self.services
        async with publishing(
            self._config.cluster, engine.pool, block_size=engine.block_size
        ) as events:
            s.kv_events = events
            try:
                yield
            finally:
                s.kv_events = None

    @contextlib.asynccontextmanager
    async def _kv_cache(self, engine: EngineCore, transfer: TransferEngine) -> AsyncIterator[None]:
        s = self.services
        async with peer_cache(
            self._config.store,
            s.identity,
            engine,
            transfer,
            url=self.url,
            view=s.cluster_view,
            on_failure=self.fail,
        ) as pc:
            s.cache, s.holding = pc.cache, pc.holding
            s.desk, s.replicator = pc.desk, pc.replicator
            try:
                yield
            finally:
                # Stop leasing (and taking replicas) first; the cache's exit
                # then lets fetches in flight land (they write into DRAM
                # slots) and closes the store.
                s.cache = s.holding = s.desk = s.replicator = None

    @contextlib.asynccontextmanager
    async def _engine_serving(
        self, engine: EngineCore, transfer: TransferEngine
    ) -> AsyncIterator[None]:
        cfg, s = self._config, self.services
        async with (
            handoff_ports(
                transfer,
                secret=s.identity.secret,
                targets=self.router.target_of,
                watch=self.router.watch,
                pipeline=cfg.pipeline,
                notice=s.stage_client.notify,
            ) as ports,
            serving_engine(
                engine,
                cfg,
                ports,
                node_id=self.node_id,
                cache=s.cache,
                on_fatal=self.fail,
                on_step=self.api.handoff_steps.observe,
                retain=s.replicator.retain if s.replicator is not None else None,
            ) as handoff,
        ):
            s.receiver, s.sender = handoff.receiver, handoff.sender
            costs = CostMeter(engine)
            costs.attach()
            if s.cache is not None:
                s.cache.fetcher.on_read = costs.on_read
            s.costs = costs
            if cfg.conductor.profile:
                await costs.profile()
            s.engine = engine
            try:
                yield
            finally:
                # Aborts what the drain left running; their streams end now.
                s.engine = s.receiver = s.sender = None

    @contextlib.asynccontextmanager
    async def _cluster_member(
        self, engine: EngineCore, transfer: TransferEngine
    ) -> AsyncIterator[None]:
        cfg, s = self._config, self.services
        async with joined(
            cfg,
            s.identity,
            api_addr=api_addr(cfg, self.port),
            engine=lambda: s.engine,
            draining=lambda: self.lifecycle.draining,
            costs=s.costs,
            pool=engine.pool,
            store=s.store,
            # Where peers read this node's DRAM slots from.
            segments=[transfer.descriptor(DRAM_SEGMENT).to_dict()] if s.holding else [],
            on_failure=self.fail,
        ) as member:
            s.member = member
            # Each copy of an object this node serves, advertised with its segments.
            objects = s.objects
            if objects is not None:
                objects.attach(lambda ads: member.set_segments("objects", ads), member.view)
            try:
                yield
            finally:
                if objects is not None:
                    objects.detach()
                s.member = None

    @contextlib.asynccontextmanager
    async def _serving(self) -> AsyncIterator[None]:
        self.lifecycle.set_serving(True)
        try:
            yield
        finally:
            await self._drain()

    async def _drain(self) -> None:
        self.lifecycle.set_serving(False)
        gate = self.lifecycle.gate
        gate.close()
        cluster = self.services.cluster
        if cluster is not None:
            # Announce "draining" now rather than at the next gossip round.
            cluster.refresh_state()
        timeout = self._config.server.drain_timeout_s
        if gate.num_inflight:
            self._log.info("draining", inflight=gate.num_inflight, timeout_s=timeout)
        try:
            await asyncio.wait_for(gate.wait_idle(), timeout)
        except TimeoutError:
            self._log.warning("drain timed out; aborting the rest", inflight=gate.num_inflight)
            return
        engine = self.services.engine
        if engine is not None and engine.failure is None:
            # Idle: a good moment for the pool's self-check.
            try:
                engine.check_integrity()
            except RuntimeError:
                self._log.exception("KV pool integrity check failed at shutdown")
        self._log.info("drained")

    async def run(self, on_ready: Callable[[Node], None] | None = None) -> int:
        """Start, serve until SIGTERM/SIGINT or a subsystem's failure, drain and
        stop; returns the exit status (``EXIT_FAILED`` after a failure).

        A signal during start-up takes effect once start-up finished. A second
        signal exits the process at once with ``EXIT_FORCED``.
        """
        loop = asyncio.get_running_loop()
        stop_requested = self.lifecycle.stop_requested
        self.lifecycle.supervised = True
        notifier = Notifier()

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
            notifier.notify("READY=1", f"STATUS=serving on {self.url}")
            async with asyncio.TaskGroup() as tg:
                watchdog = tg.create_task(notifier.watchdog(lambda: self.lifecycle.failure is None))
                await self.lifecycle.wait_stop()
                watchdog.cancel()
            notifier.notify("STOPPING=1", "STATUS=draining")
            await self.stop()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
        return EXIT_FAILED if self.lifecycle.failure is not None else EXIT_OK
