"""Gossip views built by hand, for unit tests of the Conductor and the view itself.

A node is a ``NodeState`` with round defaults (generation 1, gossip at
127.0.0.1:1, its API at ``<node id>:80``); ``add_node`` files it in a view
(alive unless told otherwise) with ``cached`` leading blocks of ``h`` in DRAM.
"""

from __future__ import annotations

import hashlib
from typing import Any

from mooncaked.cluster.block_index import NodeBlocks
from mooncaked.cluster.costs import NodeCosts
from mooncaked.cluster.forecast import DecodeForecast
from mooncaked.cluster.placement import ConductorParams
from mooncaked.cluster.state import (
    ClusterView,
    Member,
    MemberStatus,
    MemoryInfo,
    NodeLoad,
    NodeState,
    OffloadInfo,
    StageInfo,
)

MODEL = "m"
DRAM = 0b010


def exact(**changes: Any) -> ConductorParams:
    """The Conductor's ranking with the best alone, ties by node id and no late
    binding (the orders the tests assert), and ``changes``."""
    fields: dict[str, Any] = {"spread": 0.0, "decode_spread": 0.0, "late_binding": False}
    return ConductorParams(**{**fields, **changes})


EXACT = exact()


def h(i: int) -> bytes:
    """The ``i``-th block hash of the tests' prompts."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def node_state(
    node_id: str,
    role: str,
    *,
    version: int = 1,
    model: str = MODEL,
    api_addr: str = "",
    draining: bool = False,
    load: NodeLoad | None = None,
    costs: NodeCosts | None = None,
    forecast: DecodeForecast | None = None,
    stage: StageInfo | None = None,
    memory: MemoryInfo | None = None,
    offload: OffloadInfo | None = None,
) -> NodeState:
    return NodeState(
        node_id,
        1,
        version,
        "127.0.0.1:1",
        role,
        model,
        api_addr or f"{node_id}:80",
        draining,
        load or NodeLoad(),
        0,
        0,
        0,
        costs=costs or NodeCosts(),
        forecast=forecast or DecodeForecast(),
        stage=stage,
        memory=memory,
        offload=offload,
    )


def member(
    node_id: str, role: str, *, status: MemberStatus = MemberStatus.ALIVE, **state: Any
) -> Member:
    """The member that announced ``node_state(node_id, role, **state)``."""
    st = node_state(node_id, role, **state)
    return Member(node_id, ("127.0.0.1", 1), 1, 1, status, 0.0, 0.0, st)


def add_node(view: ClusterView, node_id: str, role: str, *, cached: int = 0, **fields: Any) -> None:
    """File ``member(node_id, role, **fields)`` in ``view``, holding blocks
    ``h(0) .. h(cached - 1)`` in DRAM."""
    view.members[node_id] = member(node_id, role, **fields)
    blocks = NodeBlocks(1)
    blocks.masks.update({h(i): DRAM for i in range(cached)})
    view.blocks[node_id] = blocks
