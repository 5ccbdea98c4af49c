"""SWIM-style membership, state dissemination and block-index replication.

One module per concept, imports running down the list:

- ``queue``: ``BroadcastQueue``, news waiting to be piggy-backed.
- ``membership``: SWIM probes, suspicion, alive/suspect/dead, refutation.
- ``blocks``: block-index replication (deltas, gaps, lag detection, pulls).
- ``core``: ``GossipCore``, the protocol composed of the three, without I/O
  (injected clock and random source), plus state dissemination and sync.
- ``service``: ``ClusterService``, the core on real UDP/TCP sockets.
"""

from __future__ import annotations

from mooncaked.cluster.gossip.core import GossipCore, SyncTarget
from mooncaked.cluster.gossip.queue import BroadcastQueue
from mooncaked.cluster.gossip.service import ClusterService, Direction, DropPeers, PacketFilter

__all__ = [
    "BroadcastQueue",
    "ClusterService",
    "Direction",
    "DropPeers",
    "GossipCore",
    "PacketFilter",
    "SyncTarget",
]
