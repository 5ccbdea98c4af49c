"""How the daemon's HTTP server treats connections: idle timeouts and the log
of requests that are not HTTP.

aiohttp logs a request it cannot parse (a bad header, a broken chunked
body) as an ERROR with a traceback; that is the client's fault and says
nothing about the server, so ``ServerLogger`` writes it as one warning
line and passes every other record through.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError

# A connection with no request in progress is closed after this many seconds.
KEEPALIVE_TIMEOUT_S = 75.0


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


def server_kwargs() -> dict[str, Any]:
    """Keyword arguments for ``web.AppRunner`` (passed on to each connection)."""
    return {"logger": ServerLogger(), "keepalive_timeout": KEEPALIVE_TIMEOUT_S}
