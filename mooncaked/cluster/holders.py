"""Who to ask for a prefix: the ``HolderLocator`` of peer fetches.

The holders ``rank_holders`` picks from the cluster-wide block index. When
nobody holds the prefix, the static ``store.peers`` are the fallback; with
none configured a fetch asks nobody and costs no round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mooncaked.cache.tiers import Tier
from mooncaked.cluster.block_index import tier_mask
from mooncaked.cluster.state import ClusterView, MemberStatus

if TYPE_CHECKING:
    from mooncaked.cache.hashing import BlockHash

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


class ClusterHolders:
    """``HolderLocator`` over the cluster-wide block index; static peers as the fallback.

    ``view()`` returns the live ``ClusterView``, or None while gossip is not
    running (then only the static peers are asked); the ranking is
    ``rank_holders``.
    """

    def __init__(
        self,
        view: Callable[[], ClusterView | None],
        *,
        static: Sequence[str] = (),
        max_holders: int = MAX_HOLDERS,
    ) -> None:
        if max_holders <= 0:
            raise ValueError(f"max_holders must be > 0, got {max_holders}")
        self._view = view
        self._static = tuple(static)
        self._max_holders = max_holders

    def holders(self, hashes: Sequence[BlockHash]) -> list[str]:
        view = self._view()
        if view is not None and hashes:
            found = rank_holders(view, hashes, self._max_holders)
            if found:
                return [f"http://{addr}" for addr in found]
        return list(self._static)
