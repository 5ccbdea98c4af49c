"""Access rights of registered segments, and the write grants that open one.

Every segment says what peers may do with it (``Access``); the serving side
checks each remote op against it before a byte moves, and the shm and RDMA
paths hand out only the rights it gives (a read-only mapping, a memory region
without REMOTE_WRITE).

A ``GRANTED`` segment takes writes only into blocks a live ``WriteGrant``
names, from the peer it names, until its deadline: the decode node's KV cache,
written by the prefill node it asked, for that request only. A grant speaks of
blocks, not bytes, because the segment is a stack of planes (one per layer and
K/V) of ``blocks_per_plane`` blocks each: block ``b`` of every plane is one
logical block, so a grant of a few block ids covers them in every layer
(or, for a stage of a pipelined prefill group, in its own layers' planes).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


class Access(enum.Enum):
    # Peers read any byte in range and write none (the DRAM tier peers fetch from).
    READ = "read"
    # Peers write only blocks granted to them and read none (a KV cache that
    # receives a prompt's KV from a prefill node).
    GRANTED = "granted"
    # Any authenticated peer reads and writes (tools and tests; the daemon
    # registers none).
    READ_WRITE = "read_write"

    @property
    def describe(self) -> str:
        return {
            Access.READ: "read-only to peers",
            Access.GRANTED: "written by peers only under a grant, and not read by them",
            Access.READ_WRITE: "open to peers",
        }[self]

    @property
    def peers_read(self) -> bool:
        return self is not Access.GRANTED

    @property
    def peers_write(self) -> bool:
        """Peers may write at all (under a grant for GRANTED)."""
        return self is not Access.READ


def parse_access(value: object) -> Access:
    """An Access from its wire name; ValueError naming the bad value."""
    for access in Access:
        if value == access.value:
            return access
    raise ValueError(
        f"unknown segment access {value!r}; expected one of {[a.value for a in Access]}"
    )


@dataclass(frozen=True, slots=True)
class WriteGrant:
    """Blocks of one segment one peer may write until ``deadline`` (monotonic)."""

    grant_id: int
    segment: str
    peer: str
    block_bytes: int
    blocks_per_plane: int
    block_ids: frozenset[int]
    deadline: float
    # The planes [lo, hi) the grant opens (a pipeline stage writes its own
    # layers' K and V planes only); None: every plane.
    planes: tuple[int, int] | None = None

    def covers(self, offset: int, length: int) -> bool:
        """Every block [offset, offset+length) touches is granted."""
        if offset < 0 or length < 0:
            return False
        if length == 0:
            return True
        first = offset // self.block_bytes
        last = (offset + length - 1) // self.block_bytes
        per_plane, ids = self.blocks_per_plane, self.block_ids
        if self.planes is not None:
            lo, hi = self.planes
            if not (lo <= first // per_plane and last // per_plane < hi):
                return False
        return all(unit % per_plane in ids for unit in range(first, last + 1))


class GrantTable:
    """Live write grants by (segment, peer).

    Changed on the event loop, checked by serving threads: one lock. Expired
    grants are dropped as they are met, so the table holds at most the grants
    of requests in flight.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._grants: dict[tuple[str, str], dict[int, WriteGrant]] = {}
        self._next_id = 1

    def grant(
        self,
        segment: str,
        peer: str,
        *,
        block_bytes: int,
        blocks_per_plane: int,
        block_ids: Iterable[int],
        ttl_s: float,
        planes: tuple[int, int] | None = None,
    ) -> WriteGrant:
        if not peer:
            raise ValueError("a write grant must name its peer")
        if block_bytes <= 0 or blocks_per_plane <= 0:
            raise ValueError(
                f"a write grant needs block_bytes > 0 and blocks_per_plane > 0, "
                f"got {block_bytes} and {blocks_per_plane}"
            )
        if not ttl_s > 0:
            raise ValueError(f"a write grant needs a ttl_s > 0, got {ttl_s}")
        ids = frozenset(block_ids)
        bad = [b for b in ids if not 0 <= b < blocks_per_plane]
        if bad:
            raise ValueError(
                f"granted block ids {sorted(bad)[:5]} are outside 0..{blocks_per_plane - 1}"
            )
        if planes is not None and not 0 <= planes[0] < planes[1]:
            raise ValueError(f"a write grant's planes must be a range lo < hi, got {planes}")
        with self._lock:
            grant = WriteGrant(
                self._next_id,
                segment,
                peer,
                block_bytes,
                blocks_per_plane,
                ids,
                self._clock() + ttl_s,
                planes,
            )
            self._next_id += 1
            self._prune_locked()
            self._grants.setdefault((segment, peer), {})[grant.grant_id] = grant
        return grant

    def revoke(self, grant: WriteGrant) -> None:
        """End a grant before its deadline (idempotent)."""
        with self._lock:
            key = (grant.segment, grant.peer)
            live = self._grants.get(key)
            if live is not None:
                live.pop(grant.grant_id, None)
                if not live:
                    del self._grants[key]

    def revoke_segment(self, segment: str) -> None:
        with self._lock:
            for key in [k for k in self._grants if k[0] == segment]:
                del self._grants[key]

    def allows(self, segment: str, peer: str, offset: int, length: int) -> bool:
        """A live grant lets ``peer`` write [offset, offset+length) of ``segment``."""
        with self._lock:
            live = self._live_locked(segment, peer)
            return any(g.covers(offset, length) for g in live)

    def has_live(self, segment: str, peer: str) -> bool:
        with self._lock:
            return bool(self._live_locked(segment, peer))

    def __len__(self) -> int:
        with self._lock:
            self._prune_locked()
            return sum(len(v) for v in self._grants.values())

    def _live_locked(self, segment: str, peer: str) -> list[WriteGrant]:
        live = self._grants.get((segment, peer))
        if not live:
            return []
        now = self._clock()
        for gid in [gid for gid, g in live.items() if g.deadline <= now]:
            del live[gid]
        if not live:
            del self._grants[(segment, peer)]
            return []
        return list(live.values())

    def _prune_locked(self) -> None:
        now = self._clock()
        for key in list(self._grants):
            live = self._grants[key]
            for gid in [gid for gid, g in live.items() if g.deadline <= now]:
                del live[gid]
            if not live:
                del self._grants[key]
