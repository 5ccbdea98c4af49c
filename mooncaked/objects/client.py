"""A Python client for named objects, over a node's admin API (blocking, stdlib only).

    from mooncaked.objects.client import ObjectsClient

    objects = ObjectsClient("http://127.0.0.1:8000")
    objects.put("smollm2", "/models/smollm2.gguf")      # a path on that node
    for o in objects.list():
        print(o["name"], o["version"], o["holders"])
    where = objects.get("smollm2")                       # fetched onto the node
    objects.get("smollm2", "/tmp/smollm2.gguf")          # and downloaded here, checked
    objects.remove("smollm2")

In the spirit of the Mooncake Store's Python API (``put`` / ``get`` /
``remove``), for objects that are files: ``put`` registers a file the node
can read (nothing is copied), ``get`` fetches from whichever nodes hold it
and, given a local path, downloads the node's copy, each shard checked
against the manifest as it arrives.

Errors: ``ObjectsError`` (the node answered with one; ``status`` is its
HTTP status: 404 for an object nobody knows, 502 for a fetch that failed),
``ConnectionError`` (no answer), ``ValueError`` (a bad name, a download
whose bytes failed their check).
"""

from __future__ import annotations

import http.client
import json
import os
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mooncaked.config import check_object_name
from mooncaked.objects.manifest import Manifest, StreamChecker

Progress = Callable[[dict[str, Any]], None]


class ObjectsError(Exception):
    """The node answered with an error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class ObjectsClient:
    def __init__(
        self, url: str = "http://127.0.0.1:8000", *, token: str = "", timeout: float = 60.0
    ) -> None:
        """``token``: the node's admin token (``server.admin_token``), if it has one."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the node's URL must look like http://HOST:PORT, got {url!r}")
        self.url = url.rstrip("/")
        self._parts = parts
        self._token = token
        self._timeout = timeout

    # -- the API ---------------------------------------------------------------

    def put(self, name: str, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Registers the file or directory at ``path`` on the node as ``name``;
        its manifest (checksums left out)."""
        check_object_name(name)
        return self._json(
            "POST", "/admin/objects/put", {"name": name, "path": os.path.abspath(path)}
        )

    def list(self) -> list[dict[str, Any]]:
        """Every object the cluster knows: versions, sizes, who holds which shards."""
        return list(self._json("GET", "/admin/objects", None)["objects"])

    def get(
        self,
        name: str,
        path: str | os.PathLike[str] | None = None,
        *,
        on_progress: Progress | None = None,
    ) -> str:
        """Fetches ``name`` onto the node (``on_progress`` sees each step), and
        with ``path`` downloads it there; where it is (on the node, or ``path``)."""
        check_object_name(name)
        last: dict[str, Any] = {}
        for event in self._events("/admin/objects/get", {"name": name, "stream": True}):
            last = event
            if on_progress is not None:
                on_progress(event)
        if path is None:
            return str(last["path"])
        return self._download(name, Path(path))

    def remove(self, name: str) -> dict[str, Any]:
        """Unregisters ``name`` on the node and drops its copies there."""
        check_object_name(name)
        return self._json("POST", "/admin/objects/rm", {"name": name})

    # -- HTTP ------------------------------------------------------------------

    def _download(self, name: str, output: Path) -> str:
        q = urllib.parse.quote(name)
        manifest = Manifest.from_dict(
            self._json("GET", f"/admin/objects/info?name={q}", None)["manifest"]
        )
        if output.is_dir():
            output = output / manifest.root
        checker = StreamChecker(manifest)
        for i, f in enumerate(manifest.files):
            target = output / f.path if manifest.is_dir else output
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".part")
            try:
                with open(tmp, "wb") as out:
                    for chunk in self._chunks(f"/admin/objects/data?name={q}&file={i}"):
                        checker.update(chunk)
                        out.write(chunk)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            tmp.replace(target)
        checker.finish()
        return str(output)

    def _connect(self) -> http.client.HTTPConnection:
        p = self._parts
        cls = http.client.HTTPSConnection if p.scheme == "https" else http.client.HTTPConnection
        return cls(
            p.hostname or "", p.port or (443 if p.scheme == "https" else 80), timeout=self._timeout
        )

    def _open(
        self, method: str, path: str, body: Any
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        headers = {"Accept": "application/json, text/event-stream"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        conn = self._connect()
        try:
            conn.request(method, self._parts.path.rstrip("/") + path, body=data, headers=headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise ConnectionError(f"cannot reach {self.url}: {exc}") from exc
        if resp.status >= 400:
            raw = resp.read()
            conn.close()
            raise ObjectsError(resp.status, _message(raw))
        return conn, resp

    def _json(self, method: str, path: str, body: Any) -> Any:
        conn, resp = self._open(method, path, body)
        try:
            return json.loads(resp.read())
        finally:
            conn.close()

    def _chunks(self, path: str) -> Iterator[bytes]:
        conn, resp = self._open("GET", path, None)
        try:
            while chunk := resp.read(1 << 20):
                yield chunk
        finally:
            conn.close()

    def _events(self, path: str, body: Any) -> Iterator[dict[str, Any]]:
        conn, resp = self._open("POST", path, body)
        try:
            for line in resp:
                text = line.decode().strip()
                if not text.startswith("data:"):
                    continue
                payload = text[5:].strip()
                if payload == "[DONE]":
                    return
                event = json.loads(payload)
                if "error" in event:
                    raise ObjectsError(502, str(event["error"].get("message")))
                yield event
        finally:
            conn.close()
        raise ConnectionError(f"{self.url}: the progress stream ended before the fetch did")


def _message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:300]
