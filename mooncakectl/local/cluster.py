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
from pathlib import Path
from types import TracebackType
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


class LocalCluster:
    """The daemons of ``plans``, on loopback, with their files in ``run_dir``.

    ``base``: config sections under every node's own settings;
    ``sections``: more, per node, over ``base``. A node planned on port 0
    reports its URL on stdout (``announce``); such a node cannot be
    detached. ``detach``: the daemons outlive this process (``up``).
    ``sequential``: each node starts once the one before it listens, so
    its start-up profile measures it alone. ``on_spawn`` is called with
    the nodes started so far after each start (``up`` records them).
    """

    def __init__(
        self,
        plans: Sequence[NodePlan],
        run_dir: Path,
        *,
        base: Mapping[str, Mapping[str, Any]] | None = None,
        sections: SectionsOf | None = None,
        model: str | None = None,
        secret: str | None = None,
        cpus: Sequence[str] | None = None,
        detach: bool = False,
        sequential: bool = False,
        start_timeout_s: float = 300.0,
        stop_wait_s: float = 30.0,
        on_spawn: Callable[[Sequence[NodeProcess]], None] | None = None,
        out: TextIO | None = None,
        err: TextIO | None = None,
    ) -> None:
        if not plans:
            raise ValueError("a local cluster needs at least one node")
        if detach and any(p.port == 0 for p in plans):
            raise ValueError("a detached node needs a fixed port: nothing reads its stdout")
        self.plans = list(plans)
        self.run_dir = run_dir
        self.cluster = is_cluster(self.plans)
        if self.cluster and len(self.plans) > 1 and not self.plans[0].gossip_port:
            raise ValueError(f"{self.plans[0].name}, the seed, needs a fixed gossip port")
        self.secret = secret or secrets.token_urlsafe(32)
        self.nodes: list[NodeProcess] = []
        self._base = base or {}
        self._sections = sections
        self._model = model
        self._cpus = list(cpus) if cpus is not None else [""] * len(self.plans)
        if len(self._cpus) != len(self.plans):
            raise ValueError(f"{len(self._cpus)} CPU lists for {len(self.plans)} nodes")
        self._detach = detach
        self._sequential = sequential
        self._start_timeout_s = start_timeout_s
        self._stop_wait_s = stop_wait_s
        self._on_spawn = on_spawn
        self._given_up = threading.Event()
        self._out = out
        self._err = err

    @property
    def entry(self) -> NodeProcess:
        """Where clients go: the first decode node, else the first node."""
        return self.nodes[entry_index([n.plan for n in self.nodes])]

    def node(self, node_id: str) -> NodeProcess:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(f"no node {node_id!r} in this cluster")

    async def __aenter__(self) -> LocalCluster:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Every node started, ready and (in a cluster) seeing all the others;
        what was started is stopped again if that fails halfway."""
        # Monotonic, as the waits running in threads read it.
        deadline = time.monotonic() + self._start_timeout_s
        open_run_dir(self.run_dir)
        # A thread cannot be cancelled: a wait still running in one when the
        # start fails or is cancelled sees this and ends.
        self._given_up = threading.Event()
        try:
            for plan, cpus in zip(self.plans, self._cpus, strict=True):
                node = self._spawn(plan, cpus)
                if plan.port == 0:
                    node.url = await self._announced(node, deadline - time.monotonic())
                self.nodes.append(node)
                if self._on_spawn is not None:
                    self._on_spawn(self.nodes)
                if self._sequential:
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
        wait = self._stop_wait_s if wait_s is None else wait_s
        try:
            return await asyncio.to_thread(
                stop_nodes, records, wait, procs, out=self._out, err=self._err
            )
        finally:
            for n in nodes:
                if n.proc.stdout is not None:
                    n.proc.stdout.close()

    def _spawn(self, plan: NodePlan, cpus: str) -> NodeProcess:
        node_dir = self.run_dir / plan.name if self.cluster else self.run_dir
        open_run_dir(node_dir)
        stem = "mooncaked" if self.cluster else f"mooncaked-{plan.port}"
        extra = self._sections(plan) if self._sections is not None else {}
        seeds = [] if plan is self.plans[0] else [f"{LOOPBACK}:{self.plans[0].gossip_port}"]
        doc = node_config(
            merge_sections(self._base, extra),
            plan,
            cluster=self.cluster,
            seeds=seeds,
            secret=self.secret,
            model=self._model,
            data_dir=node_dir / "data",
            num_nodes=len(self.plans),
            cpus=cpus,
        )
        config_path = node_dir / f"{stem}.toml"
        # The secret is in it: readable by this user only.
        write_private(config_path, to_toml(doc))
        log_path = node_dir / f"{stem}.log"
        proc = spawn(
            daemon_argv(config_path), log_path, announce=plan.port == 0, detach=self._detach
        )
        return NodeProcess(plan, proc, plan.url, config_path, log_path)

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
