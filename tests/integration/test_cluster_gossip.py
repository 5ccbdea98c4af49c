"""Five real node processes on loopback: failure detection, rejoin, block index, partitions.

The tests of the five-node ``cluster`` fixture run against two kinds of node:

- ``gossip``: the gossip-only node, ``{python} -m mooncaked.cluster --config {config}``;
- ``daemon``: the full daemon, ``{python} -m mooncaked --config {config}``,
  with the builtin model, a small KV pool and DRAM tier. Its tests also serve
  real prompts: their blocks reach every node's index, and a node that is
  asked a prompt another node served fetches the prefix from it, found
  through the index alone (no ``store.peers``).

One more test starts three gossip-only nodes of its own: the last one left,
after its peers have gone, idles and exits on SIGTERM.

Set ``MOONCAKED_CLUSTER_NODE_CMD`` to also run the kind-independent tests
against another program (kind ``custom``). Placeholders: ``{python}``,
``{config}`` (a TOML file with ``[node]``, ``[server]``, ``[cluster]`` and
``[log]``, ``cluster.test_hooks = true``), ``{node_id}``, ``{http_port}``,
``{gossip_port}``. The program must serve ``GET /admin/cluster`` and the test
hooks ``POST /admin/test/blocks`` and ``POST /admin/test/drop_peers`` (see
``mooncaked.cluster.routes``) on ``server.port``, and leave the cluster on
SIGTERM.

Every wait below is a correctness bound (the configured failure-detection
time plus generous slack for a loaded machine), never a timing measurement.
"""

from __future__ import annotations

import io
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mooncakectl.cli import run as ctl_run
from mooncakectl.local.config import merge_sections, to_toml
from mooncakectl.local.plan import NodePlan, free_port
from mooncakectl.local.process import spawn, stop_nodes
from mooncakectl.registry import Env
from mooncaked.cache.hashing import block_hashes

NODE_CMD_ENV = "MOONCAKED_CLUSTER_NODE_CMD"
GOSSIP_NODE_CMD = "{python} -m mooncaked.cluster --config {config}"
DAEMON_NODE_CMD = "{python} -m mooncaked --config {config}"
NUM_NODES = 5
BLOCK_SIZE = 16
# The full daemon, kept small: one torch thread each (five share the
# machine), 8 MiB of device KV blocks and 8 MiB of DRAM tier.
DAEMON_SECTIONS: dict[str, dict[str, Any]] = {
    "model": {"cpu_threads": 1},
    "kv": {"memory_bytes": 8 * 1024 * 1024, "block_size": BLOCK_SIZE},
    "store": {"dram_bytes": 8 * 1024 * 1024},
    "server": {"drain_timeout_s": 5.0},
}
SECRET = "integration-cluster-secret-at-least-32-bytes-long"

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
# Below the daemon's drain_timeout_s (5 s): a draining node must be seen as
# such while it still drains, before it leaves.
DRAIN_SEEN_BOUND_S = 4.0

pytestmark = pytest.mark.timeout(240)


@dataclass(frozen=True, slots=True)
class NodeKind:
    name: str
    template: str
    # TOML sections merged over the common ones ([node], [server], [cluster], [log]).
    sections: dict[str, dict[str, Any]]

    @property
    def serves_prompts(self) -> bool:
        return self.name == "daemon"


GOSSIP = NodeKind("gossip", GOSSIP_NODE_CMD, {})
DAEMON = NodeKind("daemon", DAEMON_NODE_CMD, DAEMON_SECTIONS)


def node_kinds() -> list[Any]:
    """Bare gossip services in the fast set; daemons (and a custom node) are slow."""
    kinds = [GOSSIP, DAEMON]
    custom = os.environ.get(NODE_CMD_ENV)
    if custom:
        kinds.append(NodeKind("custom", custom, {}))
    return [
        pytest.param(k, id=k.name, marks=() if k is GOSSIP else pytest.mark.slow) for k in kinds
    ]


class Cluster:
    """``num_nodes`` nodes of ``kind`` on fixed ports, so that a node restarts
    where it was; each joins through the first two."""

    def __init__(self, root: Path, num_nodes: int, kind: NodeKind) -> None:
        self.root = root
        self.kind = kind
        self.template = kind.template
        self.plans = [
            NodePlan(f"g{i}", "both", free_port(), free_port(udp=True)) for i in range(num_nodes)
        ]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        seeds = [f"127.0.0.1:{p.gossip_port}" for p in self.plans[:2]]
        for plan in self.plans:
            sections: dict[str, dict[str, Any]] = {
                "node": {"id": plan.node_id, "cluster_secret": SECRET},
                "server": {"host": "127.0.0.1", "port": plan.port},
                "cluster": {
                    "gossip_port": plan.gossip_port,
                    "seeds": seeds,
                    "test_hooks": True,
                    **CLUSTER,
                },
                "log": {"format": "json", "level": "info"},
                # The cost profile's prompts would add blocks to the index.
                "conductor": {"profile": False},
            }
            self.config_path(plan.node_id).write_text(
                to_toml(merge_sections(sections, kind.sections))
            )

    def config_path(self, node_id: str) -> Path:
        return self.root / f"{node_id}.toml"

    def log_path(self, node_id: str) -> Path:
        return self.root / f"{node_id}.log"

    @property
    def ids(self) -> list[str]:
        return [p.node_id for p in self.plans]

    def plan(self, node_id: str) -> NodePlan:
        return next(p for p in self.plans if p.node_id == node_id)

    def start(self, node_id: str) -> None:
        plan = self.plan(node_id)
        argv = shlex.split(
            self.template.format(
                python=shlex.quote(sys.executable),
                config=shlex.quote(str(self.config_path(node_id))),
                node_id=plan.node_id,
                http_port=plan.port,
                gossip_port=plan.gossip_port,
            )
        )
        root = Path(__file__).resolve().parents[2]
        self.procs[node_id] = spawn(argv, self.log_path(node_id), cwd=root)

    def signal(self, node_id: str, sig: int) -> subprocess.Popen[bytes]:
        proc = self.procs[node_id]
        proc.send_signal(sig)
        return proc

    def stop_all(self) -> None:
        records = [{"pid": p.pid, "url": self.url(i), "node_id": i} for i, p in self.procs.items()]
        stop_nodes(records, 10.0, {p.pid: p for p in self.procs.values()})

    def url(self, node_id: str) -> str:
        return self.plan(node_id).url

    def view(self, node_id: str) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(self.url(node_id) + "/admin/cluster", timeout=3) as resp:
                return json.loads(resp.read())
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def post(self, node_id: str, path: str, body: Any, timeout: float = 5.0) -> Any:
        req = urllib.request.Request(
            self.url(node_id) + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def get(self, node_id: str, path: str) -> Any:
        with urllib.request.urlopen(self.url(node_id) + path, timeout=5) as resp:
            return json.loads(resp.read())

    def holders(self, observer: str, hashes: list[str], tiers: list[str] | None = None) -> Any:
        """``/admin/cluster/prefix`` on ``observer``: who holds how much of ``hashes``."""
        body: dict[str, Any] = {"hashes": hashes}
        if tiers is not None:
            body["tiers"] = tiers
        try:
            return self.post(observer, "/admin/cluster/prefix", body)
        except (OSError, urllib.error.URLError, ValueError):
            return {}

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
        for plan in self.plans:
            proc = self.procs.get(plan.node_id)
            rc = None if proc is None else proc.poll()
            state = "running" if rc is None else f"exited with {rc}"
            head = f"--- {plan.node_id} ({state}; http {plan.port}, gossip {plan.gossip_port}) ---"
            tail = []
            log = self.log_path(plan.node_id)
            if log.exists():
                tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(head + "\n" + "\n".join(tail))
        return "\n".join(out)


@pytest.fixture(scope="module", params=node_kinds())
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    kind: NodeKind = request.param
    c = Cluster(tmp_path_factory.mktemp(kind.name), NUM_NODES, kind)
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
    inflight: threading.Thread | None = None
    if cluster.kind.serves_prompts:
        # A long request keeps g4's drain going for drain_timeout_s: while it
        # drains, every other node must see it draining (not yet left).
        inflight = threading.Thread(
            target=long_request, args=(cluster, "g4"), name="inflight", daemon=True
        )
        inflight.start()
        cluster.wait(
            lambda: cluster.get("g4", "/admin/status")["load"]["running"] >= 1,
            BLOCK_BOUND_S,
            "the long request running on g4",
        )
    proc = cluster.signal("g4", signal.SIGTERM)
    if inflight is not None:

        def everyone_sees_g4_draining() -> bool:
            entries = [cluster.node_entry(o, "g4") for o in cluster.ids if o != "g4"]
            return all(
                e is not None and e["status"] == "alive" and e["state"]["draining"] for e in entries
            )

        cluster.wait(everyone_sees_g4_draining, DRAIN_SEEN_BOUND_S, "g4 draining in every view")
    assert proc.wait(timeout=15) == 0
    if inflight is not None:
        inflight.join(timeout=10)
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


# -- real prompts (the full daemon) -------------------------------------------------


def needs_engine(cluster: Cluster) -> None:
    if not cluster.kind.serves_prompts:
        pytest.skip(f"{cluster.kind.name} nodes serve no prompts")


def prompt(seed: int, num_blocks: int = 10) -> list[int]:
    """``num_blocks`` full blocks and one token; no block shared with another seed."""
    rng = random.Random(seed)
    ids = [rng.randrange(256) for _ in range(num_blocks * BLOCK_SIZE + 1)]
    ids[0] = 256 + seed % 100
    return ids


def complete(cluster: Cluster, node_id: str, ids: list[int]) -> dict[str, Any]:
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0}
    return dict(cluster.post(node_id, "/v1/completions", body, timeout=60.0))


def long_request(cluster: Cluster, node_id: str) -> None:
    """A request far longer than the drain timeout; ends when the drain aborts it."""
    body = {"prompt": prompt(14, 1), "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    try:
        cluster.post(node_id, "/v1/completions", body, timeout=60.0)
    except (OSError, urllib.error.URLError, ValueError):
        pass  # the node went away under it: all this request was for


def cached_tokens(out: dict[str, Any]) -> int:
    return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


def prompt_hashes(cluster: Cluster, node_id: str, ids: list[int]) -> list[str]:
    """Hex hashes of the prompt's full blocks, as ``node_id``'s engine computes them."""
    entry = cluster.node_entry(node_id, node_id)
    assert entry is not None and entry["state"] is not None
    model_id = entry["state"]["model_id"]
    return [h.hex() for h in block_hashes(ids, BLOCK_SIZE, model_id)]


def served_cold(
    cluster: Cluster, node_id: str, seed: int
) -> tuple[list[int], list[str], dict[str, Any]]:
    """A prompt nobody holds, computed on ``node_id``: its ids, its block
    hashes and the answer."""
    needs_engine(cluster)
    cluster.wait_converged()
    ids = prompt(seed)
    out = complete(cluster, node_id, ids)
    assert cached_tokens(out) == 0
    return ids, prompt_hashes(cluster, node_id, ids), out


def test_prompt_served_on_one_node_reaches_every_index(cluster: Cluster) -> None:
    _ids, hashes, _out = served_cold(cluster, "g2", 11)
    assert len(hashes) == 10
    others = [i for i in cluster.ids if i != "g2"]

    def everyone_sees_g2_hold_it() -> bool:
        return all(cluster.holders(o, hashes).get("g2", {}).get("num_blocks") == 10 for o in others)

    cluster.wait(everyone_sees_g2_hold_it, BLOCK_BOUND_S, "g2's prompt blocks in every index")
    # Nobody else computed it: the index names g2 alone.
    assert set(cluster.holders("g0", hashes)) == {"g2"}


def test_prompt_is_fetched_from_the_node_the_index_names(cluster: Cluster) -> None:
    ids, hashes, cold = served_cold(cluster, "g0", 12)

    def g1_sees_g0_lease_it() -> bool:
        # Leasable blocks only: in g0's DRAM tier (offloaded after the prefill).
        match = cluster.holders("g1", hashes, ["dram", "ssd"]).get("g0", {})
        return match.get("num_blocks") == 10

    cluster.wait(g1_sees_g0_lease_it, BLOCK_BOUND_S, "g0's DRAM blocks in g1's index")
    before = cluster.get("g1", "/admin/cache/stats")["peer"]
    warm = complete(cluster, "g1", ids)
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert cached_tokens(warm) == 10 * BLOCK_SIZE
    after = cluster.get("g1", "/admin/cache/stats")["peer"]
    assert after["ok"] - before["ok"] == 1
    assert after["blocks"] - before["blocks"] == 10
    # g1 asked only g0, the one holder: no failed lookups anywhere else.
    assert after["lookup_errors"] == before["lookup_errors"]
    leases = cluster.get("g0", "/admin/cache/stats")["leases"]
    assert leases["granted"] >= 1 and leases["active"] == 0
    # The fetched blocks are g1's now too, and the index says so.
    cluster.wait(
        lambda: cluster.holders("g3", hashes, ["dram"]).get("g1", {}).get("num_blocks") == 10,
        BLOCK_BOUND_S,
        "g1's fetched blocks in g3's index",
    )


def test_a_prompt_nobody_holds_costs_no_peer_round_trip(cluster: Cluster) -> None:
    needs_engine(cluster)
    cluster.wait_converged()
    before = cluster.get("g4", "/admin/cache/stats")["peer"]
    out = complete(cluster, "g4", prompt(13))
    assert cached_tokens(out) == 0
    after = cluster.get("g4", "/admin/cache/stats")["peer"]
    # Nobody was asked, and the request never waited for a fetch: the engine
    # saw on arrival that no peer holds its blocks and did not call one.
    assert after["fetches"] == before["fetches"]
    assert after["nobody_to_ask"] == before["nobody_to_ask"]
    assert after["lookup_errors"] == before["lookup_errors"]


def test_daemon_reports_the_cluster_in_status_and_metrics(cluster: Cluster) -> None:
    needs_engine(cluster)
    cluster.wait_converged()
    status = cluster.get("g3", "/admin/status")["cluster"]
    assert status["members"] == {"alive": NUM_NODES, "suspect": 0, "dead": 0, "left": 0}
    assert status["node_id"] == "g3"
    assert status["gossip_addr"] == f"127.0.0.1:{cluster.plan('g3').gossip_port}"
    with urllib.request.urlopen(cluster.url("g3") + "/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    assert f'mooncaked_cluster_members{{status="alive"}} {NUM_NODES}.0' in metrics
    sent = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("mooncaked_gossip_packets_sent_total ")
    )
    assert sent > 0
    assert 'mooncaked_gossip_packets_dropped_total{reason="forged"} 0.0' in metrics
    entry = cluster.node_entry("g0", "g3")
    assert (
        entry is not None and entry["state"]["api_addr"] == f"127.0.0.1:{cluster.plan('g3').port}"
    )

    def g0_has_g3_segments() -> bool:
        e = cluster.node_entry("g0", "g3")
        return e is not None and [seg["name"] for seg in e["segments"]] == ["kv.dram"]

    # The DRAM segment peers read from reaches them (by a pull after the state).
    cluster.wait(g0_has_g3_segments, BLOCK_BOUND_S, "g3's DRAM segment in g0's view")


# -- a node whose peers all left ----------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_last_node_idles_then_exits_on_sigterm_after_its_peers_left(tmp_path: Path) -> None:
    # Nodes were once found spinning in the gossip loop after every peer had
    # left, deaf to SIGTERM: the host loop never yielded on an overdue timer.
    c = Cluster(tmp_path, 3, GOSSIP)
    try:
        for node_id in c.ids:
            c.start(node_id)
        c.wait_converged()
        for node_id in ("g1", "g2"):
            assert c.signal(node_id, signal.SIGTERM).wait(timeout=15) == 0
        c.wait(
            lambda: c.all_see("g1", "left", ["g0"]) and c.all_see("g2", "left", ["g0"]),
            10.0,
            "g0 sees both peers left",
        )
        last = c.procs["g0"]
        # Alone, the node only ticks its timers: a loop spinning on a stale
        # deadline would burn most of a core over this window.
        window_s = 3.0
        cpu0 = cpu_seconds(last.pid)
        deadline = time.monotonic() + window_s
        while time.monotonic() < deadline:
            assert c.view("g0") is not None  # still serving meanwhile
            time.sleep(0.25)
        assert cpu_seconds(last.pid) - cpu0 < window_s / 3
        last.send_signal(signal.SIGTERM)
        assert last.wait(timeout=15) == 0
    finally:
        c.stop_all()
