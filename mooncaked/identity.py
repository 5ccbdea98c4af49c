"""Who a node is: its id, the cluster secret it signs with, and its generation.

The one place that derives a node's id and reads its secret out of the
config; everything that signs, verifies or names this node takes a
``NodeIdentity`` (or its fields) from here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mooncaked.config import NodeConfig


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
        return cls(config.id_at(port), config.cluster_secret.encode(), generation)
