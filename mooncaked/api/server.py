"""How the daemon's HTTP server treats connections: idle timeouts and the log
of requests that are not HTTP.

aiohttp logs a request it cannot parse (a bad header, a broken chunked
body) as an ERROR with a traceback; that is the client's fault and says
nothing about the server, so ``ServerLogger`` writes it as one warning
line and passes every other record through.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError


class ServerLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger, with malformed requests as one warning line."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        super().__init__(logger or logging.getLogger("aiohttp.server"), {})

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            # The client's malformed request: one line, no traceback.
            self.warning(
                "malformed HTTP request: %s",
                str(exc_info).replace("\n", " ").strip(),
                **kwargs,
            )
            return
        self.error(msg, *args, exc_info=exc_info, **kwargs)


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
