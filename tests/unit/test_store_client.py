"""The store client against a stand-in node: what each call sends, what it
parses, and how errors come back (both transports)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from mooncaked.client import AsyncStoreClient, StoreClient, StoreError, StoreUnreachable
from tests.conftest import serving

H = bytes(range(16))


def fake_node(seen: list[tuple[str, dict[str, Any]]]) -> web.Application:
    async def pin(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.path, body))
        if body.get("hard") and len(body.get("hashes", [])) > 1:
            return web.json_response(
                {"error": {"message": "over budget", "param": None, "code": "pin_budget_exceeded"}},
                status=409,
            )
        pins = {"soft_blocks": 1, "hard_blocks": 0, "budget_blocks": 8, "max_pinned_ratio": 0.5}
        return web.json_response({"num_blocks": 1, "pinned": 1, "missing": [], "pins": pins})

    async def put(request: web.Request) -> web.Response:
        seen.append((request.path, await request.json()))
        return web.json_response(
            {
                "replicas": 2,
                "num_blocks": 1,
                "missing": 0,
                "short": 0,
                "holders_before": [1],
                "holders_after": [2],
                "nodes": {
                    "b": {
                        "stored": 1,
                        "held": 0,
                        "corrupt": 0,
                        "failed": 0,
                        "dropped": 0,
                        "kept_pinned": 0,
                        "error": None,
                    }
                },
            }
        )

    async def exists(request: web.Request) -> web.Response:
        seen.append((request.path, await request.json()))
        block = {"hash": H.hex(), "here": ["dram"], "pinned": "soft", "holders": ["a", "b"]}
        return web.json_response({"blocks": [block, {**block, "here": [], "holders": []}]})

    app = web.Application()
    app.add_routes(
        [
            web.post("/admin/cache/pin", pin),
            web.post("/admin/cache/put", put),
            web.post("/admin/cache/exists", exists),
        ]
    )
    return app


async def test_calls_and_answers_on_both_transports() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    async with serving(fake_node(seen)) as port:
        url = f"http://127.0.0.1:{port}"
        sync = StoreClient(url)
        pinned = await asyncio.to_thread(sync.kv.pin, hashes=[H], ttl_s=30)
        assert pinned.pinned == 1 and pinned.pins.budget_blocks == 8
        put = await asyncio.to_thread(sync.kv.put, prompt=[1, 2, 3], replicas=2)
        assert put.holders_after == [2] and put.nodes["b"].stored == 1
        with pytest.raises(StoreError) as err:
            await asyncio.to_thread(sync.kv.pin, hashes=[H, H.hex()], hard=True)
        assert (err.value.status, err.value.code) == (409, "pin_budget_exceeded")
        async with AsyncStoreClient(url) as client:
            found = await client.kv.exists(prompt="some text")
            assert (found.here, found.anywhere) == ([True, False], [True, False])
            assert found.blocks[0].pinned == "soft"
    assert seen == [
        ("/admin/cache/pin", {"hashes": [H.hex()], "ttl_s": 30, "hard": False}),
        ("/admin/cache/put", {"prompt": [1, 2, 3], "replicas": 2}),
        ("/admin/cache/pin", {"hashes": [H.hex(), H.hex()], "ttl_s": None, "hard": True}),
        ("/admin/cache/exists", {"prompt": "some text"}),
    ]


def test_blocks_are_named_once_and_urls_checked() -> None:
    client = StoreClient("127.0.0.1:1")
    assert client.url == "http://127.0.0.1:1"
    with pytest.raises(ValueError, match="exactly one"):
        client.kv.exists(prompt="x", hashes=[H])
    with pytest.raises(ValueError, match="16 bytes"):
        client.kv.exists(hashes=[b"short"])
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        StoreClient("ftp://x")
    with pytest.raises(StoreUnreachable):
        client.kv.exists(hashes=[H])
