"""Named objects over HTTP: ``/admin/objects...`` for operators and programs
(``mooncakectl objects``, ``mooncaked.objects.client``), and the swarm call
fetchers make to an object's origin.

- ``GET /admin/objects``: every object the cluster knows (newest first by
  name): size, shards, digest, origin, which node holds how many shards, and
  this node's copy (origin, complete, partial, fetching with its progress).
- ``GET /admin/objects/info?name=N``: the newest manifest of ``N`` this node
  knows, in full, and where its whole copy is here (if it has one).
- ``POST /admin/objects/put`` ``{"name", "path"}``: registers the file or
  directory at ``path`` (absolute, on this node) as ``name``; its manifest.
- ``POST /admin/objects/get`` ``{"name", "stream"}``: fetches ``name`` onto
  this node (or joins the fetch running). With ``stream`` (the default),
  server-sent events of its progress as it changes, the last one with
  ``"state": "done"`` and the copy's ``path``, then ``[DONE]``; without,
  one answer once it is done. A failed fetch says why (an ``error`` event
  when streaming, else 502).
- ``POST /admin/objects/rm`` ``{"name"}``: unregisters ``name`` here and
  drops this node's copies of it; 404 when it has neither.
- ``GET /admin/objects/data?name=N&file=I``: the bytes of file ``I`` of this
  node's whole copy of ``N`` (409 while it holds only part of it).
- ``POST /internal/objects/swarm`` (signed, node to node): ``SwarmCall`` ->
  ``SwarmAnswer``; 404 for an object this node knows nothing of.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from mooncaked.api.limits import BadBody, read_json_object
from mooncaked.api.render import SSE_DONE, json_response, sse_event
from mooncaked.api.signed import Rejected, read_signed_json, rpc_error
from mooncaked.config import check_object_name
from mooncaked.objects.messages import SwarmCall
from mooncaked.objects.service import Job, ObjectNotFound, ObjectStore
from mooncaked.rpc import Verifier
from mooncaked.wire.paths import MAX_SWARM_BYTES, OBJECTS_SWARM_PATH

StoreGetter = Callable[[], ObjectStore | None]


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return json_response({"error": {"message": message, "type": kind}}, status=status)


def _unavailable() -> web.Response:
    return _error(503, "objects are not running (starting or stopping)", "unavailable")


class ObjectsAPI:
    def __init__(self, store: StoreGetter, verifier: Verifier) -> None:
        self._store = store
        # The internal API's: calls signed for this node in this process.
        self._verifier = verifier

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/admin/objects", self.listing),
            web.get("/admin/objects/info", self.info),
            web.post("/admin/objects/put", self.put),
            web.post("/admin/objects/get", self.get),
            web.post("/admin/objects/rm", self.remove),
            web.get("/admin/objects/data", self.data),
            web.post(OBJECTS_SWARM_PATH, self.swarm),
        ]

    def status_section(self) -> dict[str, Any] | None:
        store = self._store()
        return None if store is None else store.status()

    async def listing(self, request: web.Request) -> web.Response:
        store = self._store()
        if store is None:
            return _unavailable()
        return json_response({"objects": store.listing()})

    async def info(self, request: web.Request) -> web.Response:
        store = self._store()
        if store is None:
            return _unavailable()
        name = request.query.get("name", "")
        entry = store.newest(name) if name else None
        if entry is None:
            return _error(404, f"no object named {name!r} is known here", "not_found")
        whole = store.whole_copy(name)
        here = whole is not None and whole.manifest.ref == entry.manifest.ref
        return json_response(
            {"manifest": entry.manifest.to_dict(), "path": str(whole.path) if here else None}
        )

    async def put(self, request: web.Request) -> web.Response:
        store = self._store()
        if store is None:
            return _unavailable()
        try:
            body = await read_json_object(request)
            name, path = _name(body), body.get("path")
            if not isinstance(path, str) or not path:
                raise BadBody("'path' must be the absolute path of a file or directory")
            manifest = await store.put(name, path)
        except ValueError as exc:  # BadBody included
            return _error(400, str(exc))
        except OSError as exc:
            return _error(400, f"cannot register {body.get('path')!r}: {exc}")
        return json_response(_summary(manifest.to_dict()))

    async def get(self, request: web.Request) -> web.StreamResponse:
        store = self._store()
        if store is None:
            return _unavailable()
        try:
            body = await read_json_object(request)
            name = _name(body)
            stream = body.get("stream", True)
            if not isinstance(stream, bool):
                raise BadBody("'stream' must be true or false")
            job = await store.get(name)
        except ObjectNotFound as exc:
            return _error(404, str(exc), "not_found")
        except ValueError as exc:
            return _error(400, str(exc))
        if not stream:
            path, why = await _outcome(job)
            if path is None:
                return _error(502, why, "fetch_failed")
            return json_response({**job.progress(), "path": path})
        return await _stream(request, job)

    async def remove(self, request: web.Request) -> web.Response:
        store = self._store()
        if store is None:
            return _unavailable()
        try:
            out = await store.remove(_name(await read_json_object(request)))
        except ObjectNotFound as exc:
            return _error(404, str(exc), "not_found")
        except ValueError as exc:
            return _error(400, str(exc))
        return json_response(out)

    async def data(self, request: web.Request) -> web.StreamResponse:
        store = self._store()
        if store is None:
            return _unavailable()
        name, raw = request.query.get("name", ""), request.query.get("file", "0")
        replica = store.whole_copy(name) if name else None
        if replica is None:
            return _error(409, f"this node holds no whole copy of {name!r}", "not_held")
        files = replica.files.paths
        if not raw.isdigit() or not int(raw) < len(files):
            return _error(400, f"'file' must be an index in 0..{len(files) - 1}, got {raw!r}")
        return web.FileResponse(files[int(raw)])

    async def swarm(self, request: web.Request) -> web.Response:
        try:
            data = await read_signed_json(request, self._verifier, max_bytes=MAX_SWARM_BYTES)
            call = SwarmCall.decode(data)
        except Rejected as bad:
            return bad.response
        except ValueError as exc:
            return rpc_error(400, str(exc))
        store = self._store()
        if store is None:
            return rpc_error(503, "objects are not running here (starting or stopping)")
        try:
            answer = await store.answer(call)
        except ObjectNotFound as exc:
            return rpc_error(404, str(exc))
        except ValueError as exc:
            return rpc_error(400, str(exc))
        return web.Response(body=answer.encode(), content_type="application/json")


def _name(body: dict[str, Any]) -> str:
    name = body.get("name")
    if not isinstance(name, str):
        raise BadBody("'name' must be the object's name")
    return check_object_name(name)


def _summary(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest without its checksums (what a person reads)."""
    out = {k: v for k, v in manifest.items() if k != "checksums"}
    out["num_shards"] = len(manifest["checksums"])
    return out


async def _outcome(job: Job) -> tuple[str | None, str]:
    """Once the job ends: the copy's path, or None and why not."""
    await asyncio.wait([job.result])
    if job.result.cancelled():
        return None, "the fetch was cancelled (the object was removed, or the node is stopping)"
    exc = job.result.exception()
    if exc is not None:
        return None, str(exc)
    return str(job.result.result().path), ""


async def _stream(request: web.Request, job: Job) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    fetch = job.fetch
    try:
        # The fetch wakes ``changed`` on every shard, and once more when its
        # job's result is set.
        while fetch is not None and not job.result.done():
            changed = fetch.changed
            await resp.write(sse_event(job.progress()))
            await changed.wait()
        path, why = await _outcome(job)
        if path is None:
            await resp.write(sse_event({"error": {"message": why, "type": "fetch_failed"}}))
        else:
            await resp.write(sse_event({**job.progress(), "path": path}))
        await resp.write(SSE_DONE)
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client left; the fetch goes on
    return resp
