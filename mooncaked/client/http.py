"""The client's transport: one call to a node's admin API, blocking or async.

A call is plain data (``Call``: method, path, JSON body, and how to read
the answer), built once per operation by the operation modules (``kv.py``)
and run by either transport: ``SyncTransport`` (stdlib ``http.client``, no
event loop) or ``AsyncTransport`` (aiohttp, on the caller's loop). An error
answer raises ``StoreError`` with the node's message and the field it
names; no answer raises ``StoreUnreachable``.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import aiohttp

T = TypeVar("T")


class StoreUnreachable(Exception):
    """No answer from the node: refused, unknown host, timed out, cut."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot reach mooncaked at {url}: {reason}")
        self.url = url
        self.reason = reason


class StoreError(Exception):
    """The node answered with an error: its HTTP status, message, and the
    field it blames (``param``) and its code, when it names them."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(f"mooncaked answered {status}: {message}")
        self.status = status
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request to the admin API and how its JSON answer becomes a ``T``."""

    method: str
    path: str
    body: dict[str, Any] | None
    parse: Callable[[Any], T]


def base_url(url: str) -> str:
    """``url`` checked: http(s)://host[:port][/prefix], no trailing slash."""
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"a node's URL must look like http://HOST:PORT, got {url!r}")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


def _headers(token: str, with_body: bool) -> dict[str, str]:
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if with_body:
        headers["Content-Type"] = "application/json"
    return headers


def error_of(status: int, raw: bytes) -> StoreError:
    """The node's error answer (OpenAI-shaped, or an internal one) as a StoreError."""
    try:
        err = json.loads(raw)["error"]
        if isinstance(err, dict):
            return StoreError(status, str(err["message"]), err.get("param"), err.get("code"))
        return StoreError(status, str(err))
    except (ValueError, KeyError, TypeError):
        text = raw.decode("utf-8", errors="replace").strip()
        return StoreError(status, text or http.client.responses.get(status, "error"))


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


class SyncTransport:
    """Blocking calls, one connection each (stdlib only)."""

    def __init__(self, url: str, *, token: str = "", timeout_s: float = 60.0) -> None:
        self.url = base_url(url)
        parts = urllib.parse.urlsplit(self.url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path
        self._token = token
        self._timeout_s = timeout_s

    def run(self, call: Call[T]) -> T:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=self._timeout_s)
        data = None if call.body is None else json.dumps(call.body).encode()
        try:
            conn.request(
                call.method,
                self._prefix + call.path,
                body=data,
                headers=_headers(self._token, data is not None),
            )
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise StoreUnreachable(self.url, _reason(exc)) from exc
        finally:
            conn.close()
        if resp.status >= 400:
            raise error_of(resp.status, raw)
        try:
            return call.parse(json.loads(raw))
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(resp.status, f"the answer is not what was expected: {exc}") from None


class AsyncTransport:
    """Calls on the caller's event loop, over one aiohttp session."""

    def __init__(self, url: str, *, token: str = "", timeout_s: float = 60.0) -> None:
        self.url = base_url(url)
        self._token = token
        self._timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self._timeout_s)
            )

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def run(self, call: Call[T]) -> T:
        await self.open()
        session = self._session
        if session is None:
            raise RuntimeError("the client's session did not open")
        try:
            async with session.request(
                call.method,
                self.url + call.path,
                json=call.body,
                headers=_headers(self._token, False),
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise StoreUnreachable(self.url, _reason(exc)) from exc
        if status >= 400:
            raise error_of(status, raw)
        try:
            return call.parse(json.loads(raw))
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(status, f"the answer is not what was expected: {exc}") from None
