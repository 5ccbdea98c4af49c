"""The cluster HTTP routes and ``mooncakectl nodes`` / ``cluster`` against a real service."""

from __future__ import annotations

import asyncio
import io
import json
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import aiohttp
import pytest
from aiohttp import web

from mooncakectl.cli import run as ctl_run
from mooncakectl.registry import Env
from mooncaked.cluster.gossip.service import ClusterService, DropPeers
from mooncaked.cluster.routes import cluster_routes
from mooncaked.cluster.state import LocalState, NodeLoad
from mooncaked.config import ClusterConfig
from tests.conftest import serving


@pytest.fixture
async def served() -> AsyncIterator[tuple[ClusterService, str, str]]:
    """One service, its routes twice: with and without the test hooks."""
    service = ClusterService(
        ClusterConfig(),
        "solo",
        b"routes-test-secret",
        local_state=lambda: LocalState(
            role="decode", model_id="m", load=NodeLoad(512, 3, 0.25, 0.0)
        ),
    )
    await service.start()
    urls = []
    try:
        async with AsyncExitStack() as stack:
            for hooks in (True, False):
                app = web.Application()
                app.add_routes(cluster_routes(service, test_hooks=hooks))
                port = await stack.enter_async_context(serving(app, access_log=None))
                urls.append(f"http://127.0.0.1:{port}")
            yield service, urls[0], urls[1]
    finally:
        await service.close()


async def ctl(url: str, *argv: str, tty: bool = False) -> tuple[int, str]:
    env = Env(stdout=io.StringIO(), stderr=io.StringIO(), environ={}, stdout_isatty=tty)
    status = await asyncio.to_thread(ctl_run, ["--url", url, *argv], env)
    return status, env.stdout.getvalue() + env.stderr.getvalue()  # type: ignore[attr-defined]


async def test_hooks_blocks_prefix_and_errors(served: tuple[ClusterService, str, str]) -> None:
    service, url, plain_url = served
    hashes = [os.urandom(16).hex() for _ in range(4)]
    async with aiohttp.ClientSession() as http:
        r = await http.post(url + "/admin/test/blocks", json={"stored": hashes, "tier": "ssd"})
        assert (r.status, await r.json()) == (200, {"changed": 4})
        r = await http.post(
            url + "/admin/cluster/prefix", json={"hashes": [*hashes[:2], hashes[3]]}
        )
        assert await r.json() == {"solo": {"num_blocks": 3, "tier_blocks": [0, 0, 3]}}
        r = await http.post(
            url + "/admin/cluster/prefix", json={"hashes": hashes, "tiers": ["device", "dram"]}
        )
        assert await r.json() == {}
        r = await http.post(url + "/admin/test/blocks", json={"stored": hashes[:1], "tier": "dram"})
        r = await http.post(
            url + "/admin/cluster/prefix", json={"hashes": hashes, "tiers": ["dram"]}
        )
        assert await r.json() == {"solo": {"num_blocks": 1, "tier_blocks": [0, 1, 0]}}
        r = await http.post(url + "/admin/cluster/prefix", json={"hashes": hashes, "tiers": ["x"]})
        assert r.status == 400 and "unknown tier" in (await r.json())["error"]["message"]
        r = await http.post(url + "/admin/cluster/prefix", json={"hashes": hashes, "tiers": "dram"})
        assert r.status == 400
        r = await http.post(url + "/admin/test/blocks", json={"stored": hashes, "tier": [1]})
        assert r.status == 400
        r = await http.post(url + "/admin/test/blocks", json={"stored": ["zz"]})
        assert r.status == 400 and "block hash" in (await r.json())["error"]["message"]
        r = await http.post(url + "/admin/cluster/prefix", data=b"not json")
        assert r.status == 400
        r = await http.post(url + "/admin/test/drop_peers", json={"peers": "x"})
        assert r.status == 400
        r = await http.post(url + "/admin/test/drop_peers", json={"peers": ["a", "b"]})
        assert r.status == 200 and service.packet_filter == DropPeers(frozenset({"a", "b"}))
        r = await http.post(url + "/admin/test/drop_peers", json={"peers": []})
        assert r.status == 200 and service.packet_filter is None
        # Without the flag, the hooks do not exist.
        r = await http.post(plain_url + "/admin/test/blocks", json={"stored": hashes})
        assert r.status in (404, 405)
        r = await http.get(plain_url + "/admin/cluster")
        doc = await r.json()
    assert doc["self"] == "solo" and doc["nodes"][0]["cached_blocks"] == 4


async def test_mooncakectl_renders_table_summary_and_json(
    served: tuple[ClusterService, str, str],
) -> None:
    _, url, _ = served
    status, text = await ctl(url, "nodes")
    assert status == 0
    header, row = text.strip().splitlines()
    assert header.split() == [
        "NODE",
        "ROLE",
        "STATE",
        "LOAD",
        "KV",
        "USAGE",
        "CACHED",
        "BLOCKS",
        "LAST",
        "HEARD",
        "QUEUE",
        "COST",
        "MODEL",
    ]
    assert row.split()[:4] == ["solo", "*", "decode", "alive"]
    # A service without an engine measured nothing.
    assert row.rstrip().endswith("not measured")
    assert "512 tok, 3 dec" in row and "25.0%" in row
    status, text = await ctl(url, "nodes", tty=True)
    assert status == 0 and "solo" in text and "decode" in text
    status, text = await ctl(url, "cluster")
    assert status == 0
    assert "1 alive" in text and "1 decode" in text and "512 tokens" in text
    status, text = await ctl(url, "cluster", "--json")
    doc = json.loads(text)
    assert doc["summary"]["by_status"]["alive"] == 1 and "counters" in doc
    status, text = await ctl("http://127.0.0.1:1", "nodes", "--timeout", "2")
    assert status == 3 and "cannot reach" in text


async def test_routes_of_a_service_not_running_answer_503() -> None:
    # A daemon adds the routes before its cluster step starts the service.
    current: list[ClusterService] = []
    app = web.Application()
    app.add_routes(cluster_routes(lambda: current[0] if current else None, test_hooks=True))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    service = ClusterService(ClusterConfig(), "later", b"routes-test-secret")
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with aiohttp.ClientSession() as http:
            for method, path in (
                ("GET", "/admin/cluster"),
                ("POST", "/admin/cluster/prefix"),
                ("POST", "/admin/test/blocks"),
                ("POST", "/admin/test/drop_peers"),
            ):
                r = await http.request(method, url + path, json={})
                assert r.status == 503, path
            await service.start()
            current.append(service)
            r = await http.get(url + "/admin/cluster")
            assert r.status == 200 and (await r.json())["self"] == "later"
    finally:
        await runner.cleanup()
        await service.close()
