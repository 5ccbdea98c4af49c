"""The KV store's operations for operators and programs: ``/admin/cache/*``.

Each takes the blocks it acts on as ``"prompt"`` (text, tokenized as a
request's, or token ids: its full blocks) or ``"hashes"`` (hex block
hashes), never both:

- ``POST /admin/cache/pin`` ``{..., "ttl_s": 600, "hard": false}``: pin the
  blocks this node holds (a soft pin needs ``ttl_s``; a hard one may last
  until unpinned). 409 ``pin_budget_exceeded`` past ``store.max_pinned_ratio``.
- ``POST /admin/cache/unpin``: end their pins.
- ``POST /admin/cache/put`` ``{..., "replicas": 2}``: copy the blocks this
  node holds until that many nodes hold each (never fewer copies).
- ``POST /admin/cache/replicas`` ``{..., "replicas": n}``: raise or lower the
  number of holders (never below one, never a pinned copy).
- ``POST /admin/cache/exists``: where each block is, here and in the cluster.
- ``POST /admin/cache/remove``: drop every copy this node knows of (pins too).

Answers are JSON; a caller's mistake is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from mooncaked.api.admin import prompt_token_ids
from mooncaked.api.limits import BadBody, read_json_object, type_name
from mooncaked.api.render import json_response
from mooncaked.api.services import Services
from mooncaked.cache.hashing import BlockHash, block_hashes, parse_hex_hashes
from mooncaked.cache.pins import PinBudgetExceeded
from mooncaked.cache.store import TieredStore
from mooncaked.handoff import MAX_REPLICAS
from mooncaked.wire.paths import MAX_LOOKUP_HASHES
from mooncaked.wire.replicator import Replicator


class _Refused(Exception):
    """An answer other than 200, with the error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str = ""):
        super().__init__(message)
        self.response = json_response(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error" if status < 500 else "unavailable",
                    "param": param,
                    "code": code or None,
                }
            },
            status=status,
        )


def _number(body: dict[str, Any], key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _Refused(400, f"'{key}' must be a number, got {type_name(v)}", param=key)
    return float(v)


def _flag(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if not isinstance(v, bool):
        raise _Refused(400, f"'{key}' must be a boolean, got {type_name(v)}", param=key)
    return v


def _replicas(body: dict[str, Any]) -> int:
    v = body.get("replicas")
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_REPLICAS:
        raise _Refused(
            400,
            f"'replicas' must be an integer in [1, {MAX_REPLICAS}], got {v!r}",
            param="replicas",
        )
    return v


class StoreAdmin:
    def __init__(self, services: Services) -> None:
        self._services = services

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/admin/cache/pin", self.pin),
            web.post("/admin/cache/unpin", self.unpin),
            web.post("/admin/cache/put", self.put),
            web.post("/admin/cache/replicas", self.replicas),
            web.post("/admin/cache/exists", self.exists),
            web.post("/admin/cache/remove", self.remove),
        ]

    # -- what a call acts on -----------------------------------------------------

    def _running(self) -> tuple[TieredStore, Replicator]:
        store, replicator = self._services.store, self._services.replicator
        if store is None or replicator is None or self._services.engine is None:
            raise _Refused(503, "the KV cache is not running (starting or stopping)")
        return store, replicator

    async def _blocks(self, request: web.Request) -> tuple[dict[str, Any], list[BlockHash]]:
        """The body, and the blocks it names (a prompt's full blocks, or hashes)."""
        engine = self._services.engine
        if engine is None:
            raise _Refused(503, "the model is still loading; retry shortly")
        try:
            body = await read_json_object(request)
            if ("prompt" in body) == ("hashes" in body):
                raise _Refused(
                    400, "give the blocks as 'prompt' or as 'hashes', one of them", param="prompt"
                )
            if "hashes" in body:
                hashes = parse_hex_hashes(body["hashes"], "hashes", MAX_LOOKUP_HASHES)
            else:
                ids = await prompt_token_ids(engine, body)
                hashes = block_hashes(ids, engine.block_size, engine.model_id)
                if not hashes:
                    raise _Refused(
                        400,
                        f"the prompt has {len(ids)} tokens: no full block of "
                        f"{engine.block_size} to act on",
                        param="prompt",
                    )
        except BadBody as exc:
            raise _Refused(
                400, str(exc), param="prompt" if "prompt" in str(exc) else None
            ) from None
        except ValueError as exc:  # parse_hex_hashes
            raise _Refused(400, str(exc), param="hashes") from None
        return body, hashes

    # -- handlers ------------------------------------------------------------------

    async def pin(self, request: web.Request) -> web.Response:
        try:
            store, _ = self._running()
            body, hashes = await self._blocks(request)
            hard = _flag(body, "hard")
            ttl_s = _number(body, "ttl_s")
            try:
                result = store.pin(hashes, ttl_s=ttl_s, hard=hard)
            except PinBudgetExceeded as exc:
                raise _Refused(409, str(exc), code="pin_budget_exceeded") from None
            except ValueError as exc:
                raise _Refused(400, str(exc), param="ttl_s") from None
        except _Refused as r:
            return r.response
        return json_response(
            {
                "num_blocks": len(hashes),
                "pinned": len(result.pinned),
                "missing": [h.hex() for h in result.missing],
                "kind": "hard" if hard else "soft",
                "ttl_s": ttl_s,
                "pins": _pin_summary(store),
            }
        )

    async def unpin(self, request: web.Request) -> web.Response:
        try:
            store, _ = self._running()
            _, hashes = await self._blocks(request)
        except _Refused as r:
            return r.response
        return json_response(
            {
                "num_blocks": len(hashes),
                "unpinned": store.unpin(hashes),
                "pins": _pin_summary(store),
            }
        )

    async def put(self, request: web.Request) -> web.Response:
        return await self._replicate(request, lower=False)

    async def replicas(self, request: web.Request) -> web.Response:
        return await self._replicate(request, lower=True)

    async def _replicate(self, request: web.Request, *, lower: bool) -> web.Response:
        try:
            _, replicator = self._running()
            body, hashes = await self._blocks(request)
            n = _replicas(body)
        except _Refused as r:
            return r.response
        report = await (replicator.change(hashes, n) if lower else replicator.put(hashes, n))
        return json_response(report.to_json())

    async def exists(self, request: web.Request) -> web.Response:
        try:
            store, replicator = self._running()
            _, hashes = await self._blocks(request)
        except _Refused as r:
            return r.response
        held_by = replicator.held_by(hashes)
        pins = store.retention.pins
        blocks = [
            {
                "hash": h.hex(),
                "here": [t.label for t in store.tiers_of(h)],
                "pinned": (p.kind.label if (p := pins.get(h)) is not None else None),
                "holders": sorted(nodes),
            }
            for h, nodes in zip(hashes, held_by, strict=True)
        ]
        return json_response(
            {
                "num_blocks": len(hashes),
                "num_here": sum(1 for b in blocks if b["here"]),
                "num_anywhere": sum(1 for b in blocks if b["holders"]),
                "blocks": blocks,
            }
        )

    async def remove(self, request: web.Request) -> web.Response:
        try:
            _, replicator = self._running()
            _, hashes = await self._blocks(request)
        except _Refused as r:
            return r.response
        return json_response((await replicator.remove(hashes)).to_json())


def _pin_summary(store: TieredStore) -> dict[str, Any]:
    s = store.pin_stats()
    return {
        "soft_blocks": s.soft_blocks,
        "hard_blocks": s.hard_blocks,
        "budget_blocks": s.budget_blocks,
        "max_pinned_ratio": s.max_pinned_ratio,
    }
