"""Bounds on what a caller may send over HTTP: body read time, JSON nesting, queries.

Every JSON route, the API's and the cluster's alike, reads its body through
``read_json_object``, so a body that does not decode (a broken
``Content-Encoding``), arrives too slowly, or nests deeper than any request
needs is refused as the client's error (``BadBody``, a ``ValueError``) before
a handler walks it: a walk or a ``repr`` of a value 1,000 levels deep would
overflow the interpreter's recursion limit and surface as a 500. Query
parameters go through ``query_int`` and ``query_flag`` (``BadQuery``).

A low-level helper: it knows aiohttp requests, never a route or a subsystem.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

# Deepest JSON nesting a request may use; OpenAI's own shapes need about 5.
MAX_JSON_DEPTH = 32
# A body must arrive within this many seconds once its headers did, unless
# the app sets BODY_TIMEOUT_S (the daemon's server.body_timeout_s).
BODY_READ_TIMEOUT_S = 60.0
BODY_TIMEOUT_S = web.AppKey("body_timeout_s", float)


class BadBody(ValueError):
    """The request body is not a JSON object the server accepts."""

    def __init__(self, message: str, code: str = "invalid_json") -> None:
        super().__init__(message)
        self.code = code


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True if ``value`` nests lists/objects deeper than ``limit``; iterative,
    so it cannot itself overflow the recursion limit."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if depth >= limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


async def read_body(request: web.Request, timeout_s: float | None = None) -> bytes:
    """The raw (decoded) body; ``BadBody`` if it does not decode or arrive in time."""
    if timeout_s is None:
        timeout_s = request.app.get(BODY_TIMEOUT_S, BODY_READ_TIMEOUT_S)
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except web.RequestPayloadError as exc:
        # The body's Content-Encoding (gzip, deflate, br) does not decode.
        encoding = request.headers.get("Content-Encoding", "identity")
        raise BadBody(
            f"the request body could not be decoded as Content-Encoding {encoding!r}: "
            f"{exc.__class__.__name__}",
            code="invalid_encoding",
        ) from None
    except TimeoutError:
        raise BadBody(
            f"the request body did not arrive within {timeout_s:g} s", code="body_timeout"
        ) from None


async def read_json_object(request: web.Request, timeout_s: float | None = None) -> dict[str, Any]:
    """The body as a JSON object, checked for encoding, arrival time and depth."""
    raw = await read_body(request, timeout_s)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadBody(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadBody(f"the request body must be a JSON object, got {type_name(body)}")
    if too_deep(body):
        raise BadBody(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    return body


def type_name(v: Any) -> str:
    """JSON's name for the type of ``v``."""
    return {
        type(None): "null",
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(v), type(v).__name__)


def brief(v: Any, limit: int = 80) -> str:
    """A short, non-recursive rendering of a client's value for an error message."""
    if isinstance(v, (list, dict)):
        return f"{type_name(v)} of {len(v)} items"
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class BadQuery(ValueError):
    """A query parameter the route does not accept; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def body(self) -> dict[str, Any]:
        """The 400's body, in OpenAI's error shape."""
        return {
            "error": {
                "message": str(self),
                "type": "invalid_request_error",
                "param": self.param,
                "code": "invalid_value",
            }
        }


def query_int(query: Mapping[str, str], name: str, *, low: int, high: int) -> int | None:
    """``query[name]`` as an int in ``[low, high]``, None when absent; BadQuery otherwise.

    Only ASCII digits (and a leading minus) count: ``int()`` alone would take
    "1_000", " 5", "+5" or other scripts' digits, and a value past ``high``
    would reach code that cannot take it (``islice`` stops at sys.maxsize).
    """
    raw = query.get(name)
    if raw is None:
        return None
    text = raw[1:] if raw.startswith("-") else raw
    value = int(raw) if text.isascii() and text.isdigit() and len(text) <= 20 else None
    if value is None or not low <= value <= high:
        raise BadQuery(
            name, f"'{name}' must be an integer from {low} to {high}, got {brief(raw, 40)}"
        )
    return value


def query_flag(query: Mapping[str, str], name: str) -> bool:
    """``query[name]`` as a flag: absent, "0" or "false" is False, "", "1" or "true" True."""
    raw = query.get(name)
    if raw is None:
        return False
    value = raw.lower()
    if value in ("", "1", "true"):
        return True
    if value in ("0", "false"):
        return False
    raise BadQuery(name, f"'{name}' must be 1, true, 0 or false, got {brief(raw, 40)}")
