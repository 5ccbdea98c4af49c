"""A small blocking HTTP client for mooncaked's JSON and SSE endpoints (stdlib only)."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol


class Sink(Protocol):
    """Where ``Client.download`` writes (a binary file, or anything that takes bytes)."""

    def write(self, data: bytes, /) -> object: ...


class DaemonUnreachable(Exception):
    """No answer from the daemon: refused, unknown host, timed out, connection lost."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot reach mooncaked at {url}: {reason}")
        self.url = url
        self.reason = reason


class DaemonError(Exception):
    """The daemon answered with an error (HTTP status >= 400, or an error event)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"mooncaked answered {status}: {message}")
        self.status = status
        self.message = message


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timed out"
    if isinstance(exc, socket.gaierror):
        return f"unknown host ({exc.strerror})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _error_message(status: int, raw: bytes) -> str:
    try:
        body = json.loads(raw)
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        text = raw.decode("utf-8", errors="replace").strip()
        return text or http.client.responses.get(status, "error")


class Client:
    def __init__(self, url: str, timeout: float = 30.0, token: str = "") -> None:
        parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url must look like http://HOST:PORT, got {url!r}")
        self.url = url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._base = parts.path.rstrip("/")
        self._timeout = timeout
        # Sent as a bearer token: the node's admin token (or an API key).
        self._token = token

    def _connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=self._timeout)

    def _request(
        self, method: str, path: str, body: Any | None
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._connect()
        headers = {"Accept": "application/json, text/event-stream"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, self._base + path, body=data, headers=headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise DaemonUnreachable(self.url, _reason(exc)) from exc
        if resp.status >= 400:
            try:
                raw = resp.read()
            except (OSError, http.client.HTTPException):
                raw = b""
            conn.close()
            raise DaemonError(resp.status, _error_message(resp.status, raw))
        return conn, resp

    def get_json(self, path: str) -> Any:
        return self._json("GET", path, None)

    def post_json(self, path: str, body: Any) -> Any:
        return self._json("POST", path, body)

    def _json(self, method: str, path: str, body: Any | None) -> Any:
        conn, resp = self._request(method, path, body)
        try:
            raw = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise DaemonUnreachable(self.url, _reason(exc)) from exc
        finally:
            conn.close()
        try:
            return json.loads(raw)
        except ValueError:
            raise DaemonError(resp.status, "the answer is not JSON") from None

    def download(self, path: str, out: Sink, chunk_bytes: int = 1 << 20) -> int:
        """GETs ``path`` and writes its body to ``out`` as it arrives; the bytes written."""
        conn, resp = self._request("GET", path, None)
        total = 0
        try:
            while True:
                try:
                    chunk = resp.read(chunk_bytes)
                except (OSError, http.client.HTTPException) as exc:
                    raise DaemonUnreachable(self.url, _reason(exc)) from exc
                if not chunk:
                    return total
                out.write(chunk)
                total += len(chunk)
        finally:
            conn.close()

    def stream(
        self,
        path: str,
        body: Any,
        on_headers: Callable[[Mapping[str, str]], None] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """POSTs ``body`` and yields each server-sent event's JSON until ``[DONE]``;
        ``on_headers`` gets the response headers (lower-case names) first."""
        conn, resp = self._request("POST", path, body)
        try:
            if on_headers is not None:
                on_headers({k.lower(): v for k, v in resp.getheaders()})
            data: list[str] = []
            while True:
                try:
                    line = resp.readline()
                except (OSError, http.client.HTTPException) as exc:
                    raise DaemonUnreachable(self.url, _reason(exc)) from exc
                if not line:
                    raise DaemonUnreachable(self.url, "the stream ended before [DONE]")
                text = line.decode("utf-8").rstrip("\r\n")
                if text.startswith("data:"):
                    data.append(text[5:].lstrip())
                    continue
                if text or not data:
                    continue  # comments, other fields, keep-alive blank lines
                payload, data = "\n".join(data), []
                if payload == "[DONE]":
                    return
                event = json.loads(payload)
                if isinstance(event, dict) and "error" in event:
                    err = event["error"]
                    msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                    raise DaemonError(resp.status, msg)
                yield event
        finally:
            conn.close()
