"""``mooncaked`` nodes in Linux network namespaces of their own, on one bridge.

Loopback clusters share one network stack, so a partition can only be staged
inside the daemon. Here each node has its own namespace, address and routes:

- a bridge in the root namespace holds ``10.x.y.1/24`` (x, y drawn from a
  random suffix that also names every link and namespace, so parallel runs
  never collide); the test process reaches every node through it;
- each node's namespace has ``lo`` up, one end of a veth pair with its own
  ``10.x.y.N/24`` and a default route via the bridge; the other end is on the
  bridge;
- a daemon runs as ``ip netns exec NS python -m mooncaked``, listening on its
  node's address, with a strong cluster secret from a 0600 file and an admin
  token (the admin API answers a non-loopback peer only with one).

Faults: ``block(src, dst)`` adds a blackhole route for ``dst`` in ``src``'s
namespace (``src`` can send nothing to ``dst``; iptables is not needed),
``partition`` blocks both ways, ``heal`` deletes every such route; freeze
(SIGSTOP), thaw (SIGCONT) and kill (SIGKILL) act on the daemon itself.
Teardown kills what runs in the namespaces and deletes them and the bridge,
also when a test fails halfway.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncakectl.local.config import merge_sections, to_toml
from mooncaked.secrets import generate_secret
from tests.conftest import TEST_SECTIONS, DaemonProcess, spawn_daemon

# Every namespace has a network stack of its own, so every node can listen on
# the same well-known ports; the seed address is known before any node starts.
HTTP_PORT = 8000
GOSSIP_PORT = 7946
_IP_TIMEOUT_S = 10.0
_HTTP_TIMEOUT_S = 10.0


class NetnsError(RuntimeError):
    """An ``ip`` command failed."""


def _run_ip(*args: str, netns: str | None = None) -> str:
    cmd = ["ip", *(("-n", netns) if netns else ()), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@functools.cache
def unavailable() -> str | None:
    """Why namespaces cannot be used here (a reason for ``pytest.skip``), or None.

    Tried rather than assumed: a container may be root yet lack the rights
    (CAP_SYS_ADMIN, CAP_NET_ADMIN) or the kernel parts (veth, bridge).
    """
    missing = "network namespaces need root and iproute2"
    if os.geteuid() != 0:
        return f"{missing}; not running as root"
    if shutil.which("ip") is None:
        return f"{missing}; the `ip` command is not installed"
    probe = f"mcq{secrets.token_hex(3)}"
    try:
        _run_ip("netns", "add", probe)
    except (NetnsError, OSError, subprocess.TimeoutExpired) as exc:
        return f"{missing}; `ip netns add` does not work here: {exc}"
    try:
        _run_ip("link", "add", f"{probe}b", "type", "bridge")
        _run_ip("link", "del", f"{probe}b")
        _run_ip("link", "add", f"{probe}v", "type", "veth", "peer", "name", f"{probe}p")
        _run_ip("link", "del", f"{probe}v")
    except (NetnsError, OSError, subprocess.TimeoutExpired) as exc:
        return f"{missing}; bridges and veth pairs cannot be made here: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _routed_networks() -> list[ipaddress.IPv4Network]:
    out = []
    for line in _run_ip("-4", "-o", "route", "show", "table", "all").splitlines():
        words = line.split()
        for word in words[:2]:
            try:
                out.append(ipaddress.IPv4Network(word, strict=False))
                break
            except ValueError:
                continue
    return out


def _free_subnet(suffix: str) -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 from ``suffix`` that no route of this host overlaps."""
    used = _routed_networks()
    for attempt in range(256):
        digest = hashlib.sha256(f"{suffix}/{attempt}".encode()).digest()
        net = ipaddress.IPv4Network(f"10.{64 + digest[0] % 160}.{digest[1]}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise NetnsError(f"no free 10.x.y.0/24 subnet for suffix {suffix!r}")


@dataclass(frozen=True, slots=True)
class Host:
    name: str
    netns: str
    addr: str
    # The veth end on the bridge, in the root namespace.
    veth: str


@dataclass(slots=True)
class Fabric:
    """A bridge and one namespace per host; the blackhole routes now in place."""

    suffix: str
    subnet: ipaddress.IPv4Network
    hosts: dict[str, Host] = field(default_factory=dict)
    blocked: set[tuple[str, str]] = field(default_factory=set)

    @property
    def bridge(self) -> str:
        return f"mcb{self.suffix}"

    @property
    def gateway(self) -> str:
        return str(self.subnet.network_address + 1)

    def up(self) -> None:
        _run_ip("link", "add", self.bridge, "type", "bridge")
        _run_ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        _run_ip("link", "set", self.bridge, "up")

    def add(self, name: str) -> Host:
        n = len(self.hosts) + 2
        netns = f"mc{self.suffix}-{name}"
        outer, inner = f"mcv{self.suffix}{n}", f"mcp{self.suffix}{n}"
        host = Host(name, netns, str(self.subnet.network_address + n), outer)
        _run_ip("netns", "add", netns)
        # Recorded at once, so teardown removes a namespace set up halfway.
        self.hosts[name] = host
        _run_ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _run_ip("link", "set", inner, "netns", netns)
        _run_ip("link", "set", outer, "master", self.bridge)
        _run_ip("link", "set", outer, "up")
        _run_ip("link", "set", "lo", "up", netns=netns)
        _run_ip("addr", "add", f"{host.addr}/{self.subnet.prefixlen}", "dev", inner, netns=netns)
        _run_ip("link", "set", inner, "up", netns=netns)
        _run_ip("route", "add", "default", "via", self.gateway, netns=netns)
        return host

    def block(self, src: str, dst: str) -> None:
        """``src`` can send nothing to ``dst`` (its packets are dropped at its own
        routing table); ``dst`` still reaches ``src``, whose replies go nowhere."""
        _run_ip(
            "route", "add", "blackhole", f"{self.hosts[dst].addr}/32", netns=self.hosts[src].netns
        )
        self.blocked.add((src, dst))

    def partition(self, side_a: Iterable[str], side_b: Iterable[str]) -> None:
        b = list(side_b)
        for x in side_a:
            for y in b:
                self.block(x, y)
                self.block(y, x)

    def heal(self) -> None:
        for src, dst in sorted(self.blocked):
            _run_ip(
                "route",
                "del",
                "blackhole",
                f"{self.hosts[dst].addr}/32",
                netns=self.hosts[src].netns,
            )
            self.blocked.discard((src, dst))

    def down(self) -> list[str]:
        """Everything removed, best effort; what could not be (empty when clean)."""
        problems: list[str] = []
        for host in self.hosts.values():
            # Only processes in this run's own namespaces: ours by construction.
            pids = subprocess.run(
                ["ip", "netns", "pids", host.netns], capture_output=True, text=True, check=False
            ).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            # The pair goes with either end, but with the namespace's only once
            # the kernel gets round to freeing it: deleted here, it is gone now.
            done = subprocess.run(
                ["ip", "link", "del", host.veth], capture_output=True, text=True, check=False
            )
            if done.returncode != 0 and "Cannot find device" not in done.stderr:
                problems.append(f"veth {host.veth}: {done.stderr.strip()}")
            done = subprocess.run(
                ["ip", "netns", "del", host.netns], capture_output=True, text=True, check=False
            )
            if done.returncode != 0:
                problems.append(f"netns {host.netns}: {done.stderr.strip()}")
        self.hosts.clear()
        self.blocked.clear()
        done = subprocess.run(
            ["ip", "link", "del", self.bridge], capture_output=True, text=True, check=False
        )
        if done.returncode != 0 and "Cannot find device" not in done.stderr:
            problems.append(f"bridge {self.bridge}: {done.stderr.strip()}")
        return problems


@contextmanager
def fabric() -> Iterator[Fabric]:
    """A fresh bridge; torn down with every namespace added to it on exit."""
    suffix = secrets.token_hex(3)
    fab = Fabric(suffix, _free_subnet(suffix))
    try:
        fab.up()
        yield fab
    finally:
        problems = fab.down()
        if problems:
            raise NetnsError("teardown left: " + "; ".join(problems))


def node_sections(
    node_id: str,
    role: str,
    addr: str,
    seeds: list[str],
    secret_file: Path,
    admin_token: str,
    grant_ttl_s: float,
) -> dict[str, dict[str, Any]]:
    """TEST_SECTIONS for a node listening on ``addr`` with the fault tests' short timers."""
    return merge_sections(
        TEST_SECTIONS,
        {
            "server": {"admin_token": admin_token},
            "node": {"id": node_id, "role": role, "cluster_secret_file": str(secret_file)},
            "model": {"cpu_threads": 1},
            # A lease whose reader is cut off before its release ends this long after.
            "store": {"dram_bytes": 16 << 20, "lease_timeout_s": 4.0},
            # Shared memory would carry the KV past the network under test.
            "transfer": {"host": addr, "transports": ["tcp"]},
            "cluster": {
                "gossip_host": addr,
                "gossip_port": GOSSIP_PORT,
                "seeds": seeds,
                "probe_interval_s": 0.3,
                "probe_timeout_s": 0.1,
                "suspect_timeout_s": 1.0,
            },
            # Blocks granted to a prefill node that died stay held this long (+ 2 s).
            "disagg": {"grant_ttl_s": grant_ttl_s},
        },
    )


class NetnsCluster:
    """Daemons on a ``Fabric``, one per host, joined through the first one."""

    def __init__(self, fab: Fabric, tmp: Path, *, grant_ttl_s: float = 4.0) -> None:
        self.fabric = fab
        self.tmp = tmp
        self.grant_ttl_s = grant_ttl_s
        self.admin_token = secrets.token_urlsafe(24)
        self.secret_file = tmp / "cluster.secret"
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(generate_secret() + "\n")
        self.nodes: dict[str, DaemonProcess] = {}
        self.seeds: list[str] = []
        # No proxy from the environment may stand between the test and the bridge.
        self._http = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # ---------------------------------------------------------------- nodes

    def start(self, node_id: str, role: str) -> DaemonProcess:
        host = self.fabric.add(node_id)
        sections = node_sections(
            node_id,
            role,
            host.addr,
            self.seeds,
            self.secret_file,
            self.admin_token,
            self.grant_ttl_s,
        )
        d = spawn_daemon(
            self.tmp / node_id,
            to_toml(sections),
            "--host",
            host.addr,
            "--port",
            str(HTTP_PORT),
            wrap=("ip", "netns", "exec", host.netns),
        )
        self.nodes[node_id] = d
        if not self.seeds:
            self.seeds = [f"{host.addr}:{GOSSIP_PORT}"]
        return d

    def url(self, node_id: str) -> str:
        return self.nodes[node_id].url

    def live(self) -> list[str]:
        return [nid for nid, d in self.nodes.items() if d.proc.poll() is None]

    def freeze(self, node_id: str) -> None:
        self.nodes[node_id].signal(signal.SIGSTOP)

    def thaw(self, node_id: str) -> None:
        self.nodes[node_id].signal(signal.SIGCONT)

    def kill(self, node_id: str) -> None:
        d = self.nodes[node_id]
        d.signal(signal.SIGKILL)
        d.proc.wait(10)

    def stop(self) -> None:
        for d in self.nodes.values():
            if d.proc.poll() is None:
                # A frozen node must run again to drain and stop.
                d.signal(signal.SIGCONT)
                d.stop()

    # ---------------------------------------------------------------- admin

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def get(self, node_id: str, path: str) -> Any:
        req = urllib.request.Request(self.url(node_id) + path, headers=self.admin_headers)
        with self._http.open(req, timeout=_HTTP_TIMEOUT_S) as r:
            return json.loads(r.read())

    def view(self, node_id: str) -> dict[str, str]:
        """``node_id``'s members and their status; "alive" only with a state
        (what a node needs of a member to place requests on it)."""
        members = self.get(node_id, "/admin/cluster")["nodes"]
        return {
            m["node_id"]: "joining"
            if m["status"] == "alive" and not m.get("state")
            else m["status"]
            for m in members
        }

    def views_agree(self, ids: list[str]) -> bool:
        """Each of ``ids`` holds exactly ``ids`` alive and every other member it
        knows dead or gone, none still suspected: nothing left to settle."""
        for nid in ids:
            view = self.view(nid)
            alive = {m for m, status in view.items() if status == "alive"}
            if alive != set(ids) or any(
                st not in ("alive", "dead", "left") for st in view.values()
            ):
                return False
        return True

    def wait_views(self, ids: list[str], timeout_s: float) -> float:
        """Seconds until ``views_agree(ids)``; AssertionError after ``timeout_s``."""
        start = time.monotonic()
        while not self.views_agree(ids):
            if time.monotonic() - start > timeout_s:
                views = {nid: self.view(nid) for nid in ids}
                raise AssertionError(f"views of {ids} not agreed within {timeout_s} s: {views}")
            time.sleep(0.05)
        return time.monotonic() - start

    def wait_lost(self, victim: str, observers: list[str], timeout_s: float) -> float | None:
        """Seconds until every observer holds ``victim`` not alive (suspected,
        dead); None if that does not happen within ``timeout_s``."""
        start = time.monotonic()
        while any(self.view(nid).get(victim) == "alive" for nid in observers):
            if time.monotonic() - start > timeout_s:
                return None
            time.sleep(0.05)
        return time.monotonic() - start

    def assert_clean(self, node_id: str, timeout_s: float = 60.0) -> None:
        """Nothing running or waiting, no KV block used, no lease out, the
        pools' self-check passing; waited for as grants lapse."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.get(node_id, "/admin/status")
            stats = self.get(node_id, "/admin/cache/stats?check=1")
            load, kv, leases = st["load"], st["kv"], stats["leases"]
            if (
                load["running"] == 0
                and load["waiting"] == 0
                and kv["blocks_used"] == 0
                and leases["active"] == 0
                and stats.get("integrity") == "ok"
            ):
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{node_id} not clean after {timeout_s} s: load {load}, kv {kv}, "
                    f"leases {leases}, integrity {stats.get('integrity')!r}"
                )
            time.sleep(0.1)


def leftovers(suffix: str) -> list[str]:
    """Namespaces and links still named with ``suffix``."""
    names = _run_ip("netns", "list") + _run_ip("-o", "link")
    return [line for line in names.splitlines() if suffix in line]


def reachable(url: str) -> bool:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            url + "/health", timeout=2
        ) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False
