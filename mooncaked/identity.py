"""Who a node is: its id, the cluster secret it signs with, and its generation.

The one place that derives a node's id and reads its secret out of the
config; everything that signs, verifies or names this node takes a
``NodeIdentity`` (or its fields) from here.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from mooncaked.config import NodeConfig


def node_id_for(config: NodeConfig, port: int) -> str:
    """``node.id``, else ``<hostname>-<API port>``: unique per daemon on one host."""
    return config.id or f"{socket.gethostname()}-{port}"


def new_generation() -> int:
    """Now in ms since the epoch: each restart of a node gets a larger one."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    node_id: str
    secret: bytes
    # Tells this process from the node's earlier ones: gossip orders restarts
    # by it, and node-to-node calls are signed for it.
    generation: int

    def __post_init__(self) -> None:
        if self.generation <= 0:
            raise ValueError(f"generation must be > 0, got {self.generation}")

    @classmethod
    def of(cls, config: NodeConfig, *, port: int, generation: int) -> NodeIdentity:
        return cls(node_id_for(config, port), config.cluster_secret.encode(), generation)
