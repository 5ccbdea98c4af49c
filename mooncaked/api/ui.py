"""The status page: ``GET /ui`` and its two assets, static files of this package.

The page is plain HTML, one script and one stylesheet (``mooncaked/api/static/``,
shipped as package data): no build step, nothing fetched from anywhere but
the node that served it. The script polls ``/admin/status``,
``/admin/cluster``, ``/admin/cache/stats`` and ``/admin/requests/recent``
and renders them; every node serves it and shows the whole cluster, as its
gossip view has every member.

The files are read once, when the routes are built, and served from memory
with a Content-Security-Policy that forbids loading or connecting to any
other origin.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from aiohttp import web

# Name under /ui/ -> (file in static/, content type).
_ASSETS = {
    "app.js": "text/javascript",
    "style.css": "text/css",
}
_INDEX = "index.html"
_HEADERS = {
    # Everything from this node, nothing inline, no frames: the page cannot
    # reach another host even if a node id or prompt carried markup.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; "
        "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    # A node upgraded in place serves its new page at the next load.
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True, slots=True)
class _File:
    body: bytes
    content_type: str


def _read(name: str) -> bytes:
    return resources.files("mooncaked.api").joinpath("static", name).read_bytes()


def ui_routes() -> list[web.RouteDef]:
    """``/ui`` (the page; ``/ui/`` too) and ``/ui/{asset}``; raises if a file is missing."""
    files = {name: _File(_read(name), ctype) for name, ctype in _ASSETS.items()}
    index = _File(_read(_INDEX), "text/html")

    def respond(f: _File) -> web.Response:
        return web.Response(
            body=f.body, content_type=f.content_type, charset="utf-8", headers=_HEADERS
        )

    async def page(_request: web.Request) -> web.Response:
        return respond(index)

    async def asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        f = files.get(name)
        if f is None:
            raise web.HTTPNotFound(
                text=f"no status-page asset named {name!r}; there are: {', '.join(sorted(files))}"
            )
        return respond(f)

    return [
        web.get("/ui", page),
        web.get("/ui/", page),
        web.get("/ui/{name}", asset),
    ]
