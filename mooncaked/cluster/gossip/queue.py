"""The broadcast queue: news waiting to be piggy-backed on outgoing packets.

Each item is sent until it went out ``limit`` times (the retransmit limit the
membership derives from the cluster size); newer news under the same key
replaces older, so a node's third state change does not queue behind its
first two.
"""

from __future__ import annotations

from mooncaked.cluster.state import ClusterCounters

# (kind, node id, sub-key): kind "m" membership, "s" state, "b" block delta
# (keyed by its from_version, so the pieces of one flush do not replace each other).
Key = tuple[str, str, int]

# Membership news first, then states, then block deltas: a receiver drops a
# state or delta of a member it has not heard of, so the alive must come first.
_KIND_RANK = {"m": 0, "s": 1, "b": 2}

# Below this many bytes left, no frame worth sending fits: stop looking.
_MIN_USEFUL_BUDGET = 32


class BroadcastQueue:
    """News waiting to be piggy-backed: fewest-sent first, bounded, keyed for replacement.

    Items sit in buckets by how often they were sent (newest first within a
    bucket), so ``take`` visits only what it sends instead of sorting the
    queue for every packet.
    """

    __slots__ = ("_buckets", "_counters", "_max_items", "_where")

    def __init__(self, max_items: int, counters: ClusterCounters) -> None:
        self._where: dict[Key, int] = {}
        self._buckets: list[dict[Key, bytes]] = [{}]
        self._max_items = max_items
        self._counters = counters

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: Key) -> bool:
        return key in self._where

    def put(self, key: Key, frame: bytes) -> None:
        """Queue ``frame``; it replaces queued news under the same key."""
        old = self._where.get(key)
        if old is not None:
            del self._buckets[old][key]
        self._buckets[0][key] = frame
        self._where[key] = 0
        if len(self._where) > self._max_items:
            # The oldest of the most-sent items has done most of its work.
            for bucket in reversed(self._buckets):
                if bucket:
                    victim = next(iter(bucket))
                    del bucket[victim]
                    del self._where[victim]
                    self._counters.dropped_broadcasts += 1
                    break

    def take(self, budget: int, limit: int) -> list[bytes]:
        """Frames fitting in ``budget`` bytes, each counted as sent once more."""
        if not self._where or budget <= 0:
            return []
        sent: list[tuple[int, Key, bytes]] = []
        buckets = self._buckets
        for t, bucket in enumerate(buckets):
            if not bucket:
                continue
            if t >= limit:
                # The cluster shrank: these were sent often enough.
                for key in bucket:
                    del self._where[key]
                bucket.clear()
                continue
            for key in reversed(bucket):
                frame = bucket[key]
                if len(frame) > budget:
                    continue
                budget -= len(frame)
                sent.append((t, key, frame))
                if budget < _MIN_USEFUL_BUDGET:
                    break
            if budget < _MIN_USEFUL_BUDGET:
                break
        sent.sort(key=lambda item: _KIND_RANK[item[1][0]])
        out = [frame for _, _, frame in sent]
        for t, key, frame in sent:
            del buckets[t][key]
            if t + 1 >= limit:
                del self._where[key]
                continue
            if t + 1 == len(buckets):
                buckets.append({})
            buckets[t + 1][key] = frame
            self._where[key] = t + 1
        return out
