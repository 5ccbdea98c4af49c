"""Real in-process nodes joined into one cluster on loopback (gossip, HTTP, transfer).

In process, so that a test can reach into each node's engine; what makes a
node one of a local cluster (``node_config``) and the wait until every node
sees all the others alive (``wait_joined``) are those ``mooncakectl up`` uses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mooncakectl.local.config import merge_sections, node_config
from mooncakectl.local.plan import LOOPBACK, NodePlan
from mooncakectl.local.process import wait_joined
from mooncaked.daemon import Node
from tests.conftest import make_config

JOIN_TIMEOUT_S = 60.0


@dataclass
class Cluster:
    nodes: list[Node]

    def entry(self, i: int) -> Node:
        return self.nodes[i % len(self.nodes)]

    def assert_clean(self) -> None:
        for n in self.nodes:
            engine = n.engine
            assert engine is not None
            engine.check_integrity()
            if engine.pipe is not None:
                engine.pipe.check_integrity()


def stage(group: str, index: int, num_stages: int, **pipeline: Any) -> tuple[str, Any]:
    """A prefill node that is stage ``index`` of pipelined group ``group``."""
    sections = {"pipeline": {"group": group, "stage": index, "num_stages": num_stages, **pipeline}}
    return ("prefill", sections)


ClusterFactory = Callable[..., Awaitable[Cluster]]


@pytest.fixture
async def cluster_factory(tmp_path: Path) -> AsyncIterator[ClusterFactory]:
    started: list[Node] = []

    async def make(
        roles: list[str | tuple[str, dict[str, dict[str, Any]]]],
        transports: list[str] | None = None,
        **extra: dict[str, Any],
    ) -> Cluster:
        """Nodes of ``roles``, each a role or (role, its own config sections)."""
        nodes: list[Node] = []
        seeds: list[str] = []
        for i, spec in enumerate(roles):
            role, mine = (spec, {}) if isinstance(spec, str) else spec
            plan = NodePlan(f"{role}-{i}-{len(started)}", role, 0, 0)
            own: dict[str, dict[str, Any]] = {"store": {"dram_bytes": 16 << 20}}
            if transports is not None:
                own["transfer"] = {"transports": transports}
            sections = node_config(
                merge_sections(own, extra, mine),
                plan,
                cluster=True,
                seeds=seeds,
                # The default: tests sign the RPCs they make up with it.
                secret=make_config().node.cluster_secret,
                model=None,
                data_dir=tmp_path / plan.node_id,
            )
            node = Node(make_config(**sections))
            await node.start()
            started.append(node)
            nodes.append(node)
            if not seeds:
                # The first node's gossip port is known once it listens: everyone's seed.
                assert node.cluster is not None
                seeds = [f"{LOOPBACK}:{node.cluster.gossip_port}"]
        members = [(n.node_id, n.url) for n in nodes]
        # The nodes answer on this loop: the blocking wait runs in a thread.
        await asyncio.to_thread(wait_joined, members, time.monotonic() + JOIN_TIMEOUT_S)
        return Cluster(nodes)

    try:
        yield make
    finally:
        for n in reversed(started):
            await n.stop()
