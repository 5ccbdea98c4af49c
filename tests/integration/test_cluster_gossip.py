"""Five real node processes on loopback: failure detection, rejoin, block index, partitions.

The harness starts each node from a command template, by default the
gossip-only node::

    {python} -m mooncaked.cluster --config {config} --test-hooks

Set ``MOONCAKED_CLUSTER_NODE_CMD`` to run the same tests against another
program (the full daemon). Placeholders: ``{python}``, ``{config}`` (a TOML
file with ``[node]``, ``[server]``, ``[cluster]`` and ``[log]``), ``{node_id}``,
``{http_port}``, ``{gossip_port}``. The program must serve ``GET
/admin/cluster`` and the test hooks ``POST /admin/test/blocks`` and ``POST
/admin/test/drop_peers`` (see ``mooncaked.cluster.routes``) on
``server.port``, and leave the cluster on SIGTERM.

Every wait below is a correctness bound (the configured failure-detection
time plus generous slack for a loaded machine), never a timing measurement.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mooncakectl.cli import run as ctl_run
from mooncakectl.registry import Env

NODE_CMD_ENV = "MOONCAKED_CLUSTER_NODE_CMD"
DEFAULT_NODE_CMD = "{python} -m mooncaked.cluster --config {config} --test-hooks"
NUM_NODES = 5
SECRET = "integration-cluster-secret"

PROBE_INTERVAL_S = 0.25
SUSPECT_TIMEOUT_S = 1.5
SYNC_INTERVAL_S = 1.0
CLUSTER = {
    "probe_interval_s": PROBE_INTERVAL_S,
    "probe_timeout_s": 0.1,
    "suspect_timeout_s": SUSPECT_TIMEOUT_S,
    "gossip_interval_s": 0.1,
    "sync_interval_s": SYNC_INTERVAL_S,
    "sync_timeout_s": 1.0,
    "dead_reap_s": 600.0,
}
# Someone probes a crashed node within one round of the others (4 peers), the
# failed probe takes an interval, then the suspicion runs out; the news of its
# death travels in a few gossip rounds. Slack covers a machine shared with
# other test runs.
DEAD_BOUND_S = 5 * PROBE_INTERVAL_S + SUSPECT_TIMEOUT_S + 10.0
START_BOUND_S = 45.0
# A healed partition reconnects through the sync with a dead member each
# sync interval, then refutations spread.
HEAL_BOUND_S = 10 * SYNC_INTERVAL_S + 15.0
BLOCK_BOUND_S = 10.0

pytestmark = pytest.mark.timeout(240)


def free_port(udp_too: bool) -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind(("127.0.0.1", 0))
            port = tcp.getsockname()[1]
            if not udp_too:
                return port
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(v)


@dataclass(slots=True)
class NodeSpec:
    node_id: str
    http_port: int
    gossip_port: int
    config: Path
    log: Path


class Cluster:
    def __init__(self, root: Path, num_nodes: int, template: str) -> None:
        self.root = root
        self.template = template
        self.specs = [
            NodeSpec(
                f"g{i}",
                free_port(udp_too=False),
                free_port(udp_too=True),
                root / f"g{i}.toml",
                root / f"g{i}.log",
            )
            for i in range(num_nodes)
        ]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        seeds = [f"127.0.0.1:{s.gossip_port}" for s in self.specs[:2]]
        for spec in self.specs:
            sections = {
                "node": {"id": spec.node_id, "cluster_secret": SECRET},
                "server": {"host": "127.0.0.1", "port": spec.http_port},
                "cluster": {"gossip_port": spec.gossip_port, "seeds": seeds, **CLUSTER},
                "log": {"format": "json", "level": "info"},
            }
            text = "".join(
                f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in table.items())
                for name, table in sections.items()
            )
            spec.config.write_text(text)

    @property
    def ids(self) -> list[str]:
        return [s.node_id for s in self.specs]

    def spec(self, node_id: str) -> NodeSpec:
        return next(s for s in self.specs if s.node_id == node_id)

    def start(self, node_id: str) -> None:
        spec = self.spec(node_id)
        argv = shlex.split(
            self.template.format(
                python=shlex.quote(sys.executable),
                config=shlex.quote(str(spec.config)),
                node_id=spec.node_id,
                http_port=spec.http_port,
                gossip_port=spec.gossip_port,
            )
        )
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        with spec.log.open("ab") as log:
            self.procs[node_id] = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root
            )

    def signal(self, node_id: str, sig: int) -> subprocess.Popen[bytes]:
        proc = self.procs[node_id]
        proc.send_signal(sig)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def url(self, node_id: str) -> str:
        return f"http://127.0.0.1:{self.spec(node_id).http_port}"

    def view(self, node_id: str) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(self.url(node_id) + "/admin/cluster", timeout=3) as resp:
                return json.loads(resp.read())
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def post(self, node_id: str, path: str, body: Any) -> Any:
        req = urllib.request.Request(
            self.url(node_id) + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())

    def statuses(self, observer: str) -> dict[str, str]:
        doc = self.view(observer)
        if doc is None:
            return {}
        return {n["node_id"]: n["status"] for n in doc["nodes"]}

    def node_entry(self, observer: str, target: str) -> dict[str, Any] | None:
        doc = self.view(observer)
        if doc is None:
            return None
        return next((n for n in doc["nodes"] if n["node_id"] == target), None)

    def wait(self, cond: Callable[[], bool], bound: float, what: str) -> float:
        start = time.monotonic()
        while not cond():
            if time.monotonic() - start > bound:
                raise AssertionError(f"{what}: not within {bound:.1f} s\n{self.logs_tail()}")
            time.sleep(0.1)
        return time.monotonic() - start

    def all_see(self, target: str, status: str, observers: list[str] | None = None) -> bool:
        observers = observers if observers is not None else [i for i in self.ids if i != target]
        return all(self.statuses(o).get(target) == status for o in observers)

    def converged(self) -> bool:
        return all(
            (st := self.statuses(o)) and all(st.get(t) == "alive" for t in self.ids)
            for o in self.ids
        )

    def wait_converged(self) -> None:
        self.wait(self.converged, START_BOUND_S, "all nodes alive in every view")

    def logs_tail(self, lines: int = 15) -> str:
        out = []
        for spec in self.specs:
            if spec.log.exists():
                tail = spec.log.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {spec.node_id} ---\n" + "\n".join(tail))
        return "\n".join(out)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    template = os.environ.get(NODE_CMD_ENV) or DEFAULT_NODE_CMD
    c = Cluster(tmp_path_factory.mktemp("gossip"), NUM_NODES, template)
    try:
        for node_id in c.ids:
            c.start(node_id)
        c.wait_converged()
        yield c
    finally:
        c.stop_all()


def ctl(cluster: Cluster, node_id: str, *argv: str) -> tuple[int, str]:
    env = Env(stdout=io.StringIO(), stderr=io.StringIO(), environ={})
    status = ctl_run(["--url", cluster.url(node_id), *argv], env)
    return status, env.stdout.getvalue() + env.stderr.getvalue()  # type: ignore[attr-defined]


def test_five_nodes_converge_and_mooncakectl_shows_them(cluster: Cluster) -> None:
    cluster.wait_converged()
    status, text = ctl(cluster, "g1", "nodes")
    assert status == 0, text
    lines = text.strip().splitlines()
    assert lines[0].split()[:3] == ["NODE", "ROLE", "STATE"]
    assert sorted(line.split()[0] for line in lines[1:]) == cluster.ids
    assert "g1 *" in text  # the node that answered
    status, text = ctl(cluster, "g1", "nodes", "--json")
    assert status == 0 and len(json.loads(text)) == NUM_NODES
    status, text = ctl(cluster, "g3", "cluster")
    assert status == 0, text
    assert "members:" in text and f"{NUM_NODES} alive" in text


def test_block_cached_on_one_node_reaches_every_index(cluster: Cluster) -> None:
    cluster.wait_converged()
    hashes = [os.urandom(16).hex() for _ in range(64)]
    assert cluster.post("g2", "/admin/test/blocks", {"stored": hashes, "tier": "dram"}) == {
        "changed": 64
    }
    others = [i for i in cluster.ids if i != "g2"]

    def everyone_has(n: int) -> bool:
        return all(
            (e := cluster.node_entry(o, "g2")) is not None and e["cached_blocks"] == n
            for o in others
        )

    cluster.wait(lambda: everyone_has(64), BLOCK_BOUND_S, "64 blocks of g2 in every index")
    match = cluster.post("g4", "/admin/cluster/prefix", {"hashes": hashes})
    assert match["g2"] == {"num_blocks": 64, "tier_blocks": [0, 64, 0]}
    cluster.post("g2", "/admin/test/blocks", {"removed": hashes[32:], "tier": "dram"})
    cluster.wait(lambda: everyone_has(32), BLOCK_BOUND_S, "removals of g2 in every index")
    match = cluster.post("g0", "/admin/cluster/prefix", {"hashes": hashes})
    assert match["g2"]["num_blocks"] == 32


def test_kill9_is_declared_dead_by_everyone_then_restart_rejoins(cluster: Cluster) -> None:
    cluster.wait_converged()
    before = cluster.node_entry("g0", "g3")
    assert before is not None
    proc = cluster.signal("g3", signal.SIGKILL)
    proc.wait(timeout=10)
    cluster.wait(lambda: cluster.all_see("g3", "dead"), DEAD_BOUND_S, "g3 dead in every view")
    cluster.start("g3")
    cluster.wait(cluster.converged, START_BOUND_S, "restarted g3 alive in every view")
    after = cluster.node_entry("g0", "g3")
    assert after is not None
    assert after["generation"] > before["generation"]
    assert after["incarnation"] > before["incarnation"]


def test_sigterm_leaves_gracefully_then_restart_rejoins(cluster: Cluster) -> None:
    cluster.wait_converged()
    proc = cluster.signal("g4", signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    # "left" only comes from the node's own announcement, never from probing.
    cluster.wait(lambda: cluster.all_see("g4", "left"), 10.0, "g4 left in every view")
    cluster.start("g4")
    cluster.wait(cluster.converged, START_BOUND_S, "restarted g4 alive in every view")


def test_partition_heals_after_it_ends(cluster: Cluster) -> None:
    cluster.wait_converged()
    side_a, side_b = ["g0", "g1", "g2"], ["g3", "g4"]
    try:
        for n in side_a:
            cluster.post(n, "/admin/test/drop_peers", {"peers": side_b})
        for n in side_b:
            cluster.post(n, "/admin/test/drop_peers", {"peers": side_a})

        def split() -> bool:
            return all(cluster.all_see(b, "dead", side_a) for b in side_b) and all(
                cluster.all_see(a, "dead", side_b) for a in side_a
            )

        cluster.wait(split, DEAD_BOUND_S, "each side declares the other dead")
        # Each side stays whole on its own.
        assert all(cluster.all_see(a, "alive", [x for x in side_a if x != a]) for a in side_a)
    finally:
        for n in cluster.ids:
            cluster.post(n, "/admin/test/drop_peers", {"peers": []})
    cluster.wait(cluster.converged, HEAL_BOUND_S, "all alive again after the partition")
