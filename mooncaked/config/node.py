"""The node itself: its identity and role, its HTTP server, its logs."""

from __future__ import annotations

import socket
import urllib.parse
from dataclasses import dataclass
from typing import Literal

from mooncaked.config.errors import ConfigValueError, check

# "memory": no model weights; holds KV and computes decode attention for
# compute nodes (attention offloading).
Role = Literal["both", "prefill", "decode", "memory"]

ORIGIN_DEFAULT_PORTS = {"http": 80, "https": 443}


def split_origin(origin: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of a web origin such as ``http://host:8000``,
    lower-cased, the port filled in from the scheme; ValueError if it is not one."""
    parts = urllib.parse.urlsplit(origin.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1
    if (
        parts.scheme not in ORIGIN_DEFAULT_PORTS
        or not parts.hostname
        or port == -1
        or parts.username is not None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        raise ValueError(
            f"{origin!r} is not an origin: write scheme://host[:port], e.g. "
            "'https://ops.example.com' or 'http://10.0.0.5:8000'"
        )
    return (
        parts.scheme,
        parts.hostname,
        port if port is not None else ORIGIN_DEFAULT_PORTS[parts.scheme],
    )


@dataclass(frozen=True, slots=True)
class NodeConfig:
    # Empty means "<hostname>-<server port>", unique per daemon on one host.
    id: str = ""
    role: Role = "both"
    # Authenticates transfer handshakes and gossip messages. Every node of a
    # cluster must share it; the default only suits a single trusted host.
    cluster_secret: str = "mooncaked-insecure-default-secret"
    # A file holding the secret (e.g. a systemd credential); read at start,
    # its trailing newline stripped. Wins over cluster_secret and the
    # MOONCAKED_CLUSTER_SECRET environment variable.
    cluster_secret_file: str = ""
    # Where the daemon keeps state (SSD tier, logs of its own); empty: a
    # per-user directory under the system temp dir.
    data_dir: str = ""
    # CPUs the daemon runs on, as a Linux CPU list ("0-3,8"); empty: those it
    # was started with. Daemons sharing a host each get cores of their own,
    # so one node's steps do not slow another's, as on machines of their own.
    cpus: str = ""

    def __post_init__(self) -> None:
        check(len(self.cluster_secret) >= 8, "cluster_secret", "must be at least 8 characters")
        if self.cpus:
            try:
                parse_cpu_list(self.cpus)
            except ValueError as exc:
                raise ConfigValueError("cpus", str(exc)) from None

    def id_at(self, port: int) -> str:
        """``id``, else ``<hostname>-<API port>``: unique per daemon on one host."""
        return self.id or f"{socket.gethostname()}-{port}"


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a Linux CPU list ("0-3,8"), as in taskset and cpuset."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise ValueError(f"{part!r} in {text!r} is not a CPU or a range of CPUs") from None
        if first < 0 or last < first:
            raise ValueError(f"{part!r} in {text!r} is not a CPU or a range of CPUs")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # On SIGTERM: in-flight requests get this long to finish, then are cancelled.
    drain_timeout_s: float = 30.0
    # A request body must arrive within this many seconds of its headers.
    body_timeout_s: float = 60.0
    # A connection with no complete request for this long is closed: an idle
    # keep-alive, or headers that trickle in (slow clients holding sockets).
    idle_timeout_s: float = 75.0
    # Connections served at once; one more is answered 503 and closed unread.
    max_connections: int = 1024
    # Connections one client address may hold at once (0: no limit), so one
    # client cannot take every connection; behind a proxy every client is one
    # address, so set 0 there.
    max_connections_per_client: int = 512
    # Connections accepted beyond max_connections that serve only /health,
    # /ready and requests bearing the admin token: a full server still
    # answers its probes and its operator.
    reserved_connections: int = 16
    # Origins (scheme://host[:port]) a browser page may send state changes
    # from, besides this node's own; also accepted as the Host of /admin and /ui.
    allowed_origins: tuple[str, ...] = ()
    # Keys /v1 accepts as "Authorization: Bearer <key>"; empty: /v1 is open.
    api_keys: tuple[str, ...] = ()
    # Token /admin needs as "Authorization: Bearer <token>"; empty: /admin
    # answers only clients on loopback.
    admin_token: str = ""
    # /metrics needs an API key or the admin token too.
    metrics_require_auth: bool = False

    def __post_init__(self) -> None:
        check(0 <= self.port <= 65535, "port", f"must be in 0..65535, got {self.port}")
        check(self.drain_timeout_s >= 0, "drain_timeout_s", "must be >= 0")
        check(self.body_timeout_s > 0, "body_timeout_s", "must be > 0")
        check(self.idle_timeout_s > 0, "idle_timeout_s", "must be > 0")
        check(self.max_connections > 0, "max_connections", "must be > 0")
        check(
            self.max_connections_per_client >= 0,
            "max_connections_per_client",
            f"must be >= 0 (0: no limit), got {self.max_connections_per_client}",
        )
        check(
            self.reserved_connections >= 0,
            "reserved_connections",
            f"must be >= 0, got {self.reserved_connections}",
        )
        for origin in self.allowed_origins:
            try:
                split_origin(origin)
            except ValueError as exc:
                raise ConfigValueError("allowed_origins", str(exc)) from None


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"
    # auto: console on a terminal, JSON otherwise.
    format: Literal["auto", "json", "console"] = "auto"
