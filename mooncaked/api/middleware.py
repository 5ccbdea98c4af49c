"""The public API's middleware: errors rendered as JSON, every answer counted.

An ``ApiError`` becomes its OpenAI-shaped answer; anything else unexpected a
500 with the traceback in the log; a caller that hung up a 499. Every
answer is counted by route pattern and status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web

from mooncaked.api.errors import ApiError
from mooncaked.api.metrics import ApiMetrics

log = structlog.get_logger(__name__)

# Set on a request whose client disconnected while its answer streamed.
CLIENT_GONE = "mooncaked_client_gone"


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def api_middleware(metrics: ApiMetrics) -> Any:
    """Renders ApiError and unexpected exceptions as JSON; counts every answer."""

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        route = request.match_info.route.resource
        # The route's pattern, not the raw path: unknown paths must not grow the label set.
        endpoint = route.canonical if route is not None else "unmatched"
        status = 500
        try:
            resp = await handler(request)
            status = 499 if request.get(CLIENT_GONE) else resp.status
            return resp
        except ApiError as exc:
            status = exc.status
            return exc.response()
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            # The client went away (nginx's 499 "client closed request"), or shutdown.
            status = 499
            raise
        except Exception as exc:
            if isinstance(exc, ConnectionResetError) and _client_gone(request):
                # The caller hung up mid-request (a peer killed or cut off
                # while sending a body or reading the answer): nobody to
                # answer, and nothing wrong on this side.
                status = 499
                log.info("client connection lost", endpoint=endpoint, remote=request.remote)
                return web.Response(status=499)
            log.exception("request failed", endpoint=endpoint)
            err = ApiError(
                500, "internal error in mooncaked; see the daemon's log", type="server_error"
            )
            return err.response()
        finally:
            metrics.http_requests.labels(endpoint=endpoint, status=str(status)).inc()

    return middleware
