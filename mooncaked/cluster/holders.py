"""Who to ask for a prefix: the ``HolderLocator`` of peer fetches.

The holders ``conductor.rank_holders`` picks from the cluster-wide block
index. When nobody holds the prefix, the static ``store.peers`` are the
fallback; with none configured a fetch asks nobody and costs no round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mooncaked.cluster.conductor import MAX_HOLDERS, rank_holders
from mooncaked.cluster.state import ClusterView

if TYPE_CHECKING:
    from mooncaked.cache.hashing import BlockHash


class ClusterHolders:
    """``HolderLocator`` over the cluster-wide block index; static peers as the fallback.

    ``view()`` returns the live ``ClusterView``, or None while gossip is not
    running (then only the static peers are asked); the ranking is
    ``conductor.rank_holders``.
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
