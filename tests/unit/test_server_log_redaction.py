"""No log line carries a credential a client sent, however malformed its request.

A real aiohttp server on loopback, built as the daemon builds it (its
``ServerLogger``, its middlewares with an API key, no access log), is sent requests
whose ``Authorization`` header is odd, or a line the parser cannot read
(aiohttp's parse errors quote the raw line); every log line, of the stdlib
logging and of structlog's output, is then searched for the token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from mooncaked.api.auth import auth_middleware
from mooncaked.api.metrics import ApiMetrics
from mooncaked.api.middleware import api_middleware
from mooncaked.api.server import server_kwargs
from mooncaked.config import ServerConfig
from tests.conftest import serving

TOKEN = "sk-9f8e7d6c5b4a39281706f5e4d3c2b1a0"
KEY = "sk-the-right-key-of-this-test-0000"

# Header lines that end up answered 400 by the parser or 401 by the middleware.
HEADS = [
    f"Authorization: Bearer  {TOKEN}".encode(),
    f"Authorization:Bearer\t{TOKEN}".encode(),
    f"Authorization: Basic {TOKEN}".encode(),
    f"Authorization: Bearer {TOKEN}".encode() + b"\xff\xfe",
    f"Authorization: Bearer {TOKEN}\x01".encode(),
    f"Authorization: Bearer {TOKEN}\x7f".encode(),
    f"Authorization : Bearer {TOKEN}".encode(),
    f"Authorization Bearer {TOKEN}".encode(),
    f"Author\x01ization: Bearer {TOKEN}".encode(),
    f"Authorization: Bearer {TOKEN}".encode() + b"\r\n folded",
    f"Authorization: Bearer {TOKEN}".encode() + b"x" * 9000,
]


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.fixture
async def server() -> AsyncIterator[int]:
    app = web.Application(
        middlewares=[api_middleware(ApiMetrics()), auth_middleware(ServerConfig(api_keys=(KEY,)))]
    )
    app.router.add_get("/v1/models", ok)
    async with serving(app, access_log=None, **server_kwargs(5.0)) as port:
        yield port


async def send(port: int, head: bytes, path: bytes = b"/v1/models") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n\r\n")
        await writer.drain()
        return await asyncio.wait_for(reader.read(300), 10.0)
    finally:
        writer.close()


async def test_a_malformed_authorization_header_never_reaches_a_log(
    server: int, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    statuses = []
    for head in HEADS:
        reply = await send(server, head)
        statuses.append(reply.split(b" ", 2)[1])
    # A path with a credential in it, which aiohttp's URL error names bare.
    reply = await send(server, b"X: y", b"/v1/models?key=" + TOKEN.encode() + b"\x01")
    statuses.append(reply.split(b" ", 2)[1])
    assert set(statuses) == {b"400", b"401"}, statuses
    malformed = [r for r in caplog.records if "malformed HTTP request" in r.getMessage()]
    # Each parse error is still logged, by its reason.
    assert len(malformed) == statuses.count(b"400"), [r.getMessage() for r in caplog.records]
    assert any("Invalid header value char" in r.getMessage() for r in malformed)
    out, err = capfd.readouterr()
    lines = [logging.Formatter().format(r) for r in caplog.records] + [out, err]
    for fragment in (TOKEN, TOKEN[3:19], TOKEN[-12:]):
        leaks = [line for line in lines if fragment in line]
        assert not leaks, leaks


async def read_body(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(text="read")


async def test_a_caller_hanging_up_mid_body_is_a_499_not_a_server_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A peer killed or cut off while sending a signed call's body: the read
    # fails with ConnectionResetError, which says nothing about this server.
    metrics = ApiMetrics()
    app = web.Application(middlewares=[api_middleware(metrics)])
    app.router.add_post("/internal/cache/release", read_body)
    async with serving(app, access_log=None, **server_kwargs(5.0)) as port:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /internal/cache/release HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 1000\r\n\r\n" + b"{" * 10
        )
        await writer.drain()
        writer.close()
        counter = metrics.http_requests
        for _ in range(200):
            samples = {
                s.labels["status"]: s.value
                for m in counter.collect()
                for s in m.samples
                if s.name.endswith("_total")
            }
            if samples:
                break
            await asyncio.sleep(0.01)
    assert samples == {"499": 1.0}, samples
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
