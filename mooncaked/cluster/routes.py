"""HTTP routes of the cluster subsystem, for the daemon's (or the gossip node's) app.

- ``GET /admin/cluster``: ``ClusterView.to_json()``, what ``mooncakectl nodes``
  and ``mooncakectl cluster`` render.
- ``POST /admin/cluster/prefix`` ``{"hashes": [hex, ...], "tiers": [name, ...]}``:
  ``longest_prefix`` per node, for operators checking where a prompt's blocks
  live; ``tiers`` (optional, default all) counts only blocks in those tiers,
  e.g. ``["dram", "ssd"]`` for what peers can lease.

The routes take the service itself, or a function returning it (None while
it is not running: the routes answer 503 then), so a daemon can add them
before its cluster subsystem starts.

With ``test_hooks`` (off unless a flag asks for them; never in production):

- ``POST /admin/test/blocks`` ``{"stored": [hex], "removed": [hex], "tier": "dram"}``
  publishes fake block events as the KV cache would.
- ``POST /admin/test/drop_peers`` ``{"peers": [node id, ...]}`` drops all gossip
  traffic to and from those peers (``[]`` heals), to stage a partition.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from mooncaked.bounds import read_json_object
from mooncaked.cache.hashing import parse_hex_hashes
from mooncaked.cluster.block_index import ALL_TIERS_MASK, BlockOp, tier_mask
from mooncaked.cluster.gossip.service import ClusterService, DropPeers

_MAX_HASHES = 1 << 20


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _bad(message: str) -> web.Response:
    return _json({"error": {"message": message, "type": "invalid_request_error"}}, status=400)


async def _body(request: web.Request) -> dict[str, Any]:
    # A BadBody (a ValueError) for JSON that does not decode or nests too deep.
    return await read_json_object(request)


def _hashes(data: dict[str, Any], key: str) -> list[bytes]:
    return parse_hex_hashes(data.get(key, []), key, _MAX_HASHES)


def _tiers(data: dict[str, Any]) -> int:
    raw = data.get("tiers")
    if raw is None:
        return ALL_TIERS_MASK
    if not isinstance(raw, list) or not raw or not all(isinstance(t, str) for t in raw):
        raise ValueError("'tiers' must be a non-empty list of tier names (device, dram, ssd)")
    return tier_mask(*raw)


def _unavailable() -> web.Response:
    return _json(
        {
            "error": {
                "message": "the cluster subsystem is not running (starting or stopping)",
                "type": "unavailable",
            }
        },
        status=503,
    )


ServiceRef = ClusterService | Callable[[], ClusterService | None]


# A route's handler, given the running service.
ServiceHandler = Callable[[web.Request, ClusterService], Awaitable[web.Response]]


def cluster_routes(service: ServiceRef, *, test_hooks: bool = False) -> list[web.RouteDef]:
    def with_service(handler: ServiceHandler) -> Callable[[web.Request], Awaitable[web.Response]]:
        """``handler`` with the running service, or a 503 while there is none."""

        async def route(request: web.Request) -> web.Response:
            svc = service if isinstance(service, ClusterService) else service()
            if svc is None:
                return _unavailable()
            return await handler(request, svc)

        return route

    async def cluster(_request: web.Request, svc: ClusterService) -> web.Response:
        return _json(svc.view.to_json())

    async def prefix(request: web.Request, svc: ClusterService) -> web.Response:
        try:
            data = await _body(request)
            hashes = _hashes(data, "hashes")
            tiers = _tiers(data)
        except ValueError as exc:
            return _bad(str(exc))
        matches = svc.view.longest_prefix(hashes, tiers=tiers)
        return _json(
            {
                node_id: {"num_blocks": m.num_blocks, "tier_blocks": list(m.tier_blocks)}
                for node_id, m in sorted(matches.items())
            }
        )

    async def test_blocks(request: web.Request, svc: ClusterService) -> web.Response:
        try:
            data = await _body(request)
            tier = data.get("tier", "dram")
            if not isinstance(tier, str):
                raise ValueError("'tier' must be a tier name (device, dram, ssd)")
            events = [(h, tier, BlockOp.STORED) for h in _hashes(data, "stored")]
            events += [(h, tier, BlockOp.REMOVED) for h in _hashes(data, "removed")]
            changed = svc.publish_block_events(events)
        except ValueError as exc:
            return _bad(str(exc))
        return _json({"changed": changed})

    async def test_drop_peers(request: web.Request, svc: ClusterService) -> web.Response:
        try:
            data = await _body(request)
        except ValueError as exc:
            return _bad(str(exc))
        peers = data.get("peers")
        if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
            return _bad("'peers' must be a list of node ids")
        svc.set_packet_filter(DropPeers(frozenset(peers)) if peers else None)
        return _json({"blocked": sorted(peers)})

    routes = [
        web.get("/admin/cluster", with_service(cluster)),
        web.post("/admin/cluster/prefix", with_service(prefix)),
    ]
    if test_hooks:
        routes += [
            web.post("/admin/test/blocks", with_service(test_blocks)),
            web.post("/admin/test/drop_peers", with_service(test_drop_peers)),
        ]
    return routes
