"""The Conductor's policies: pure functions over a ``ClusterView`` snapshot.

No I/O and no clock of its own: the daemon calls these with its live gossip
view, and a simulator can call them with a simulated one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mooncaked.cache.hashing import BlockHash
from mooncaked.cache.tiers import Tier
from mooncaked.cluster.state import ClusterView, MemberStatus, tier_mask

# Peers asked for one prefix at most: the index may be a little stale, so a
# second and third holder hedge a first that evicted the blocks meanwhile;
# every extra one costs a lease round trip.
MAX_HOLDERS = 3
# What a peer can lease: DRAM slots, and SSD blocks it promotes to DRAM first.
LEASABLE_TIERS = tier_mask(Tier.DRAM, Tier.SSD)


def rank_holders(
    view: ClusterView, hashes: Sequence[BlockHash], max_holders: int = MAX_HOLDERS
) -> list[str]:
    """API addresses (``host:port``) of the peers to ask for a prefix, best first.

    Holders are other alive members with an API address whose index holds a
    leading run of ``hashes`` in a leasable tier; longest run first, then not
    draining (it is about to leave), then fewer SSD blocks (a holder reads
    those before it can lease them), then node id (a deterministic order).
    Suspects are left out: asking one could cost the whole fetch deadline.
    """
    if max_holders <= 0:
        raise ValueError(f"max_holders must be > 0, got {max_holders}")
    if not hashes:
        return []
    matches = view.longest_prefix(hashes, tiers=LEASABLE_TIERS)
    ranked: list[tuple[int, bool, int, str, str]] = []
    for node_id, match in matches.items():
        if node_id == view.self_id:
            continue
        m = view.members.get(node_id)
        if m is None or m.status is not MemberStatus.ALIVE or m.state is None:
            continue
        st = m.state
        if not st.api_addr:
            continue
        ranked.append(
            (-match.num_blocks, st.draining, match.tier_blocks[Tier.SSD], node_id, st.api_addr)
        )
    ranked.sort()
    return [addr for *_, addr in ranked[:max_holders]]


# -- placement ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """What placement needs of a request: its model and its prompt's block hashes."""

    model_id: str
    hashes: tuple[BlockHash, ...]
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Candidate:
    node_id: str
    # host:port of the node's HTTP API.
    api_addr: str
    role: str
    # Leading prompt blocks the node holds in any tier (the cluster index's view).
    cached_blocks: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.api_addr}"


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request runs: its decode node, and the prefill nodes to try in
    order (empty: the decode node computes the prompt itself, in one engine)."""

    decode: Candidate
    prefill: tuple[Candidate, ...] = ()

    @property
    def colocated(self) -> bool:
        return not self.prefill


@dataclass(frozen=True, slots=True)
class Reject:
    """No placement: the HTTP status to answer and why, for the client."""

    status: int
    reason: str


def place(
    view: ClusterView,
    request: PlacementRequest,
    now: float,
    *,
    exclude: frozenset[str] = frozenset(),
    max_prefill: int = 3,
) -> Placement | Reject:
    """Pick a decode node and prefill nodes for ``request`` from a gossip view.

    Candidates are alive (suspects only after every alive one), not
    draining, serve the request's model and are not in ``exclude`` (nodes
    that just failed this request). A ``prefill`` node
    only prefills and a ``decode`` node only decodes; a ``both`` node does
    either, or both in one engine.

    - Decode: a dedicated decode node if there is one, else a ``both`` node;
      the least loaded (running decodes, then KV usage, then node id).
    - Prefill: dedicated prefill nodes, else (when the decode node is
      dedicated) ``both`` nodes; longest cached prefix in the cluster block
      index first, then the shortest prefill queue. Up to ``max_prefill`` of
      them, so the decode node can try the next when one fails.
    - No dedicated decode and no dedicated prefill node: one ``both`` node
      does it all (colocated): the entry node itself when it is one, else the
      one with the longest cached prefix, then the shortest queue.
    - A decode node with no prefill node alive prefills itself (the
      documented fallback).

    Pure: no I/O, ``now`` is the caller's clock (unused by this policy, kept
    for policies that forecast load).
    """
    del now
    prefill_nodes: list[Candidate] = []
    decode_nodes: list[Candidate] = []
    both_nodes: list[Candidate] = []
    matches = view.longest_prefix(request.hashes) if request.hashes else {}
    loads: dict[str, tuple[int, int, float]] = {}
    # Suspected members (a probe went unanswered, e.g. a node too busy to
    # answer in time) are kept as a last resort: a dead one fails fast and is
    # excluded, where refusing them would fail the request at once.
    suspect: set[str] = set()
    for node_id, m in view.members.items():
        st = m.state
        if m.status is MemberStatus.SUSPECT:
            suspect.add(node_id)
        elif m.status is not MemberStatus.ALIVE:
            continue
        if st is None or node_id in exclude:
            continue
        if st.draining or not st.api_addr or st.model_id != request.model_id:
            continue
        match = matches.get(node_id)
        c = Candidate(node_id, st.api_addr, st.role, match.num_blocks if match else 0)
        loads[node_id] = (
            st.load.queued_prefill_tokens,
            st.load.running_decode_batch,
            st.load.kv_usage,
        )
        {"prefill": prefill_nodes, "decode": decode_nodes, "both": both_nodes}.get(
            st.role, []
        ).append(c)

    def by_decode_load(c: Candidate) -> tuple[bool, int, float, str]:
        _, decode, kv = loads[c.node_id]
        return (c.node_id in suspect, decode, kv, c.node_id)

    def by_prefix_then_queue(c: Candidate) -> tuple[bool, int, int, str]:
        return (c.node_id in suspect, -c.cached_blocks, loads[c.node_id][0], c.node_id)

    if not decode_nodes and not prefill_nodes:
        if not both_nodes:
            return Reject(
                503, f"no node of the cluster serves model {request.model_id!r} right now"
            )
        for c in both_nodes:
            if c.node_id == view.self_id:
                # A cluster of `both` nodes: each serves what enters it (its
                # peers' cached prefixes come to it through peer fetches).
                return Placement(decode=c)
        return Placement(decode=min(both_nodes, key=by_prefix_then_queue))
    if decode_nodes:
        decode = min(decode_nodes, key=by_decode_load)
        pool = prefill_nodes or both_nodes
    elif both_nodes:
        decode = min(both_nodes, key=by_decode_load)
        pool = prefill_nodes
    else:
        return Reject(
            503,
            f"no decode node serves model {request.model_id!r} right now "
            f"({len(prefill_nodes)} prefill node(s) alive, none can decode)",
        )
    prefill = tuple(sorted(pool, key=by_prefix_then_queue)[:max_prefill])
    return Placement(decode=decode, prefill=prefill)
