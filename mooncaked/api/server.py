"""How the daemon's HTTP server treats connections: a cap on how many it
serves at once, idle timeouts and the log of requests that are not HTTP.

``CappedTCPSite`` serves at most ``server.max_connections`` connections at
once, and at most ``server.max_connections_per_client`` of them to one client
address; one more is answered 503 with Retry-After and closed before a byte
of its request is read, so clients that open sockets and sit on them (or
trickle headers in) run out of connections, not the daemon out of file
descriptors and memory, and one such client does not lock out the others.
The idle timeout then frees what they hold, sooner once the server is near
its cap. ``server.reserved_connections`` more are kept for ``/health``,
``/ready`` and the admin token's holder, so a full server still answers
its probes and its operator.

aiohttp logs a request it cannot parse (a bad header, a broken chunked
body) as an ERROR with a traceback; that is the client's fault and says
nothing about the server, so ``ServerLogger`` writes it as one warning
line and passes every other record through.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import orjson
import structlog
from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError, InvalidURLError

from mooncaked.api.auth import bearer_token, token_matches
from mooncaked.api.errors import ApiError


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
# Above this share of max_connections, idle connections are closed sooner.
_PRESSURE = 0.9
# Under pressure, a connection idle this long is closed (not after idle_timeout_s).
_PRESSURED_IDLE_S = 1.0
# Under pressure, idle connections are looked for at most this often: a
# flood of accepts must not each walk every connection.
_SWEEP_INTERVAL_S = 0.1
# Paths a connection in the reserve is served, besides requests bearing the admin token.
_RESERVED_PATHS = frozenset({"/health", "/ready"})


def _refusal(message: str, code: str) -> bytes:
    body = orjson.dumps(
        {"error": {"message": message, "type": "service_unavailable", "code": code}}
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        "Retry-After: 1\r\n"
        "Connection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Admission(enum.Enum):
    """What a new connection gets."""

    SERVED = "served"
    # Beyond max_connections: /health, /ready and the admin token only.
    RESERVED = "reserved"
    REFUSED_FULL = "refused_full"
    REFUSED_CLIENT = "refused_client"


class _Gate(asyncio.Protocol):
    """One accepted connection: refused with a 503, or handed to aiohttp's handler.

    The gate stays the transport's protocol and passes every event on, so the
    site learns when the connection ends and when its client last sent bytes.
    """

    __slots__ = ("_site", "admission", "client", "handler", "last_active")

    def __init__(self, site: CappedTCPSite) -> None:
        self._site = site
        self.client = ""
        self.admission = Admission.REFUSED_FULL
        self.handler: Any = None
        self.last_active = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self.admission = self._site._admit(self)
        if self.handler is None:
            # Any transport that can write gets the answer: uvloop's are not
            # asyncio.Transport instances.
            write = getattr(transport, "write", None)
            if callable(write):
                write(self._site._answers[self.admission])
            transport.close()
            return
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.handler is not None:
            self.last_active = self._site._clock()
            self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.handler is not None else None

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.handler is not None:
            self._site._release(self)
            self.handler.connection_lost(exc)


def _is_idle(handler: Any) -> bool:
    # aiohttp's own test for "handler in idle state" (RequestHandler._process_keepalive):
    # waiting for the next request, none being handled. No public equivalent;
    # without the attribute nothing counts as idle and nothing is closed early.
    waiter = getattr(handler, "_waiter", None)
    return waiter is not None and not waiter.done()


class CappedTCPSite(web.TCPSite):
    """A TCPSite that serves at most ``max_connections`` connections at once.

    Up to ``reserved_connections`` more are accepted, for ``/health``,
    ``/ready`` and requests bearing the admin token only (``reserve_middleware``
    answers the rest 503); beyond that, and beyond ``max_connections_per_client``
    connections from one client address (0: no limit), a connection is answered
    503 with Retry-After and closed before its request is read. Above 90% of
    ``max_connections``, connections idle for a second are closed.
    """

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        max_connections: int,
        max_connections_per_client: int = 0,
        reserved_connections: int = 0,
        pressured_idle_s: float = _PRESSURED_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
        **kwargs: Any,
    ) -> None:
        if max_connections <= 0:
            raise ValueError(f"max_connections must be > 0, got {max_connections}")
        if max_connections_per_client < 0:
            raise ValueError(
                f"max_connections_per_client must be >= 0 (0: no limit), "
                f"got {max_connections_per_client}"
            )
        if reserved_connections < 0:
            raise ValueError(f"reserved_connections must be >= 0, got {reserved_connections}")
        super().__init__(runner, host, port, **kwargs)
        self.max_connections = max_connections
        self.max_connections_per_client = max_connections_per_client
        self.reserved_connections = reserved_connections
        self.num_refused = 0
        # Connections closed early for being idle while the server was near its cap.
        self.num_idle_closed = 0
        self._pressured_idle_s = pressured_idle_s
        self._pressure_at = max(1, int(max_connections * _PRESSURE))
        self._answers = {
            Admission.REFUSED_FULL: _refusal(
                f"this server is serving its limit of {max_connections} connections; retry shortly",
                "too_many_connections",
            ),
            Admission.REFUSED_CLIENT: _refusal(
                f"this client holds its limit of {max_connections_per_client} connections "
                "to this server; close some or retry shortly",
                "too_many_client_connections",
            ),
        }
        self._clock = clock
        self._logged_at = -_REFUSED_LOG_INTERVAL_S
        self._swept_at = -_SWEEP_INTERVAL_S
        self._gates: set[_Gate] = set()
        self._per_client: dict[str, int] = {}
        self._reserved: set[Any] = set()
        self._bound_port = port

    async def start(self) -> None:
        # TCPSite.start, with every connection behind a gate.
        await web.BaseSite.start(self)
        if self._runner.server is None:
            raise RuntimeError("the runner is not set up; call setup() first")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Gate(self),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port

    @property
    def port(self) -> int:
        """The port listened on (with port 0, the one the OS picked); after start()."""
        return self._bound_port

    @property
    def num_connections(self) -> int:
        """Connections held now, in the reserve included."""
        return len(self._gates)

    def connections_of(self, client: str) -> int:
        """Connections the client address ``client`` holds now."""
        return self._per_client.get(client, 0)

    def is_reserved(self, handler: Any) -> bool:
        """True if ``handler``'s connection was accepted into the reserve."""
        return handler in self._reserved

    def _admit(self, gate: _Gate) -> Admission:
        num_open = len(self._gates)
        if num_open >= self._pressure_at:
            self._close_idle()
        held = self._per_client.get(gate.client, 0)
        if self.max_connections_per_client and held >= self.max_connections_per_client:
            admission = Admission.REFUSED_CLIENT
        elif num_open >= self.max_connections + self.reserved_connections:
            admission = Admission.REFUSED_FULL
        elif num_open >= self.max_connections:
            admission = Admission.RESERVED
        else:
            admission = Admission.SERVED
        if admission in self._answers:
            self._refused(admission, gate.client)
            return admission
        server = self._runner.server
        if server is None:  # the runner is being cleaned up
            self._refused(Admission.REFUSED_FULL, gate.client)
            return Admission.REFUSED_FULL
        gate.handler = server()
        gate.last_active = self._clock()
        self._gates.add(gate)
        self._per_client[gate.client] = held + 1
        if admission is Admission.RESERVED:
            self._reserved.add(gate.handler)
        return admission

    def _release(self, gate: _Gate) -> None:
        if gate not in self._gates:
            return
        self._gates.discard(gate)
        self._reserved.discard(gate.handler)
        held = self._per_client.get(gate.client, 0) - 1
        if held > 0:
            self._per_client[gate.client] = held
        else:
            self._per_client.pop(gate.client, None)

    def _close_idle(self) -> None:
        now = self._clock()
        if now - self._swept_at < _SWEEP_INTERVAL_S:
            return
        self._swept_at = now
        for gate in list(self._gates):
            handler = gate.handler
            if now - gate.last_active >= self._pressured_idle_s and _is_idle(handler):
                # As aiohttp's keep-alive timeout would, only sooner.
                handler.force_close()
                self.num_idle_closed += 1

    def _refused(self, admission: Admission, client: str) -> None:
        self.num_refused += 1
        now = self._clock()
        if now - self._logged_at >= _REFUSED_LOG_INTERVAL_S:
            self._logged_at = now
            log.warning(
                "http connection limit reached; refusing new connections",
                reason=admission.value,
                client=client,
                limit=self.max_connections,
                per_client_limit=self.max_connections_per_client,
                refused=self.num_refused,
            )


def reserve_middleware(site: Callable[[], CappedTCPSite | None], admin_token: str) -> Any:
    """Serves a connection accepted into the site's reserve only ``/health``,
    ``/ready`` and requests bearing ``admin_token``; others get 503 and a close."""
    tokens = (admin_token,) if admin_token else ()

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        current = site()
        if (
            current is not None
            and current.is_reserved(request.protocol)
            and request.path not in _RESERVED_PATHS
            and not token_matches(bearer_token(request), tokens)
        ):
            resp = ApiError(
                503,
                f"this server is serving its limit of {current.max_connections} "
                "connections; retry shortly",
                type="service_unavailable",
                code="too_many_connections",
                headers={"Retry-After": "1"},
            ).response()
            # Free the reserved slot for the probes it is kept for.
            resp.force_close()
            return resp
        return await handler(request)

    return middleware


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
