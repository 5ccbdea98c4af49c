"""``LocalCluster``: a loopback cluster's daemons started, ready and joined, then stopped.

    async with LocalCluster(plan_nodes(1, 1, None), run_dir) as cluster:
        for node in cluster.nodes:
            print(node.node_id, node.role, node.url, node.pid, node.log_path)

Every node gets its own folder in the run directory (a single ``both``
node: the run directory itself), its config written there readable by this
user only (the cluster secret is in it), the first node's gossip address
as its seed and one cluster secret shared by all. ``start`` returns once
every node is ready and sees every other one alive, so the first request is
already disaggregated; when it fails halfway it stops what it started.
``stop`` sends every node SIGTERM at once (each drains) and kills those
still running after the wait.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from mooncakectl.local.config import merge_sections, node_config, to_toml
from mooncakectl.local.plan import LOOPBACK, NodePlan, entry_index, is_cluster
from mooncakectl.local.process import (
    NodeProcess,
    StartFailed,
    daemon_argv,
    read_announced_url,
    spawn,
    stop_nodes,
    wait_joined,
    wait_ready,
)
from mooncakectl.rundir import open_run_dir, write_private

SectionsOf = Callable[[NodePlan], Mapping[str, Mapping[str, Any]]]
# A node that failed to start has its peers stopped this fast.
_FAILED_START_WAIT_S = 10.0


@dataclass(slots=True)
class LocalCluster:
    """The daemons of ``plans``, on loopback, with their files in ``run_dir``.

    ``base``: config sections under every node's own settings;
    ``sections``: more, per node, over ``base``. ``secret``: the cluster's
    (empty: a fresh one). A node planned on port 0 reports its URL on stdout
    (``announce``); such a node cannot be detached. ``detach``: the daemons
    outlive this process (``up``). ``sequential``: each node starts once the
    one before it listens, so its start-up profile measures it alone.
    ``on_spawn`` is called with the nodes started so far after each start
    (``up`` records them); ``out`` and ``err`` get what stopping them says.
    """

    plans: Sequence[NodePlan]
    run_dir: Path
    _: KW_ONLY
    base: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    sections: SectionsOf | None = None
    model: str | None = None
    secret: str = ""
    cpus: Sequence[str] | None = None
    detach: bool = False
    sequential: bool = False
    start_timeout_s: float = 300.0
    stop_wait_s: float = 30.0
    on_spawn: Callable[[Sequence[NodeProcess]], None] | None = None
    out: TextIO | None = None
    err: TextIO | None = None
    # The nodes started, in start order; empty again once stopped.
    nodes: list[NodeProcess] = field(default_factory=list, init=False)
    # A thread cannot be cancelled: a wait still running in one when the
    # start fails or is cancelled sees this and ends.
    _given_up: threading.Event = field(default_factory=threading.Event, init=False)

    def __post_init__(self) -> None:
        if not self.plans:
            raise ValueError("a local cluster needs at least one node")
        if self.detach and any(p.port == 0 for p in self.plans):
            raise ValueError("a detached node needs a fixed port: nothing reads its stdout")
        if self.cluster and len(self.plans) > 1 and not self.plans[0].gossip_port:
            raise ValueError(f"{self.plans[0].name}, the seed, needs a fixed gossip port")
        if self.cpus is not None and len(self.cpus) != len(self.plans):
            raise ValueError(f"{len(self.cpus)} CPU lists for {len(self.plans)} nodes")
        self.secret = self.secret or secrets.token_urlsafe(32)

    @property
    def cluster(self) -> bool:
        """Whether the nodes gossip as one cluster (``plan.is_cluster``)."""
        return is_cluster(self.plans)

    @property
    def entry(self) -> NodeProcess:
        """Where clients go: the first decode node, else the first node."""
        return self.nodes[entry_index(self.plans)]

    def node(self, node_id: str) -> NodeProcess:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(f"no node {node_id!r} in this cluster")

    async def __aenter__(self) -> LocalCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Every node started, ready and (in a cluster) seeing all the others;
        what was started is stopped again if that fails halfway."""
        # Monotonic, as the waits running in threads read it.
        deadline = time.monotonic() + self.start_timeout_s
        open_run_dir(self.run_dir)
        self._given_up = threading.Event()
        cpus_of = self.cpus if self.cpus is not None else [""] * len(self.plans)
        try:
            for plan, cpus in zip(self.plans, cpus_of, strict=True):
                node = self._spawn(plan, cpus)
                # Kept before its URL is known, so a failure from here on stops it too.
                self.nodes.append(node)
                if plan.port == 0:
                    node.url = await self._announced(node, deadline - time.monotonic())
                if self.on_spawn is not None:
                    self.on_spawn(self.nodes)
                if self.sequential:
                    await self._ready([node], deadline)
            await self._ready(self.nodes, deadline)
            if self.cluster and len(self.nodes) > 1:
                members = [(n.node_id, n.url) for n in self.nodes]
                await asyncio.to_thread(wait_joined, members, deadline, given_up=self._given_up)
        except BaseException:
            self._given_up.set()
            await self.stop(_FAILED_START_WAIT_S)
            raise

    async def stop(self, wait_s: float | None = None) -> tuple[int, int]:
        """SIGTERM to every node at once, SIGKILL to those still running after
        ``wait_s`` (the cluster's stop wait by default). Returns (drained, killed)."""
        nodes, self.nodes = self.nodes, []
        if not nodes:
            return 0, 0
        records = [{"pid": n.pid, "url": n.url, "node_id": n.node_id} for n in nodes]
        procs = {n.pid: n.proc for n in nodes}
        wait = self.stop_wait_s if wait_s is None else wait_s
        try:
            return await asyncio.to_thread(
                stop_nodes, records, wait, procs, out=self.out, err=self.err
            )
        finally:
            for n in nodes:
                if n.proc.stdout is not None:
                    n.proc.stdout.close()

    def _spawn(self, plan: NodePlan, cpus: str) -> NodeProcess:
        node_dir = self.run_dir / plan.name if self.cluster else self.run_dir
        open_run_dir(node_dir)
        stem = "mooncaked" if self.cluster else f"mooncaked-{plan.port}"
        extra = self.sections(plan) if self.sections is not None else {}
        seeds = [] if plan is self.plans[0] else [f"{LOOPBACK}:{self.plans[0].gossip_port}"]
        doc = node_config(
            merge_sections(self.base, extra),
            plan,
            cluster=self.cluster,
            seeds=seeds,
            secret=self.secret,
            model=self.model,
            data_dir=node_dir / "data",
            num_nodes=len(self.plans),
            cpus=cpus,
        )
        config_path = node_dir / f"{stem}.toml"
        # The secret is in it: readable by this user only.
        write_private(config_path, to_toml(doc))
        log_path = node_dir / f"{stem}.log"
        proc = spawn(
            daemon_argv(config_path), log_path, announce=plan.port == 0, detach=self.detach
        )
        return NodeProcess(
            plan.node_id, plan.role, plan.name, proc.pid, proc, plan.url, config_path, log_path
        )

    async def _announced(self, node: NodeProcess, timeout_s: float) -> str:
        try:
            return await asyncio.to_thread(read_announced_url, node.proc, max(0.0, timeout_s))
        except RuntimeError as exc:
            tail = node.log_text()[-3000:]
            raise StartFailed(f"{node.name}: {exc}; see {node.log_path}:\n{tail}") from None

    async def _ready(self, nodes: Sequence[NodeProcess], deadline: float) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for n in nodes:
                    tg.create_task(
                        asyncio.to_thread(
                            wait_ready,
                            n.url,
                            deadline,
                            proc=n.proc,
                            name=n.name,
                            log_path=n.log_path,
                            given_up=self._given_up,
                        )
                    )
        except* StartFailed as failed:
            # The first node to fail names the problem; the others are stopped with it.
            raise failed.exceptions[0] from None


def start_blocking(cluster: LocalCluster) -> None:
    """``cluster.start()`` for a caller without an event loop (the CLI)."""
    asyncio.run(cluster.start())
