"""Requests a web browser can be made to send, refused where they change state.

Any page an operator opens can make the browser send requests to this node's
loopback address: a cross-origin POST with a form or ``text/plain`` body goes
out without a CORS preflight, and DNS rebinding points the page's own domain
at this node, so the page reads the answers too. A node on loopback has no
admin token and no API key by default, so nothing else stops such a request
from draining the node or running the model. Hence:

- a state change (any method but GET, HEAD, OPTIONS) under ``/admin/``, and
  under ``/v1/`` while no API key is set, is refused (403) when it carries an
  ``Origin`` that is not this node (nor one of ``server.allowed_origins``) or
  ``Sec-Fetch-Site: cross-site``. Browsers send ``Origin`` on every such
  request, same-origin ones included; mooncakectl, the openai client and curl
  send none;
- a state change under ``/admin/`` needs ``Content-Type: application/json``
  (415 otherwise), a type a page cannot send cross-origin without a preflight;
- ``/admin/`` and ``/ui`` answer only a ``Host`` that names this node: its
  configured and bound addresses, its host name, localhost, 127.0.0.1 or
  [::1], on the port the request reached; under DNS rebinding the browser
  names the attacker's domain instead;
- with no admin token, ``/admin/`` answers only peers on loopback.

``/internal/*`` signs its own calls; ``/health``, ``/ready`` and ``/metrics``
change nothing.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web

from mooncaked.api.openai import ApiError
from mooncaked.config import ORIGIN_DEFAULT_PORTS, ServerConfig, split_origin

_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Names every node answers to, whatever it is bound to.
_LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# Never part of a Host header's host[:port]; their presence means a smuggled URL.
_NOT_IN_HOST = frozenset("/?#@\\ \t")


def is_loopback_peer(address: str | None) -> bool:
    """True if ``address`` (a peer's IP) is on loopback, IPv4-mapped IPv6 included."""
    if not address:
        return False
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def _split_host(value: str) -> tuple[str, int | None] | None:
    """``(host, port)`` of a Host header (port None when absent); None if malformed."""
    if not value or any(c in _NOT_IN_HOST for c in value):
        return None
    try:
        parts = urllib.parse.urlsplit("//" + value)
        host = parts.hostname
        port = parts.port
    except ValueError:  # a bad port or an unclosed [IPv6 literal
        return None
    if not host:
        return None
    return host.lower().rstrip("."), port


def _local_address(request: web.Request) -> tuple[str, int] | None:
    transport = request.transport
    if transport is None:
        return None
    sockname = transport.get_extra_info("sockname")
    if not isinstance(sockname, tuple) or len(sockname) < 2:
        return None
    return str(sockname[0]).lower(), int(sockname[1])


def _forbidden(message: str, code: str) -> ApiError:
    return ApiError(403, message, type="permission_error", code=code)


class _BrowserGuard:
    """The checks of the module docstring, with what they compare against."""

    __slots__ = ("admin_open", "allowed_hosts", "allowed_origins", "node_names", "v1_open")

    def __init__(self, server: ServerConfig, node_hosts: Iterable[str]) -> None:
        names = set(_LOCAL_NAMES)
        names.add(socket.gethostname().lower())
        # A wildcard bind's own address too: the daemon's URL says http://0.0.0.0:port,
        # and DNS rebinding can only make a browser name a domain.
        names.update(h.strip("[]").lower() for h in (server.host, *node_hosts) if h)
        self.node_names = frozenset(names)
        allowed_origins = frozenset(split_origin(o) for o in server.allowed_origins)
        self.allowed_origins = allowed_origins
        # A Host with no port matches an allowed origin on its scheme's default
        # port (a proxy in front: https://ops.example.com sends Host ops.example.com).
        self.allowed_hosts = frozenset(
            (host, None if port == ORIGIN_DEFAULT_PORTS[scheme] else port)
            for scheme, host, port in allowed_origins
        ) | frozenset((host, port) for _, host, port in allowed_origins)
        self.admin_open = not server.admin_token
        self.v1_open = not server.api_keys

    def check(self, request: web.Request) -> None:
        """Raise the ApiError a request gets, if it is one this node refuses."""
        path = request.path
        admin = path.startswith("/admin/")
        if admin and self.admin_open and not is_loopback_peer(request.remote):
            raise _forbidden(
                "/admin/ answers other hosts only with an admin token: set "
                "server.admin_token or MOONCAKED_ADMIN_TOKEN on this node",
                "admin_not_local",
            )
        if admin or path == "/ui" or path.startswith("/ui/"):
            self.check_host(request)
        if request.method not in _SAFE_METHODS:
            if admin or (self.v1_open and path.startswith("/v1/")):
                self.check_origin(request)
            if admin and request.content_type != "application/json":
                raise ApiError(
                    415,
                    f"{request.method} {path} needs a JSON body: send 'Content-Type: "
                    "application/json' (e.g. curl -H 'Content-Type: application/json' -d '{}')",
                    code="unsupported_media_type",
                )

    def names_this_node(self, host: str, port: int | None, request: web.Request) -> bool:
        if (host, port) in self.allowed_hosts:
            return True
        local = _local_address(request)
        if local is None or (80 if port is None else port) != local[1]:
            return False
        return host in self.node_names or host == local[0]

    def check_host(self, request: web.Request) -> None:
        value = request.headers.get("Host")
        if value is None:
            return  # HTTP/1.0 without Host: not a browser
        split = _split_host(value)
        if split is None or not self.names_this_node(split[0], split[1], request):
            raise _forbidden(
                f"Host {ascii(value)[1:-1]!r} does not name this node; address it by its own "
                "host name or address, or add the origin to server.allowed_origins",
                "host_not_allowed",
            )

    def check_origin(self, request: web.Request) -> None:
        if request.headers.get("Sec-Fetch-Site", "").lower() == "cross-site":
            raise _forbidden(
                f"{request.method} {request.path} is refused from a cross-site page",
                "cross_origin_request",
            )
        origin = request.headers.get("Origin")
        if origin is None:
            return
        try:
            scheme, host, port = split_origin(origin)
        except ValueError:
            scheme, host, port = "", "", -1
        if (scheme, host, port) in self.allowed_origins:
            return
        if scheme == "http" and self.names_this_node(host, port, request):
            return
        raise _forbidden(
            f"{request.method} {request.path} is refused from origin {ascii(origin)[1:-1]!r}, "
            "which is not this node; list it in server.allowed_origins to allow it",
            "cross_origin_request",
        )


def browser_guard_middleware(server: ServerConfig, *, node_hosts: Iterable[str] = ()) -> Any:
    """The checks of the module docstring; ``node_hosts``: more names this node
    is reached by (the address it announces to its cluster)."""
    guard = _BrowserGuard(server, node_hosts)

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        guard.check(request)
        return await handler(request)

    return middleware
