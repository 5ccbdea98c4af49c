"""Real in-process nodes joined into one cluster on loopback (gossip, HTTP, transfer)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from mooncaked.daemon import Node
from tests.conftest import make_config, wait_until


@dataclass
class Cluster:
    nodes: list[Node]

    def entry(self, i: int) -> Node:
        return self.nodes[i % len(self.nodes)]

    def converged(self) -> bool:
        ids = {n.node_id for n in self.nodes}
        for n in self.nodes:
            service = n.cluster
            if service is None:
                return False
            alive = {
                nid
                for nid, m in service.view.members.items()
                if m.status.value == "alive" and m.state is not None and m.state.model_id
            }
            if not ids <= alive:
                return False
        return True

    def assert_clean(self) -> None:
        for n in self.nodes:
            engine = n.engine
            assert engine is not None
            engine.check_integrity()


ClusterFactory = Callable[..., Awaitable[Cluster]]


@pytest.fixture
async def cluster_factory() -> AsyncIterator[ClusterFactory]:
    started: list[Node] = []

    async def make(
        roles: list[str], transports: list[str] | None = None, **extra: dict[str, Any]
    ) -> Cluster:
        nodes: list[Node] = []
        seed: str | None = None
        for i, role in enumerate(roles):
            sections: dict[str, dict[str, Any]] = {
                "node": {"id": f"{role}-{i}-{len(started)}", "role": role},
                "store": {"dram_bytes": 16 << 20},
                "cluster": {"seeds": [seed] if seed else []},
                **extra,
            }
            if transports is not None:
                sections["transfer"] = {"transports": transports}
            node = Node(make_config(**sections))
            await node.start()
            started.append(node)
            nodes.append(node)
            if seed is None:
                assert node.cluster is not None
                seed = f"127.0.0.1:{node.cluster.gossip_port}"
        cluster = Cluster(nodes)
        await wait_until(cluster.converged, "every node alive in every view", 60)
        return cluster

    try:
        yield make
    finally:
        for n in reversed(started):
            await n.stop()
