"""One node's HTTP API: its handlers, their routes and metrics, and the server.

``NodeApi`` builds every handler over the node's ``Services``, adds each
part's status section to /admin/status and each subsystem's metrics through
``ApiMetrics.register``. ``serve_http`` listens with the node's middlewares
while it is entered; leaving it stops listening and gives handlers a short
grace to write their last bytes.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import structlog
from aiohttp import web

from mooncaked.api.admin import AdminAPI, CacheAdmin
from mooncaked.api.auth import auth_middleware
from mooncaked.api.browser import browser_guard_middleware
from mooncaked.api.conductor_api import ConductorAPI, ConductorCollector
from mooncaked.api.disagg import DisaggAPI
from mooncaked.api.handoff_status import HandoffStatus, StepHistograms
from mooncaked.api.internal import InternalAPI
from mooncaked.api.limits import BODY_TIMEOUT_S
from mooncaked.api.metrics import (
    CLUSTER_METRICS,
    ENGINE_METRICS,
    KV_EVENTS_METRICS,
    SnapshotMetrics,
)
from mooncaked.api.middleware import api_middleware
from mooncaked.api.objects import ObjectsAPI
from mooncaked.api.offload_status import OffloadStatus
from mooncaked.api.openai import OpenAIAPI
from mooncaked.api.pipeline import PipelineAPI
from mooncaked.api.recent import RecentRequests
from mooncaked.api.replicas import ReplicaAPI
from mooncaked.api.server import (
    CappedTCPSite,
    reserve_middleware,
    server_kwargs,
    with_expect_handler,
)
from mooncaked.api.services import Services
from mooncaked.api.store_admin import StoreAdmin
from mooncaked.api.ui import ui_routes
from mooncaked.cluster.routes import cluster_routes
from mooncaked.config import Config
from mooncaked.secrets import is_loopback

# Handlers still writing when the server stops get this long (seconds) before
# their connections are closed; by then the engine has ended their streams.
_HTTP_SHUTDOWN_GRACE_S = 2.0
# Largest request body accepted (a long prompt as JSON token ids).
_MAX_BODY_BYTES = 64 * 1024 * 1024

# Listen addresses that name no single interface, so no use to a peer.
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})

log = structlog.get_logger(__name__)


def api_url(config: Config, port: int) -> str:
    """The URL this node's API listens at."""
    return f"http://{_bracketed(config.server.host)}:{port}"


def api_addr(config: Config, port: int) -> str:
    """host:port other nodes reach this node's API at (announced by gossip)."""
    host = config.server.host
    if host in _WILDCARD_HOSTS:
        # Listening everywhere: the gossip address is one peers reach.
        host = config.cluster.gossip_host
        if host in _WILDCARD_HOSTS:
            host = socket.gethostname()
    return f"{_bracketed(host)}:{port}"


def _bracketed(host: str) -> str:
    # An IPv6 address in a URL or host:port is written in brackets.
    return f"[{host}]" if ":" in host else host


class NodeApi:
    """Every handler of one node; each answers 503 (or reports nothing) for a
    part of the node that is not running yet."""

    def __init__(self, services: Services, clock: Callable[[], float]) -> None:
        s = services
        self._services = s
        self.openai = OpenAIAPI(
            lambda: s.engine, s.metrics, s.lifecycle.gate, clock, router=s.router
        )
        self.admin = AdminAPI(s)
        self.cache = CacheAdmin(s)
        self.store = StoreAdmin(s)
        self.internal = InternalAPI(
            secret=s.identity.secret,
            node_id=lambda: s.node_id,
            generation=s.identity.generation,
            holding=lambda: s.holding,
        )
        # A replica put's holder side: inbox rows, checked commits, drops.
        self.replicas = ReplicaAPI(
            secret=s.identity.secret,
            node_id=lambda: s.node_id,
            generation=s.identity.generation,
            desk=lambda: s.desk,
            is_member=s.is_up_member,
        )
        # Named objects: /admin/objects... and the swarm calls to an origin.
        self.objects = ObjectsAPI(lambda: s.objects, self.internal.verifier)
        # The status page at /ui and the finished requests it lists.
        self.recent_requests = RecentRequests(lambda: s.node_id)
        self.openai.finished_listeners.append(self.recent_requests.add)
        # Disaggregated serving: the decode node's and the prefill node's calls.
        # A stage of a pipelined prefill group: its calls, and its head's run.
        self.pipeline = PipelineAPI(
            secret=s.identity.secret,
            node_id=lambda: s.node_id,
            generation=s.identity.generation,
            config=s.config.pipeline,
            block_size=s.config.kv.block_size,
            engine=lambda: s.engine,
            draining=lambda: s.lifecycle.draining,
            client=s.stage_client,
            step_cost=lambda: s.costs.costs().step if s.costs is not None else None,
            watch=s.router.watch,
            fetcher=lambda: s.peer_fetcher,
        )
        self.disagg = DisaggAPI(
            secret=s.identity.secret,
            node_id=lambda: s.node_id,
            generation=s.identity.generation,
            role=s.config.node.role,
            engine=lambda: s.engine,
            sender=lambda: s.sender,
            draining=lambda: s.lifecycle.draining,
            queue_s=s.queue_s,
            pipeline=self.pipeline,
        )
        self.handoff = HandoffStatus(s)
        # The sender's per-step observer.
        self.handoff_steps = StepHistograms()
        # The Conductor: /admin/explain, its status section and its counters.
        self.conductor = ConductorAPI(s)
        self.admin.add_status_section("store", self.cache.status_section)
        self.admin.add_status_section("cluster", s.cluster_status)
        self.admin.add_status_section("handoff", self.handoff.status_section)
        self.admin.add_status_section("conductor", self.conductor.status_section)
        self.admin.add_status_section("pipeline", self.pipeline.status_section)
        self.admin.add_status_section("objects", self.objects.status_section)
        self.admin.add_status_section("kv_events", s.kv_events_status)
        self.offload = OffloadStatus(s)
        self.admin.add_status_section("offload", self.offload.status_section)
        for source in (
            SnapshotMetrics(s.engine_stats, ENGINE_METRICS),
            self.cache.metrics_source(),
            SnapshotMetrics(s.cluster_snapshot, CLUSTER_METRICS),
            self.handoff.metrics_source(),
            ConductorCollector(s),
            self.handoff_steps,
            self.pipeline.metrics_source(),
            SnapshotMetrics(s.kv_events_stats, KV_EVENTS_METRICS),
            self.offload,
        ):
            s.metrics.register(source)

    def routes(self) -> list[web.RouteDef]:
        s = self._services
        return [
            *self.admin.routes(),
            *self.openai.routes(),
            *self.cache.routes(),
            *self.store.routes(),
            *self.internal.routes(),
            *self.replicas.routes(),
            # /admin/cluster, /admin/cluster/prefix (and the test hooks when
            # ``cluster.test_hooks``).
            *cluster_routes(lambda: s.cluster, test_hooks=s.config.cluster.test_hooks),
            *self.recent_requests.routes(),
            *ui_routes(),
            *self.disagg.routes(),
            *self.pipeline.routes(),
            *self.conductor.routes(),
            *self.objects.routes(),
        ]


@contextlib.asynccontextmanager
async def serve_http(
    config: Config, services: Services, routes: list[web.RouteDef]
) -> AsyncIterator[CappedTCPSite]:
    """Listens on ``server.host``/``server.port`` while entered; yields the site."""
    cfg = config.server
    site: CappedTCPSite | None = None
    app = web.Application(
        # Outermost first: every answer is counted, a 401 included; a
        # connection in the reserve is turned away before anything else.
        middlewares=[
            api_middleware(services.metrics),
            reserve_middleware(lambda: site, cfg.admin_token),
            browser_guard_middleware(cfg, node_hosts=(config.cluster.gossip_host,)),
            auth_middleware(cfg),
        ],
        client_max_size=_MAX_BODY_BYTES,
    )
    app[BODY_TIMEOUT_S] = cfg.body_timeout_s
    app.add_routes(with_expect_handler(routes))
    # handler_cancellation: a client that disconnects cancels its handler,
    # whose finally aborts the request in the engine.
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=_HTTP_SHUTDOWN_GRACE_S,
        **server_kwargs(cfg.idle_timeout_s),
    )
    await runner.setup()
    try:
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
        if not is_loopback(cfg.host) and not cfg.api_keys:
            log.warning(
                "listening beyond loopback with no API key: /v1 is open to anyone who "
                "reaches it; set server.api_keys, --api-key or MOONCAKED_API_KEY",
                host=cfg.host,
                port=site.port,
            )
        yield site
    finally:
        site = None
        await runner.cleanup()
