"""Node: one mooncaked daemon, owner of every subsystem's lifecycle.

Each subsystem is an async context manager its own package provides (the
transfer engine, the KV cache, the engine, the cluster membership); the node
enters them in order on one ``AsyncExitStack``. If one fails to start, those
entered already are left in reverse and the error propagates; ``stop()``
leaves every one, newest first.

Start order: HTTP (so /health answers while the model loads), the transfer
engine (``[transfer]``), the model (the engine is built, not started), the KV
cache (tiered store with its DRAM pool in a transfer segment peers can read,
lease desk, peer fetcher), the engine (its KV connector is the cache; the
step loop starts), the cluster membership (gossip on ``[cluster]``: join the
seeds, publish this node's state, its DRAM segment and every block event;
peer fetches then find holders through the cluster-wide block index), and
serving.

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
5. transfer: close the transfer engine, withdrawing the DRAM segment.
6. HTTP: stop listening, then give handlers a short grace to write their
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
import os
import random
import secrets
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import structlog
import torch
from aiohttp import web

from mooncaked.api.admin import AdminAPI, CacheAdmin
from mooncaked.api.auth import auth_middleware
from mooncaked.api.browser import browser_guard_middleware
from mooncaked.api.conductor_api import ConductorAPI, ConductorCollector
from mooncaked.api.disagg import DisaggAPI
from mooncaked.api.gate import Gate
from mooncaked.api.handoff_status import HANDOFF_METRICS, HandoffStatus, StepHistograms
from mooncaked.api.internal import InternalAPI
from mooncaked.api.limits import BODY_TIMEOUT_S
from mooncaked.api.metrics import ApiMetrics
from mooncaked.api.middleware import api_middleware
from mooncaked.api.openai import OpenAIAPI
from mooncaked.api.recent import RecentRequests
from mooncaked.api.server import (
    CappedTCPSite,
    reserve_middleware,
    server_kwargs,
    with_expect_handler,
)
from mooncaked.api.ui import ui_routes
from mooncaked.cache.dram import BlockLayout
from mooncaked.cache.peer import LeaseDesk, PeerFetcher, ReaderKind
from mooncaked.cache.service import KVCache
from mooncaked.cache.store import TieredStore
from mooncaked.cluster.gossip.service import ClusterService
from mooncaked.cluster.holders import ClusterHolders
from mooncaked.cluster.load import CostMeter, LoadMeter
from mooncaked.cluster.member import ClusterMember
from mooncaked.cluster.routes import cluster_routes
from mooncaked.cluster.state import ClusterView
from mooncaked.cluster.status import ClusterSnapshot
from mooncaked.config import Config, ConfigError
from mooncaked.engine.connector import KVConnector, MultiConnector
from mooncaked.engine.core import EngineCore, EngineStats
from mooncaked.engine.kv_receiver import KVReceiver
from mooncaked.engine.kv_sender import KVSender
from mooncaked.engine.store_connector import TieredStoreConnector
from mooncaked.notify import Notifier
from mooncaked.router import Router
from mooncaked.rpc import Target
from mooncaked.secrets import is_loopback
from mooncaked.transfer import Access, TransferEngine
from mooncaked.wire.kv_io import TransferBlockReader, TransferKVWriter, TransferWriteGrants
from mooncaked.wire.lease import Holding, LeaseClient
from mooncaked.wire.prefill import PrefillClient

EngineFactory = Callable[[Config], EngineCore]

# Exit status after a subsystem failed while serving (as for a failed start-up).
EXIT_FAILED = 1
# Exit status when a second signal cuts a drain short.
EXIT_FORCED = 3
# Handlers still writing when the server stops get this long (seconds) before
# their connections are closed; by then the engine has ended their streams.
_HTTP_SHUTDOWN_GRACE_S = 2.0
# Largest request body accepted (a long prompt as JSON token ids).
_MAX_BODY_BYTES = 64 * 1024 * 1024
# The transfer segment the DRAM tier's slots live in; peers read it.
DRAM_SEGMENT = "kv.dram"
# The transfer segment the device KV cache lives in (CPU) or is reached
# through (CUDA); prefill nodes write prompts' KV into its granted blocks.
KV_SEGMENT = "kv.device"
# The engine waits this much longer for a peer fetch than the fetcher's own
# bound, so the fetcher gives up (and counts it) first.
_PREFETCH_GRACE_S = 0.5
# Listen addresses that name no single interface, so no use to a peer.
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


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
        process from the node's earlier ones: gossip orders restarts by it,
        and node-to-node calls are signed for it."""
        self._config = config
        self.generation = generation if generation is not None else time.time_ns() // 1_000_000
        if self.generation <= 0:
            raise ValueError(f"generation must be > 0, got {self.generation}")
        # None: the engine is built with its KV cache in a transfer segment.
        self._engine_factory = engine_factory
        self._clock = clock
        self._started_at = clock()
        self._engine: EngineCore | None = None
        self._transfer: TransferEngine | None = None
        self._cache: KVCache | None = None
        self._holding: Holding | None = None
        self._peer_urls: tuple[str, ...] = ()
        self._member: ClusterMember | None = None
        self._ready = False
        self._failure: BaseException | None = None
        self._failed = asyncio.Event()
        self._runner: web.AppRunner | None = None
        # The API's listening site (its refused-connection count), while serving.
        self.http_site: CappedTCPSite | None = None
        self._port: int | None = None
        self._stack: AsyncExitStack | None = None
        self._stopping = False
        self._stop_lock = asyncio.Lock()
        self._log = structlog.get_logger(__name__).bind(node=self.node_id)

        self._sender: KVSender | None = None
        self._receiver: KVReceiver | None = None
        self._stop_requested = asyncio.Event()
        self._running = False
        self._drain_task: asyncio.Future[None] | None = None

        self.gate = Gate()
        # The engine's cost model (cluster/costs.py, fitted by cluster/fit.py), once it runs.
        self.costs: CostMeter | None = None
        self.metrics = ApiMetrics(self._engine_stats)
        secret = config.node.cluster_secret.encode()
        self.router = Router(
            node_id=lambda: self.node_id,
            secret=secret,
            engine=lambda: self._engine,
            view=self._cluster_view,
            clock=clock,
            conductor=config.conductor,
            slo=config.slo,
            block_size=config.kv.block_size,
            # Each entry draws its own: entries that share a view must not
            # make the same choice among near-equal nodes.
            rng=random.Random(secrets.randbits(64)),
        )
        self.openai = OpenAIAPI(
            lambda: self._engine, self.metrics, self.gate, clock, router=self.router
        )
        self.admin = AdminAPI(self)
        # Routes of subsystems added later (/admin/cluster, /admin/cache/...);
        # append before start().
        self.extra_routes: list[web.RouteDef] = []
        self._add_cache_endpoints()
        self._add_cluster_endpoints()
        # The status page at /ui and the finished requests it lists.
        self.recent_requests = RecentRequests(lambda: self.node_id)
        self.openai.finished_listeners.append(self.recent_requests.add)
        self.extra_routes.extend([*self.recent_requests.routes(), *ui_routes()])
        # Disaggregated serving: the decode node's and the prefill node's calls.
        self.disagg = DisaggAPI(
            secret=secret,
            node_id=lambda: self.node_id,
            generation=self.generation,
            role=config.node.role,
            engine=lambda: self._engine,
            sender=lambda: self._sender,
            draining=lambda: self.draining,
            queue_s=lambda: self.costs.queue_s() if self.costs is not None else 0.0,
        )
        self.extra_routes.extend(self.disagg.routes())
        # The handoff's counters: the "handoff" status section and its metrics.
        self.handoff_status = HandoffStatus(
            receiver=lambda: self._receiver,
            sender=lambda: self._sender,
            transfer=lambda: self._transfer,
        )
        self.admin.add_status_section("handoff", self.handoff_status.status_section)
        self.metrics.add_collector(self.handoff_status.snapshot, HANDOFF_METRICS)
        # The Conductor: /admin/explain, its status section and its counters.
        self.conductor_api = ConductorAPI(self.router, lambda: self._engine, lambda: self.costs)
        self.extra_routes.extend(self.conductor_api.routes())
        self.admin.add_status_section("conductor", self.conductor_api.status_section)
        self.metrics.registry.register(ConductorCollector(self.router, lambda: self.costs))
        self.handoff_steps = StepHistograms(self.metrics.registry)

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
        return self._ready and not self.gate.closed and self._failure is None

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
        """The tiered KV cache (DRAM, SSD); None before it starts and after stop."""
        return self._cache.store if self._cache is not None else None

    @property
    def transfer(self) -> TransferEngine | None:
        return self._transfer

    @property
    def peer_fetcher(self) -> PeerFetcher | None:
        return self._cache.fetcher if self._cache is not None else None

    @property
    def lease_desk(self) -> LeaseDesk | None:
        return self._cache.desk if self._cache is not None else None

    @property
    def cluster(self) -> ClusterService | None:
        """The gossip subsystem; None before it starts and after stop."""
        return self._member.service if self._member is not None else None

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

    async def start(self) -> None:
        """Enter every subsystem in order; on failure, leaves those entered and raises."""
        if self._stack is not None or self._stopping:
            raise RuntimeError("a Node starts once; build a new one to start again")
        self._started_at = self._clock()
        stack = AsyncExitStack()
        self._stack = stack
        try:
            # HTTP first: /health and /ready answer while the model loads.
            await stack.enter_async_context(self._http())
            stack.push_async_callback(self.router.close)
            transfer = await stack.enter_async_context(
                TransferEngine(
                    self._config.transfer,
                    self.node_id,
                    self._config.node.cluster_secret.encode(),
                    on_failure=self.fail,
                )
            )
            self._transfer = transfer
            stack.callback(self._forget, "_transfer")
            engine = await self._build_engine(transfer)
            # A built engine is closed even if it never starts (its executor).
            stack.push_async_callback(engine.close)
            await stack.enter_async_context(self._kv_cache(engine, transfer))
            await stack.enter_async_context(self._engine_serving(engine, transfer))
            await stack.enter_async_context(self._cluster_member(engine, transfer))
            await stack.enter_async_context(self._serving())
        except BaseException:
            self._log.error("start-up failed")
            await self._unwind()
            raise
        self._log.info("node ready", url=self.url, model=self._engine_name())

    async def stop(self) -> None:
        """Drains and leaves every subsystem, newest first. Safe to call twice."""
        async with self._stop_lock:
            await self._unwind()

    async def _unwind(self) -> None:
        self._stopping = True
        stack, self._stack = self._stack, None
        if stack is not None:
            try:
                await stack.aclose()
            except Exception:
                # Every exit ran (the stack goes on past a failing one); say what broke.
                self._log.exception("stop failed")
        self._log.info("node stopped")

    def _forget(self, attr: str) -> None:
        setattr(self, attr, None)

    def fail(self, exc: BaseException) -> None:
        """A subsystem died (its traceback is logged by its task owner): stop
        being ready and make ``run`` stop the node and exit non-zero, so a
        supervisor restarts it. Safe to call from any subsystem, any number of
        times."""
        if self._failure is not None:
            return
        self._failure = exc
        self._ready = False
        self._log.error("a subsystem failed; the node stops", error=repr(exc))
        self._failed.set()

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def requests_in_flight(self) -> list[dict[str, Any]]:
        """This node's requests: as entry (``role`` "entry", nodes named) and as
        the engine running them (``role`` "engine", with its phase here)."""
        out: list[dict[str, Any]] = [
            {**r, "role": "entry"} for r in self.router.requests_in_flight()
        ]
        engine = self._engine
        if engine is not None:
            me = self.node_id
            for r in engine.requests_in_flight():
                out.append({**r, "role": "engine", "decode_node": me})
        return out

    def request_drain(self) -> bool:
        """Start the drain and stop of this node (as SIGTERM); False if it had begun."""
        if self._stop_requested.is_set() or self._stopping:
            return False
        self._stop_requested.set()
        if not self._running:
            # Not under run(): stop in the background, as run() would.
            self._drain_task = asyncio.ensure_future(self.stop())
        return True

    def _engine_name(self) -> str | None:
        return self._engine.model_name if self._engine is not None else None

    @contextlib.asynccontextmanager
    async def _http(self) -> AsyncIterator[None]:
        server = self._config.server
        app = web.Application(
            # Outermost first: every answer is counted, a 401 included; a
            # connection in the reserve is turned away before anything else.
            middlewares=[
                api_middleware(self.metrics),
                reserve_middleware(lambda: self.http_site, server.admin_token),
                browser_guard_middleware(server, node_hosts=(self._config.cluster.gossip_host,)),
                auth_middleware(server),
            ],
            client_max_size=_MAX_BODY_BYTES,
        )
        app[BODY_TIMEOUT_S] = self._config.server.body_timeout_s
        app.add_routes(
            with_expect_handler([*self.admin.routes(), *self.openai.routes(), *self.extra_routes])
        )
        # handler_cancellation: a client that disconnects cancels its handler,
        # whose finally aborts the request in the engine.
        runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=_HTTP_SHUTDOWN_GRACE_S,
            **server_kwargs(self._config.server.idle_timeout_s),
        )
        await runner.setup()
        try:
            cfg = self._config.server
            site = CappedTCPSite(
                runner,
                cfg.host,
                cfg.port,
                max_connections=cfg.max_connections,
                max_connections_per_client=cfg.max_connections_per_client,
                reserved_connections=cfg.reserved_connections,
                reuse_address=True,
            )
            await site.start()
            self.http_site = site
            self._runner = runner
            self._port = _bound_port(runner, cfg.port)
            self._log = self._log.bind(node=self.node_id)
            self._log.info("listening", url=self.url)
            if not is_loopback(cfg.host) and not cfg.api_keys:
                self._log.warning(
                    "listening beyond loopback with no API key: /v1 is open to anyone who "
                    "reaches it; set server.api_keys, --api-key or MOONCAKED_API_KEY",
                    host=cfg.host,
                )
            yield
        finally:
            self._runner = None
            self.http_site = None
            await runner.cleanup()

    async def _build_engine(self, transfer: TransferEngine) -> EngineCore:
        self._log.info("loading model", path=self._config.model.path)
        t0 = self._clock()
        factory = self._engine_factory
        if factory is None:

            def factory(config: Config) -> EngineCore:
                return EngineCore(config, kv_allocator=kv_allocator)

            def kv_allocator(nbytes: int, device: torch.device) -> torch.Tensor:
                if device.type != "cpu":
                    # Device memory: registered after the build, reached
                    # through a pinned bounce buffer (or RDMA).
                    return torch.zeros(nbytes, dtype=torch.uint8, device=device)
                # The KV cache in shared memory the transfer engine exposes:
                # prefill nodes write a prompt's KV straight into its blocks
                # (over shm on this host, tcp or rdma elsewhere).
                # Peers write into it only blocks granted to them (Access.GRANTED).
                segment = transfer.allocate(KV_SEGMENT, nbytes, Access.GRANTED)
                return torch.frombuffer(segment.view.cast("B"), dtype=torch.uint8)

        # Loading reads weights and builds tensors for seconds or minutes:
        # off the loop, so /health keeps answering meanwhile.
        try:
            engine = await asyncio.to_thread(factory, self._config)
        except ValueError as exc:
            # The loader's ValueErrors name a bad setting (a missing model
            # directory, max_model_len beyond the model's limit): a config error.
            raise ConfigError(str(exc)) from None
        if transfer.segment(KV_SEGMENT) is None:
            # Device memory, or an engine built by a custom factory: reachable
            # over tcp (through a bounce buffer for device memory).
            transfer.register(
                KV_SEGMENT, engine.runner.kv_buffer.view(-1).view(torch.uint8), Access.GRANTED
            )
        self._log.info("model loaded", load_s=round(self._clock() - t0, 3))
        return engine

    @contextlib.asynccontextmanager
    async def _engine_serving(
        self, engine: EngineCore, transfer: TransferEngine
    ) -> AsyncIterator[None]:
        cfg = self._config
        secret = cfg.node.cluster_secret.encode()
        async with contextlib.AsyncExitStack() as stack:
            prefill_client = await stack.enter_async_context(
                PrefillClient(
                    secret=secret,
                    timeout_s=cfg.disagg.grant_ttl_s,
                    targets=self.router.target_of,
                    watch=self.router.watch,
                )
            )
            layout = engine.runner.kv_layout
            receiver = KVReceiver(
                node_id=self.node_id,
                transfer_address=transfer.address,
                segment=KV_SEGMENT,
                layout=layout,
                prefill=prefill_client.prefill,
                grant_ttl_s=cfg.disagg.grant_ttl_s,
                write_grants=TransferWriteGrants(transfer),
            )
            sender = KVSender(
                TransferKVWriter(transfer, self.router.watch),
                segment=KV_SEGMENT,
                layout=layout,
                loop=asyncio.get_running_loop(),
                layerwise=cfg.disagg.layerwise,
                on_step=self.handoff_steps.observe,
            )
            # The handoff first: a request whose KV comes from a prefill node
            # takes all of it from there, not part from the host tiers.
            connectors: list[KVConnector] = [receiver]
            if self._cache is not None:
                cache = self._cache
                # A request waits for a prefetch only when the fetcher would
                # ask someone (a holder in the index, or configured peers).
                connectors.append(
                    TieredStoreConnector(
                        cache.store,
                        prefetch=cache.fetcher.fetch,
                        prefetch_timeout_s=cfg.store.peer_fetch_timeout_s + _PREFETCH_GRACE_S,
                        prefetch_wanted=cache.fetcher.would_ask,
                    )
                )
            connectors.append(sender)
            self._receiver, self._sender = receiver, sender
            async with engine.serving(on_fatal=self.fail, connector=MultiConnector(connectors)):
                costs = CostMeter(engine)
                costs.attach()
                if self._cache is not None:
                    self._cache.fetcher.on_read = costs.on_read
                self.costs = costs
                if cfg.conductor.profile:
                    await costs.profile()
                self._engine = engine
                self._log.info(
                    "engine started",
                    model=engine.model_name,
                    max_model_len=engine.max_model_len,
                    role=cfg.node.role,
                )
                try:
                    yield
                finally:
                    # Aborts what the drain left running; their streams end now.
                    self._engine = None
                    self._receiver = self._sender = None

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
            generation=self.generation,
            holding=lambda: self._holding,
        )
        self.extra_routes.extend(self.internal.routes())

    @contextlib.asynccontextmanager
    async def _kv_cache(self, engine: EngineCore, transfer: TransferEngine) -> AsyncIterator[None]:
        cfg = self._config.store
        layout = BlockLayout.from_kv_caches(engine.runner.kv_caches)
        num_slots = TieredStore.dram_slots_for(cfg, layout)
        backing = None
        if num_slots:
            # Shared memory registered with the transfer engine: peers read the
            # slots they lease, over shm when on this host, else tcp or rdma.
            # Read-only to peers: they fetch from it, none may write (a write
            # would be served to clients as cached KV).
            backing = transfer.allocate(
                DRAM_SEGMENT, num_slots * layout.block_bytes, Access.READ
            ).view
        # A node listed among its own peers would only ever miss.
        self._peer_urls = tuple(u for u in cfg.peers if u.rstrip("/") != self.url)
        async with contextlib.AsyncExitStack() as stack:
            client = await stack.enter_async_context(
                LeaseClient(
                    secret=self._config.node.cluster_secret.encode(),
                    node_id=lambda: self.node_id,
                    block_bytes=layout.block_bytes,
                    layout=layout.fingerprint(),
                    targets=self._target_at,
                )
            )
            cache = await stack.enter_async_context(
                KVCache(
                    cfg,
                    layout,
                    client=client,
                    reader=TransferBlockReader(transfer, DRAM_SEGMENT),
                    # Holders from the cluster's block index once gossip runs;
                    # the configured peers when it names nobody (or before).
                    locator=ClusterHolders(self._cluster_view, static=self._peer_urls),
                    device_prefix=lambda hashes: len(engine.pool.longest_cached_prefix(hashes)),
                    dram_backing=backing,
                    on_failure=self.fail,
                    classify_reader=self._classify_reader,
                )
            )
            self._cache = cache
            if num_slots:
                self._holding = Holding(
                    desk=cache.desk,
                    block_bytes=layout.block_bytes,
                    layout=layout.fingerprint(),
                    segment=transfer.descriptor(DRAM_SEGMENT),
                    transfer_address=transfer.address,
                )
            self._log.info(
                "store started",
                dram_slots=num_slots,
                ssd=cfg.ssd_path or None,
                peers=len(self._peer_urls),
                transfer=transfer.address,
            )
            try:
                yield
            finally:
                # Stop leasing first; the cache's exit then lets fetches in
                # flight land (they write into DRAM slots) and closes the store.
                self._holding = None
                self._cache = None

    # -------------------------------------------------------------- cluster

    def _add_cluster_endpoints(self) -> None:
        """/admin/cluster, /admin/cluster/prefix (and the test hooks when
        ``cluster.test_hooks``), the "cluster" status section and gossip
        metrics; all answer 503 (or report nothing) until gossip runs."""
        self.extra_routes.extend(
            cluster_routes(lambda: self.cluster, test_hooks=self._config.cluster.test_hooks)
        )
        self.admin.add_status_section("cluster", self._cluster_status)
        self.metrics.add_cluster_collector(self._cluster_snapshot)

    def _cluster_view(self) -> ClusterView | None:
        member = self._member
        return member.view if member is not None else None

    def _classify_reader(self, reader: str) -> ReaderKind:
        """How this node's lease desk counts the reader a signed lookup names.

        Any holder of the secret can sign any name, so a name gets a lease cap
        of its own only when the view knows it as an up member; every other
        name (a node reading through ``store.peers`` without gossip, a member
        gossip has not brought yet, a made-up one) shares the outsiders' cap.
        """
        if reader == self.node_id:
            return ReaderKind.REFUSED
        view = self._cluster_view()
        member = view.get(reader) if view is not None else None
        return ReaderKind.MEMBER if member is not None and member.is_up else ReaderKind.OUTSIDER

    def _target_at(self, url: str) -> Target | None:
        """What a call to the node at ``url`` is signed for, if the view knows it."""
        view = self._cluster_view()
        if view is None:
            return None
        member = view.member_at(url.removeprefix("http://").rstrip("/"))
        return None if member is None else Target(member.node_id, member.generation)

    def _cluster_snapshot(self) -> ClusterSnapshot | None:
        member = self._member
        return member.snapshot() if member is not None else None

    def _cluster_status(self) -> dict[str, Any] | None:
        snap = self._cluster_snapshot()
        return None if snap is None else snap.status()

    @contextlib.asynccontextmanager
    async def _cluster_member(
        self, engine: EngineCore, transfer: TransferEngine
    ) -> AsyncIterator[None]:
        cfg = self._config
        meter = LoadMeter(
            role=cfg.node.role,
            api_addr=self.api_addr,
            engine=lambda: self._engine,
            draining=lambda: self.draining,
            clock=time.monotonic,
            costs=self.costs,
        )
        # Where peers read this node's DRAM slots from.
        segments = [transfer.descriptor(DRAM_SEGMENT).to_dict()] if self._holding else []
        member = ClusterMember(
            cfg.cluster,
            self.node_id,
            cfg.node.cluster_secret.encode(),
            meter=meter,
            pool=engine.pool,
            store=self.store,
            segments=segments,
            generation=self.generation,
            on_failure=self.fail,
        )
        async with member:
            self._member = member
            self._log.info(
                "cluster joined",
                gossip=f"{cfg.cluster.gossip_host}:{member.service.gossip_port}",
                seeds=len(cfg.cluster.seeds),
                seeds_answered=member.num_seeds_answered,
                api=self.api_addr,
            )
            try:
                yield
            finally:
                self._member = None

    # -------------------------------------------------------------- serving

    @contextlib.asynccontextmanager
    async def _serving(self) -> AsyncIterator[None]:
        self._ready = True
        try:
            yield
        finally:
            await self._drain()

    async def _drain(self) -> None:
        self._ready = False
        self.gate.close()
        member = self._member
        if member is not None:
            # Announce "draining" now rather than at the next gossip round.
            member.service.refresh_state()
        timeout = self._config.server.drain_timeout_s
        if self.gate.num_inflight:
            self._log.info("draining", inflight=self.gate.num_inflight, timeout_s=timeout)
        try:
            await asyncio.wait_for(self.gate.wait_idle(), timeout)
        except TimeoutError:
            self._log.warning("drain timed out; aborting the rest", inflight=self.gate.num_inflight)
            return
        engine = self._engine
        if engine is not None and engine.failure is None:
            # Idle: a good moment for the pool's self-check.
            try:
                engine.check_integrity()
            except RuntimeError:
                self._log.exception("KV pool integrity check failed at shutdown")
        self._log.info("drained")

    # -------------------------------------------------------------- signals

    async def run(self, on_ready: Callable[[Node], None] | None = None) -> int:
        """Start, serve until SIGTERM/SIGINT or a subsystem's failure, drain and
        stop; returns the exit status (``EXIT_FAILED`` after a failure).

        A signal during start-up takes effect once start-up finished. A second
        signal exits the process at once with ``EXIT_FORCED``.
        """
        loop = asyncio.get_running_loop()
        stop_requested = self._stop_requested
        self._running = True
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
                waits = [
                    tg.create_task(stop_requested.wait()),
                    tg.create_task(self._failed.wait()),
                ]
                watchdog = None
                if notifier.watchdog_interval_s is not None:
                    watchdog = tg.create_task(
                        self._watchdog(notifier, notifier.watchdog_interval_s)
                    )
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for t in [*waits, watchdog]:
                    if t is not None:
                        t.cancel()
            notifier.notify("STOPPING=1", "STATUS=draining")
            await self.stop()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
        return EXIT_FAILED if self._failure is not None else 0

    async def _watchdog(self, notifier: Notifier, interval_s: float) -> None:
        """Pings systemd's watchdog while no subsystem failed. The pings run on
        the event loop, so a loop stalled by a step stops them too and systemd
        restarts the daemon."""
        while self._failure is None:
            notifier.notify("WATCHDOG=1")
            await asyncio.sleep(interval_s)


def _bound_port(runner: web.AppRunner, configured: int) -> int:
    # With port 0 the OS picks one; read it back from the listening socket.
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            return int(addr[1])
    return configured
