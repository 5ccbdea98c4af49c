"""How the daemon's HTTP server treats connections: a cap on how many it
serves at once, idle timeouts and the log of requests that are not HTTP.

``CappedTCPSite`` serves at most ``server.max_connections`` connections at
once; one more is answered 503 with Retry-After and closed before a byte of
its request is read, so clients that open sockets and sit on them (or trickle
headers in) run out of connections, not the daemon out of file descriptors
and memory. The idle timeout then frees what they hold.

aiohttp logs a request it cannot parse (a bad header, a broken chunked
body) as an ERROR with a traceback; that is the client's fault and says
nothing about the server, so ``ServerLogger`` writes it as one warning
line and passes every other record through.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import orjson
import structlog
from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError, InvalidURLError


class ServerLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger, with malformed requests as one warning line.

    The line gives the parser's reason only: aiohttp quotes the raw line it
    could not parse, and that line may be an ``Authorization`` header whose
    token must never reach a log.
    """

    def __init__(self, logger: logging.Logger | None = None) -> None:
        super().__init__(logger or logging.getLogger("aiohttp.server"), {})

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            # The client's malformed request: one line, no traceback.
            self.warning(
                "malformed HTTP request: %d %s (the raw bytes are not logged)",
                exc_info.code,
                self.reason(exc_info),
                **kwargs,
            )
            return
        self.error(msg, *args, exc_info=exc_info, **kwargs)

    @staticmethod
    def reason(exc: HttpProcessingError) -> str:
        """The parser's reason without the client's bytes: its first line, up
        to the first quote (aiohttp quotes what it read, as b'...' or '...')."""
        if isinstance(exc, InvalidURLError):
            # Its message is the request's path itself, unquoted.
            return "invalid URL"
        first = str(exc.message).strip().split("\n", 1)[0]
        for i, ch in enumerate(first):
            if ch in "'\"":
                first = first[: i - 1 if i and first[i - 1] == "b" else i]
                break
        # Printable ASCII only, and short: nothing a client sent can slip through.
        return "".join(c for c in first if " " <= c <= "~").strip(" :")[:120]


log = structlog.get_logger(__name__)

# A refused connection is logged at most this often (a flood would be a log flood).
_REFUSED_LOG_INTERVAL_S = 10.0


def _refusal(max_connections: int) -> bytes:
    body = orjson.dumps(
        {
            "error": {
                "message": f"this server is serving its limit of {max_connections} "
                "connections; retry shortly",
                "type": "service_unavailable",
                "code": "too_many_connections",
            }
        }
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        "Retry-After: 1\r\n"
        "Connection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _Refused(asyncio.Protocol):
    """A connection over the cap: answered 503 and closed, its request unread."""

    def __init__(self, answer: bytes) -> None:
        self._answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if isinstance(transport, asyncio.Transport):
            transport.write(self._answer)
        transport.close()


class CappedTCPSite(web.TCPSite):
    """A TCPSite that serves at most ``max_connections`` connections at once."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        max_connections: int,
        clock: Callable[[], float] = time.monotonic,
        **kwargs: Any,
    ) -> None:
        if max_connections <= 0:
            raise ValueError(f"max_connections must be > 0, got {max_connections}")
        super().__init__(runner, host, port, **kwargs)
        self.max_connections = max_connections
        self.num_refused = 0
        self._answer = _refusal(max_connections)
        self._clock = clock
        self._logged_at = -_REFUSED_LOG_INTERVAL_S

    async def start(self) -> None:
        # TCPSite.start, with the runner's protocol factory behind the cap.
        await web.BaseSite.start(self)
        server = self._runner.server
        if server is None:
            raise RuntimeError("the runner is not set up; call setup() first")

        def protocol() -> asyncio.BaseProtocol:
            # Connections register as they are made and leave once their
            # handler is done, so this counts every socket still held.
            if len(server.connections) < self.max_connections:
                return server()
            self._refused()
            return _Refused(self._answer)

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            protocol,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port

    @property
    def num_connections(self) -> int:
        """Connections served now."""
        server = self._runner.server
        return 0 if server is None else len(server.connections)

    def _refused(self) -> None:
        self.num_refused += 1
        now = self._clock()
        if now - self._logged_at >= _REFUSED_LOG_INTERVAL_S:
            self._logged_at = now
            log.warning(
                "http connection limit reached; refusing new connections",
                limit=self.max_connections,
                refused=self.num_refused,
            )


def server_kwargs(idle_timeout_s: float) -> dict[str, Any]:
    """Keyword arguments for ``web.AppRunner`` (passed on to each connection).

    aiohttp's keep-alive timer starts when a connection opens and is not reset
    by bytes that do not complete a request, so it also bounds how long the
    headers of the first request may take.
    """
    return {"logger": ServerLogger(), "keepalive_timeout": idle_timeout_s}


async def expect_handler(request: web.Request) -> None:
    """aiohttp's answer to ``Expect``, but safe for any header value.

    aiohttp's own default puts the value into a text/plain 417 as UTF-8, and a
    value with a non-UTF-8 byte (kept as a surrogate) then fails to encode: a
    500 from a single header.
    """
    expect = request.headers.get(hdrs.EXPECT, "")
    if request.version != HttpVersion11:
        return
    if expect.lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        # The interim answer is not part of the response's own size.
        request.writer.output_size = 0
        return
    raise web.HTTPExpectationFailed(text=f"unknown Expect: {ascii(expect)[:80]}")


def with_expect_handler(routes: Iterable[web.RouteDef]) -> list[web.RouteDef]:
    """``routes`` with ``expect_handler`` as their Expect handler."""
    return [
        web.RouteDef(r.method, r.path, r.handler, {"expect_handler": expect_handler, **r.kwargs})
        for r in routes
    ]
