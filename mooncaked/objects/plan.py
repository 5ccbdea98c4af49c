"""Which shard a fetcher reads next, and from whom: one pure function.

``assign`` hands a fetcher up to ``slots`` shards, one at a time, each by the
first rule that gives one:

1. a shard some peer (a holder other than an origin) has: the rarest such
   shard (fewest holders), from its least-loaded peer;
2. a shard only origins have and no serving peer is fetching yet: a random
   one, from its least-loaded origin;
3. with ``duplicates``, any shard an origin has (a serving peer is fetching
   it, or the peers that have it are busy): from its least-loaded origin.

Rule 1 keeps origins for what nobody else has; rule 2 never hands out a
shard an origin already serves to a peer that will serve it on, so when
nodes fetch an object together the origin serves each shard about once and
the peers serve each other the rest; rule 3 is for a fetcher that waited
for that peer long enough (the coordinator's ``patience_s``) or that cannot
know what others fetch (no coordinator). A holder serving ``max_uploads``
reads already, a (shard, holder) pair that failed this fetcher before and a
holder it could not reach are never chosen. Ties break at random, from the
injected ``rng``, so fetchers that choose at once choose apart.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from mooncaked.objects.manifest import ShardSet


@dataclass(frozen=True, slots=True)
class Holder:
    node_id: str
    have: ShardSet
    # A node that registered the object (it has all of it, and is the one to spare).
    is_origin: bool = False


@dataclass(frozen=True, slots=True)
class Assignment:
    shard: int
    holder: str


def assign(
    *,
    missing: Sequence[int],
    holders: Sequence[Holder],
    uploads: Mapping[str, int],
    claimed: Collection[int],
    slots: int,
    max_uploads: int,
    rng: random.Random,
    duplicates: bool = False,
    avoid: Collection[tuple[int, str]] = (),
    avoid_nodes: Collection[str] = (),
) -> list[Assignment]:
    """Up to ``slots`` shards of ``missing`` (those the fetcher needs and is not
    reading), by the module's rules. ``uploads``: reads in flight from each
    holder as the chooser knows them; ``claimed``: shards serving peers are
    fetching now."""
    load = dict(uploads)
    left = set(missing)
    usable = [h for h in holders if h.node_id not in avoid_nodes]
    out: list[Assignment] = []
    while len(out) < slots and left:
        pick = _next(left, usable, load, claimed, max_uploads, rng, duplicates, avoid)
        if pick is None:
            break
        out.append(pick)
        left.discard(pick.shard)
        load[pick.holder] = load.get(pick.holder, 0) + 1
    return out


def _next(
    left: set[int],
    holders: Sequence[Holder],
    load: Mapping[str, int],
    claimed: Collection[int],
    max_uploads: int,
    rng: random.Random,
    duplicates: bool,
    avoid: Collection[tuple[int, str]],
) -> Assignment | None:
    def free(h: Holder, shard: int) -> bool:
        return (
            shard in h.have
            and load.get(h.node_id, 0) < max_uploads
            and (shard, h.node_id) not in avoid
        )

    # Shards in a fixed order and one draw each: the same rng, the same choice.
    peer_held: list[tuple[int, float, int]] = []
    origin_only: list[int] = []
    for shard in sorted(left):
        if any(not h.is_origin and free(h, shard) for h in holders):
            rarity = sum(shard in h.have for h in holders)
            peer_held.append((rarity, rng.random(), shard))
        elif any(h.is_origin and free(h, shard) for h in holders) and (
            duplicates
            or (
                shard not in claimed
                and not any(
                    shard in h.have and (shard, h.node_id) not in avoid
                    for h in holders
                    if not h.is_origin
                )
            )
        ):
            # A peer that has it but serves all it may now will be free soon.
            origin_only.append(shard)
    if peer_held:
        shard = min(peer_held)[2]
        peers = [h for h in holders if not h.is_origin and free(h, shard)]
        return Assignment(shard, _least_loaded(peers, load, rng))
    if origin_only:
        shard = origin_only[rng.randrange(len(origin_only))]
        origins = [h for h in holders if h.is_origin and free(h, shard)]
        return Assignment(shard, _least_loaded(origins, load, rng))
    return None


def _least_loaded(holders: Sequence[Holder], load: Mapping[str, int], rng: random.Random) -> str:
    """The holder serving the fewest reads; a random one of those tied."""
    least = min(load.get(h.node_id, 0) for h in holders)
    tied = sorted(h.node_id for h in holders if load.get(h.node_id, 0) == least)
    return tied[rng.randrange(len(tied))]
