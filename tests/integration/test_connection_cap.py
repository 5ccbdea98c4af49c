"""The cap on concurrent HTTP connections, with real sockets on a real node.

Clients that open connections and sit on them take the node's connections up
to ``server.max_connections``; the next one is answered 503 and closed before
its request is read, and the node serves again as soon as they let go.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
import uvloop
from aiohttp import web

from mooncaked.api.server import CappedTCPSite, reserve_middleware
from tests.conftest import wait_until

CAP = 4


async def read_all(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(), 10.0)


async def health_on(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> bytes:
    """The answer to ``GET /health`` on a connection already open."""
    reader, writer = conn
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    return await read_all(reader)


@pytest.mark.timeout(60)
async def test_connections_beyond_the_cap_are_refused_then_served_again(
    node_factory: Callable[..., Awaitable[Any]],
) -> None:
    node = await node_factory(server={"max_connections": CAP, "reserved_connections": 0})
    site = node.http_site
    assert site is not None
    host, port = "127.0.0.1", node.port
    # Idle connections, not a byte sent: each still holds a slot.
    held = [await asyncio.open_connection(host, port) for _ in range(CAP)]
    try:
        await wait_until(lambda: site.num_connections == CAP, "connections held")
        reader, writer = await asyncio.open_connection(host, port)
        answer = await read_all(reader)  # answered and closed without a request
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer
        assert b"Retry-After: 1" in head
        assert orjson.loads(body)["error"]["code"] == "too_many_connections"
        assert site.num_refused == 1
        # A held connection is still served.
        assert (await health_on(held[0])).startswith(b"HTTP/1.1 200")
    finally:
        for _, w in held:
            w.close()
    # Once they let go, new clients are served again.
    await wait_until(lambda: site.num_connections == 0, "connections freed")
    async with aiohttp.ClientSession() as s, s.get(node.url + "/health") as r:
        assert r.status == 200
    assert site.num_refused == 1


# Each a loopback address of its own on Linux: three clients of one host.
CLIENT_A, CLIENT_B, CLIENT_C = "127.0.0.2", "127.0.0.3", "127.0.0.4"
ADMIN = "admin-test-token"
LOOPS: dict[str, Callable[[Awaitable[Any]], Any]] = {
    "asyncio": asyncio.run,
    "uvloop": uvloop.run,  # what the daemon runs on
}


async def connect(port: int, client: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(client, 0))


async def ask(port: int, client: str, path: str, token: str = "") -> tuple[bytes, dict[str, Any]]:
    """One request on a connection of its own from ``client``: (head, JSON body)."""
    reader, writer = await connect(port, client)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}Connection: close\r\n\r\n".encode()
    )
    answer = await read_all(reader)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, orjson.loads(body) if body else {}


async def serve_app(site_kwargs: dict[str, Any]) -> tuple[web.AppRunner, CappedTCPSite]:
    """A bare app on a CappedTCPSite: /health, /ready and /v1/models."""
    sites: list[CappedTCPSite] = []

    async def ok(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application(middlewares=[reserve_middleware(lambda: sites[0], ADMIN)])
    app.add_routes([web.get("/health", ok), web.get("/ready", ok), web.get("/v1/models", ok)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = CappedTCPSite(runner, "127.0.0.1", 0, **site_kwargs)
    sites.append(site)
    await site.start()
    return runner, site


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_the_503_is_written_under_each_event_loop(loop: str) -> None:
    async def scenario() -> bytes:
        runner, site = await serve_app({"max_connections": 2})
        try:
            held = [await connect(site.port, CLIENT_A) for _ in range(2)]
            await wait_until(lambda: site.num_connections == 2, "connections held")
            reader, writer = await connect(site.port, CLIENT_A)
            answer = await read_all(reader)
            writer.close()
            for _, w in held:
                w.close()
            return answer
        finally:
            await runner.cleanup()

    answer = LOOPS[loop](scenario())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head, answer
    assert orjson.loads(body)["error"]["code"] == "too_many_connections"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_per_client_cap_and_reserve_under_each_event_loop(loop: str) -> None:
    async def scenario() -> None:
        kwargs = {"max_connections": 4, "max_connections_per_client": 3, "reserved_connections": 1}
        runner, site = await serve_app(kwargs)
        port = site.port
        held = []
        try:
            held = [await connect(port, CLIENT_A) for _ in range(3)]
            await wait_until(lambda: site.connections_of(CLIENT_A) == 3, "A's connections")
            # A's fourth is refused, though the server has room.
            head, body = await ask(port, CLIENT_A, "/health")
            assert head.startswith(b"HTTP/1.1 503"), head
            assert body["error"]["code"] == "too_many_client_connections"
            held.append(await connect(port, CLIENT_B))
            await wait_until(lambda: site.num_connections == 4, "the cap filled")
            # Beyond the cap: the reserve serves the probes and the admin token only.
            head, body = await ask(port, CLIENT_C, "/v1/models")
            assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head, head
            assert body["error"]["code"] == "too_many_connections"
            for path in ("/health", "/ready"):
                head, _ = await ask(port, CLIENT_C, path)
                assert head.startswith(b"HTTP/1.1 200"), (path, head)
            head, _ = await ask(port, CLIENT_C, "/v1/models", token=ADMIN)
            assert head.startswith(b"HTTP/1.1 200"), head
            # A held connection is still served, through the gate.
            assert (await health_on(held[0])).startswith(b"HTTP/1.1 200")
        finally:
            for _, w in held:
                w.close()
            await runner.cleanup()

    LOOPS[loop](scenario())


@pytest.mark.timeout(60)
async def test_idle_connections_are_closed_sooner_near_the_cap() -> None:
    runner, site = await serve_app(
        {"max_connections": 10, "reserved_connections": 2, "pressured_idle_s": 0.05}
    )
    held = []
    try:
        # 9 of 10: above 90%, where idle connections stop being kept.
        held = [await connect(site.port, CLIENT_A) for _ in range(9)]
        await wait_until(lambda: site.num_connections == 9, "connections held")
        closed = 0
        while closed < len(held):
            # Each new connection looks for idle ones (at most every 0.1 s).
            head, _ = await ask(site.port, CLIENT_B, "/health")
            assert head.startswith(b"HTTP/1.1 200"), head
            closed = sum(r.at_eof() for r, _ in held)
            if closed < len(held):
                await asyncio.sleep(0.05)
        assert all([await read_all(r) == b"" for r, _ in held])
        assert site.num_idle_closed >= len(held)
    finally:
        for _, w in held:
            w.close()
        await runner.cleanup()


@pytest.mark.timeout(60)
async def test_one_client_does_not_lock_out_another(
    node_factory: Callable[..., Awaitable[Any]],
) -> None:
    node = await node_factory(
        server={"max_connections": 32, "max_connections_per_client": 16, "admin_token": ADMIN}
    )
    site = node.http_site
    assert site is not None
    # A opens as many idle connections as the whole server serves.
    held = [await connect(node.port, CLIENT_A) for _ in range(32)]
    try:
        await wait_until(lambda: site.connections_of(CLIENT_A) == 16, "A's connections")
        head, body = await ask(node.port, CLIENT_B, "/v1/models")
        assert head.startswith(b"HTTP/1.1 200"), (head, body)
        head, body = await ask(node.port, CLIENT_B, "/admin/status", token=ADMIN)
        assert head.startswith(b"HTTP/1.1 200"), (head, body)
        # A's connections past its limit were answered 503, not left hanging.
        refused = [await read_all(r) for r, _ in held[16:]]
        assert all(a.startswith(b"HTTP/1.1 503") for a in refused), refused[:1]
    finally:
        for _, w in held:
            w.close()


@pytest.mark.timeout(60)
async def test_health_answers_when_the_cap_is_full(
    node_factory: Callable[..., Awaitable[Any]],
) -> None:
    node = await node_factory(server={"max_connections": 32, "max_connections_per_client": 0})
    site = node.http_site
    assert site is not None
    held = [await connect(node.port, CLIENT_A) for _ in range(32)]
    try:
        await wait_until(lambda: site.num_connections == 32, "the cap filled")
        head, _ = await ask(node.port, CLIENT_B, "/health")
        assert head.startswith(b"HTTP/1.1 200"), head
        head, body = await ask(node.port, CLIENT_B, "/v1/models")
        assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head, head
        assert body["error"]["code"] == "too_many_connections"
    finally:
        for _, w in held:
            w.close()
