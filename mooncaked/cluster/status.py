"""What /admin/status and /metrics show of gossip, read in one go."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mooncaked.cluster.events import BlockEventBatcher
from mooncaked.cluster.state import ClusterCounters, MemberStatus

if TYPE_CHECKING:
    from mooncaked.cluster.gossip.service import ClusterService


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """What /admin/status and /metrics show of gossip, read in one go."""

    node_id: str
    gossip_addr: str
    incarnation: int
    num_seeds: int
    # Members by status (self included), every status present.
    members: dict[str, int]
    counters: ClusterCounters
    # Entries of every node's replica of the block index, and of this node's own.
    index_blocks: int
    own_blocks: int
    block_events: int
    block_event_errors: int

    def status(self) -> dict[str, Any]:
        """The "cluster" section of /admin/status."""
        c = self.counters
        return {
            "node_id": self.node_id,
            "gossip_addr": self.gossip_addr,
            "incarnation": self.incarnation,
            "seeds": self.num_seeds,
            "members": self.members,
            "index_blocks": self.index_blocks,
            "own_blocks": self.own_blocks,
            "packets": {
                "sent": c.packets_sent,
                "received": c.packets_received,
                "forged": c.dropped_bad_mac,
                "garbage": c.dropped_malformed + c.dropped_oversize,
                "invalid": c.dropped_invalid,
            },
        }


def cluster_snapshot(service: ClusterService, batcher: BlockEventBatcher) -> ClusterSnapshot:
    view = service.view
    members = {s.value: 0 for s in MemberStatus}
    for m in view.members.values():
        members[m.status.value] += 1
    c = service.counters
    return ClusterSnapshot(
        node_id=service.node_id,
        gossip_addr=f"{service.config.gossip_host}:{service.gossip_port}",
        incarnation=service.core.incarnation,
        num_seeds=len(service.config.seeds),
        members=members,
        # A copy: the collector reads it after the loop may have moved on.
        counters=dataclasses.replace(c),
        index_blocks=sum(len(b) for b in view.blocks.values()),
        own_blocks=view.num_cached_blocks(view.self_id),
        block_events=batcher.num_events,
        block_event_errors=batcher.num_errors,
    )
