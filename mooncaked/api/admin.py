"""Operations endpoints: /health, /ready, /metrics and /admin/*.

The handlers read everything from the node they serve, through the small
``AdminNode`` protocol, so this module never imports the daemon. Subsystems
that join the node later add their own part of ``/admin/status`` with
``add_status_section`` and their own routes (``/admin/cluster``,
``/admin/cache/...``) through the node's route list.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from mooncaked.api.metrics import ApiMetrics
from mooncaked.api.openai import json_response
from mooncaked.config import Config

if TYPE_CHECKING:
    from mooncaked.engine.core import EngineCore


def version() -> str:
    try:
        return metadata.version("mooncaked")
    except metadata.PackageNotFoundError:  # run from a source tree
        return "0+unknown"


class AdminNode(Protocol):
    """What the admin handlers need of a node."""

    @property
    def node_id(self) -> str: ...
    @property
    def config(self) -> Config: ...
    @property
    def engine(self) -> EngineCore | None: ...
    @property
    def metrics(self) -> ApiMetrics: ...
    @property
    def ready(self) -> bool: ...
    @property
    def draining(self) -> bool: ...
    @property
    def num_inflight(self) -> int: ...
    def uptime_s(self) -> float: ...


StatusSection = Callable[[], dict[str, Any]]


class AdminAPI:
    def __init__(self, node: AdminNode) -> None:
        self._node = node
        self._sections: dict[str, StatusSection] = {}

    def add_status_section(self, name: str, section: StatusSection) -> None:
        """Adds ``name: section()`` to /admin/status (e.g. "cluster", "store")."""
        if name in self._sections or name in self._base_keys:
            raise ValueError(f"/admin/status already has a section named {name!r}")
        self._sections[name] = section

    _base_keys = frozenset(
        {
            "node_id",
            "model",
            "role",
            "version",
            "uptime_s",
            "ready",
            "draining",
            "load",
            "kv",
            "prefix_cache",
        }
    )

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/health", self.health),
            web.get("/ready", self.ready),
            web.get("/metrics", self.metrics),
            web.get("/admin/status", self.status),
        ]

    async def health(self, request: web.Request) -> web.Response:
        # Alive is all it says: a draining or loading node is still healthy.
        return json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        node = self._node
        if node.draining:
            return json_response({"ready": False, "reason": "draining"}, status=503)
        if not node.ready:
            return json_response({"ready": False, "reason": "loading"}, status=503)
        return json_response({"ready": True})

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(
            body=self._node.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def status(self, request: web.Request) -> web.Response:
        return json_response(self.status_dict())

    def status_dict(self) -> dict[str, Any]:
        node = self._node
        engine = node.engine
        status: dict[str, Any] = {
            "node_id": node.node_id,
            "model": engine.model_name if engine is not None else None,
            "role": node.config.node.role,
            "version": version(),
            "uptime_s": round(node.uptime_s(), 3),
            "ready": node.ready,
            "draining": node.draining,
        }
        if engine is not None:
            s = engine.stats()
            status["load"] = {
                "running": s.num_running,
                "waiting": s.num_waiting,
                "http_inflight": node.num_inflight,
            }
            status["kv"] = {
                "blocks_total": s.kv_num_blocks,
                "blocks_used": s.kv_num_used_blocks,
                "usage": s.kv_usage,
            }
            status["prefix_cache"] = {
                "hit_rate": s.prefix_hit_rate,
                "queried_tokens": s.prefix_queried_tokens,
                "hit_tokens": s.prefix_hit_tokens,
            }
        else:
            status["load"] = {"running": 0, "waiting": 0, "http_inflight": node.num_inflight}
            status["kv"] = None
            status["prefix_cache"] = None
        for name, section in self._sections.items():
            status[name] = section()
        return status
