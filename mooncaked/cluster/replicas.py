"""Where the copies of KV blocks go, and which go: pure functions over a ClusterView.

A block's holders are the up members whose gossiped index has it in DRAM or
on the SSD (device blocks cannot be leased, so they are no replica). A put
with a replica count ``n`` wants every block on ``n`` holders in all:
``plan_put`` picks the nodes that lack blocks, the most free DRAM first;
lowering the count (``plan_drop``) takes copies off the holders with the
least free DRAM first, never the last copy of a block.

No I/O and no clock: the writer (``wire/replicator.py``) runs the plan, and
tests drive these with views they build.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from mooncaked.cluster.block_index import tier_mask
from mooncaked.cluster.state import ClusterView, Member, MemberStatus

# The tiers a replica lives in: what a peer can lease.
HOLDER_TIERS = tier_mask("dram", "ssd")


def holders(view: ClusterView, hashes: Sequence[bytes]) -> list[set[str]]:
    """For each block, the up members that hold it in DRAM or on the SSD."""
    out: list[set[str]] = [set() for _ in hashes]
    for node_id, index in view.blocks.items():
        member = view.get(node_id)
        if member is None or not member.is_up:
            continue
        masks = index.masks
        for i, h in enumerate(hashes):
            if masks.get(h, 0) & HOLDER_TIERS:
                out[i].add(node_id)
    return out


def _free(member: Member) -> int:
    return member.state.load.dram_free_blocks if member.state is not None else 0


def rank_targets(view: ClusterView, model_id: str, exclude: Collection[str] = ()) -> list[str]:
    """Members that may take replicas, best first: alive, serving the same
    model, not draining; most free DRAM slots first, then fewest cached
    blocks, then by node id."""
    ranked = [
        m
        for m in view.members.values()
        if m.status is MemberStatus.ALIVE
        and m.state is not None
        and not m.state.draining
        and m.state.model_id == model_id
        and m.node_id not in exclude
    ]
    ranked.sort(key=lambda m: (-_free(m), view.num_cached_blocks(m.node_id), m.node_id))
    return [m.node_id for m in ranked]


def plan_put(
    held_by: Sequence[set[str]], replicas: int, targets: Sequence[str]
) -> dict[str, list[int]]:
    """Which blocks (indices) each target gets so that every block has
    ``replicas`` holders: targets in rank order, each taking every block it
    lacks that still wants a copy. A block may stay short when the targets
    run out."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    need = [max(0, replicas - len(h)) for h in held_by]
    plan: dict[str, list[int]] = {}
    for target in targets:
        if not any(need):
            break
        mine = [i for i, n in enumerate(need) if n > 0 and target not in held_by[i]]
        if not mine:
            continue
        plan[target] = mine
        for i in mine:
            need[i] -= 1
    return plan


def plan_drop(
    view: ClusterView, held_by: Sequence[set[str]], replicas: int, *, keep: str
) -> dict[str, list[int]]:
    """Which copies (block indices per holder) to drop so that no block has
    more than ``replicas`` holders: the holders with the least free DRAM
    first (they need the room most), ``keep`` (the node asking) last; never
    the last copy of a block."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1 (the last copy is never dropped), got {replicas}")

    def order(node_id: str) -> tuple[bool, int, str]:
        member = view.get(node_id)
        return (node_id == keep, _free(member) if member is not None else 0, node_id)

    plan: dict[str, list[int]] = {}
    for i, nodes in enumerate(held_by):
        extra = len(nodes) - max(replicas, 1)
        for node_id in sorted(nodes, key=order)[: max(0, extra)]:
            plan.setdefault(node_id, []).append(i)
    return plan
