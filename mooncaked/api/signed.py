"""The server side of signed node-to-node calls, shared by every internal route.

``read_signed_json`` checks a call in the order that costs an attacker most
and this node least: the signature headers and timestamp first, then the
announced size, and only then reads the body, verifies the signature over it
and remembers its nonce (``mooncaked.rpc``).
"""

from __future__ import annotations

from typing import Any

import orjson
import structlog
from aiohttp import web

from mooncaked.bounds import MAX_JSON_DEPTH, BadBody, read_body, too_deep
from mooncaked.rpc import Verifier
from mooncaked.wire.errors import ErrorAnswer

log = structlog.get_logger(__name__)


class Rejected(Exception):
    """A call refused with ``response``."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


def rpc_error(
    status: int,
    message: str,
    headers: dict[str, str] | None = None,
    *,
    code: str | None = None,
) -> web.Response:
    """A refused internal call's answer (``wire.errors.ErrorAnswer``)."""
    return web.Response(
        body=ErrorAnswer(message, code=code).encode(),
        status=status,
        headers=headers,
        content_type="application/json",
    )


def _unauthorized(request: web.Request, reason: str) -> Rejected:
    log.warning("internal.unauthorized", path=request.path, remote=request.remote, reason=reason)
    return Rejected(rpc_error(401, reason))


async def read_signed_json(
    request: web.Request, verifier: Verifier, *, max_bytes: int
) -> dict[str, Any]:
    """The call's JSON object once it proves itself; raises ``Rejected``."""
    reason = verifier.check_headers(request.headers)
    if reason is not None:
        raise _unauthorized(request, reason)
    length = request.content_length
    if length is None:
        raise Rejected(rpc_error(411, "a signed call must give its Content-Length"))
    if length > max_bytes:
        raise Rejected(
            rpc_error(413, f"a {request.path} call is at most {max_bytes} bytes, got {length}")
        )
    try:
        raw = await read_body(request)
    except BadBody as exc:
        raise Rejected(rpc_error(400, str(exc))) from None
    reason = verifier.verify(request.method, request.path, request.headers, raw)
    if reason is not None:
        raise _unauthorized(request, reason)
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise Rejected(rpc_error(400, "body is not JSON")) from None
    if not isinstance(data, dict):
        raise Rejected(rpc_error(400, "body must be a JSON object"))
    if too_deep(data):
        raise Rejected(rpc_error(400, f"body nests deeper than {MAX_JSON_DEPTH} levels"))
    return data
