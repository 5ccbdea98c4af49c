"""The origin's side of an object's fetches: who holds and who reads what,
and each fetcher's next shards (``plan.assign``).

Every fetcher calls its object's origin (``SwarmCall``) when it starts, after
each shard it checked or gave up on, and when it is done: the call reports
what it holds, what it reads and which holders failed it, and asks for
shards to read next. The origin hears every fetcher within a shard's time,
long before gossip would spread the news, and it is the one place that knows
which shards are on their way to which serving peer: so it can hand each
shard out from itself once and leave the rest to the peers (the rules in
``plan``). Nodes that hold the object and no longer call (done earlier, or a
node that restarted) come from gossip (``copies``).

A fetcher with nothing to read and nothing handed to it waits in its call
(for news: another fetcher's report) up to ``patience_s``; then it may be
given a shard the origin already serves to someone else. A claim (a shard
handed out) ends when its fetcher reports it held or no longer read, or after
``shard_timeout_s`` (the fetcher died). A holder a fetcher could not reach is
left out for ``_FAILED_HOLDER_S``, long enough for gossip to declare it dead
if it is.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from mooncaked.config import ObjectsConfig
from mooncaked.objects.catalog import Copy
from mooncaked.objects.manifest import Manifest, ShardSet
from mooncaked.objects.messages import Grant, SwarmCall
from mooncaked.objects.plan import Holder, assign

# How long a holder some fetcher could not reach is left out.
_FAILED_HOLDER_S = 30.0


@dataclass(slots=True)
class _Member:
    """A fetcher, as its last call described it."""

    address: str
    have: ShardSet
    serves: bool


@dataclass(slots=True)
class _Claim:
    holder: str
    deadline: float
    # Whether the fetcher will serve the shard on (then others wait for it).
    serves: bool


@dataclass(slots=True)
class SwarmStats:
    calls: int = 0
    grants: int = 0
    # Grants that handed out a shard the origin already served to a serving peer.
    duplicates: int = 0
    # Bytes handed out per holder.
    bytes_by_holder: dict[str, int] = field(default_factory=dict)


class Swarm:
    """One object's fetches, at its origin. Lives on the event loop."""

    def __init__(
        self,
        manifest: Manifest,
        *,
        me: str,
        address: Callable[[], str],
        config: ObjectsConfig,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self.manifest = manifest
        self._me = me
        self._address = address
        self._config = config
        self._clock = clock
        self._rng = rng
        self._members: dict[str, _Member] = {}
        self._claims: dict[tuple[str, int], _Claim] = {}
        self._failed: dict[str, float] = {}
        # Replaced on every change; waiting calls wake on the one they hold.
        self._changed = asyncio.Event()
        self.stats = SwarmStats()

    @property
    def num_fetchers(self) -> int:
        return len(self._members)

    async def answer(self, call: SwarmCall, have: ShardSet, copies: Iterable[Copy]) -> list[Grant]:
        """The shards ``call``'s fetcher reads next; waits (up to ``patience_s``
        and ``call.wait_s``) when it reads nothing and none can be handed out."""
        self.stats.calls += 1
        self.report(call, have)
        known = list(copies)
        grants = self.plan(call, known, duplicates=False)
        if grants or call.slots == 0 or call.fetching or call.wait_s <= 0:
            return grants
        patience = self._config.patience_s
        wait = min(patience, call.wait_s)
        loop = asyncio.get_running_loop()
        end = loop.time() + wait
        while not grants:
            left = end - loop.time()
            if left <= 0:
                # Waited it out: the origin serves that shard once more.
                return self.plan(call, known, duplicates=wait >= patience)
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                continue
            grants = self.plan(call, known, duplicates=False)
        return grants

    def report(self, call: SwarmCall, have: ShardSet) -> None:
        """What ``call`` says of its fetcher and of the holders that failed it."""
        now = self._clock()
        node = call.node
        self._failed.pop(node, None)
        before = self._members.get(node)
        self._members[node] = _Member(call.address, have, call.serves)
        reading = set(call.fetching)
        for key in [k for k in self._claims if k[0] == node]:
            if key[1] not in reading or key[1] in have:
                del self._claims[key]
        for holder in call.avoid_nodes:
            if holder != self._me:
                self._failed[holder] = now + _FAILED_HOLDER_S
                self._members.pop(holder, None)
        if before is None or before.have != have or call.avoid_nodes:
            self._notify()

    def forget(self, node: str) -> None:
        """``node`` is gone (gossip says so): it neither holds nor reads anything."""
        if self._members.pop(node, None) is not None:
            for key in [k for k in self._claims if k[0] == node]:
                del self._claims[key]
            self._notify()

    def plan(self, call: SwarmCall, copies: Iterable[Copy], *, duplicates: bool) -> list[Grant]:
        if call.slots == 0:
            return []
        now = self._clock()
        self._expire(now)
        requester = self._members[call.node]
        holders, addresses = self._holders(call.node, copies, now)
        uploads: dict[str, int] = {}
        claimed: set[int] = set()
        for (fetcher, shard), claim in self._claims.items():
            uploads[claim.holder] = uploads.get(claim.holder, 0) + 1
            if claim.serves and fetcher != call.node:
                claimed.add(shard)
        reading = set(call.fetching)
        missing = [i for i in requester.have.missing() if i not in reading]
        picks = assign(
            missing=missing,
            holders=holders,
            uploads=uploads,
            claimed=claimed,
            slots=call.slots,
            max_uploads=self._config.max_uploads,
            rng=self._rng,
            duplicates=duplicates,
            avoid=set(call.avoid),
            avoid_nodes=set(call.avoid_nodes),
        )
        deadline = now + self._config.shard_timeout_s
        grants: list[Grant] = []
        for pick in picks:
            if pick.shard in claimed and pick.holder == self._me:
                self.stats.duplicates += 1
            self._claims[(call.node, pick.shard)] = _Claim(pick.holder, deadline, requester.serves)
            self.stats.grants += 1
            by = self.stats.bytes_by_holder
            by[pick.holder] = by.get(pick.holder, 0) + self.manifest.shard_length(pick.shard)
            grants.append(Grant(pick.shard, pick.holder, addresses[pick.holder]))
        if grants:
            self._notify()
        return grants

    def _holders(
        self, requester: str, copies: Iterable[Copy], now: float
    ) -> tuple[list[Holder], dict[str, str]]:
        """Every holder but ``requester`` and those left out; their addresses."""
        n = self.manifest.num_shards
        haves: dict[str, ShardSet] = {self._me: ShardSet.full(n)}
        addresses = {self._me: self._address()}
        for c in copies:
            if c.node_id != self._me:
                haves[c.node_id] = c.have.copy()
                addresses[c.node_id] = c.address
        for node, m in self._members.items():
            if not m.serves:
                continue
            held = haves.setdefault(node, ShardSet(n))
            for i in m.have:
                held.add(i)
            addresses[node] = m.address
        holders = [
            Holder(node, have, is_origin=node == self._me)
            for node, have in haves.items()
            if node != requester and self._failed.get(node, 0.0) <= now and len(have)
        ]
        return holders, addresses

    def _expire(self, now: float) -> None:
        for key in [k for k, c in self._claims.items() if c.deadline <= now]:
            del self._claims[key]
        for node in [n for n, until in self._failed.items() if until <= now]:
            del self._failed[node]

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
