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

from tests.conftest import wait_until

CAP = 4


async def read_all(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(), 10.0)


@pytest.mark.timeout(60)
async def test_connections_beyond_the_cap_are_refused_then_served_again(
    node_factory: Callable[..., Awaitable[Any]],
) -> None:
    node = await node_factory(server={"max_connections": CAP})
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
        r0, w0 = held[0]
        w0.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await read_all(r0)).startswith(b"HTTP/1.1 200")
    finally:
        for _, w in held:
            w.close()
    # Once they let go, new clients are served again.
    await wait_until(lambda: site.num_connections == 0, "connections freed")
    async with aiohttp.ClientSession() as s, s.get(node.url + "/health") as r:
        assert r.status == 200
    assert site.num_refused == 1
