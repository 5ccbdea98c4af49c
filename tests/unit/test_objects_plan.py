"""Which shard from whom (``plan.assign``), and the origin's coordination of
fetchers that join together (``swarm.Swarm``), without I/O: exact choices
from a seeded random source."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import random

from mooncaked.config import ObjectsConfig
from mooncaked.objects.catalog import Copy
from mooncaked.objects.manifest import Manifest, ObjectFile, ShardSet, digest_of
from mooncaked.objects.messages import SwarmCall
from mooncaked.objects.plan import Assignment, Holder, assign
from mooncaked.objects.swarm import Swarm
from tests.conftest import ManualClock

N = 8


def pick(holders: list[Holder], **kwargs: object) -> list[Assignment]:
    args: dict[str, object] = {
        "missing": list(range(N)),
        "holders": holders,
        "uploads": {},
        "claimed": (),
        "slots": 1,
        "max_uploads": 4,
        "rng": random.Random(1),
    }
    return assign(**(args | kwargs))  # type: ignore[arg-type]


ORIGIN = Holder("origin", ShardSet.full(N), is_origin=True)


def test_peers_first_rarest_shard_from_the_least_loaded_peer() -> None:
    a = Holder("a", ShardSet(N, [0, 1, 2]))
    b = Holder("b", ShardSet(N, [1, 2]))
    c = Holder("c", ShardSet(N, [2]))
    # Shard 0 has two holders (origin, a), 1 has three, 2 four: 0 is rarest.
    assert pick([ORIGIN, a, b, c]) == [Assignment(0, "a")]
    # Without 0, shard 1: from b, which serves less than a.
    assert pick([ORIGIN, a, b, c], missing=[1, 2], uploads={"a": 2, "b": 1}) == [Assignment(1, "b")]
    # Three slots: 0 from a, 1 from b (a now serves one), 2 from c.
    assert pick([ORIGIN, a, b, c], missing=[0, 1, 2], slots=3) == [
        Assignment(0, "a"),
        Assignment(1, "b"),
        Assignment(2, "c"),
    ]


def test_the_origin_serves_what_no_peer_has_and_nobody_fetches() -> None:
    got = pick([ORIGIN], slots=3, claimed={0, 1, 2, 3})
    assert {a.holder for a in got} == {"origin"}
    assert {a.shard for a in got} <= {4, 5, 6, 7} and len({a.shard for a in got}) == 3
    # The same seed, the same choice.
    assert got == pick([ORIGIN], slots=3, claimed={0, 1, 2, 3})
    # Claimed shards wait for their fetcher, unless duplicates are allowed.
    assert pick([ORIGIN], missing=[0, 1], claimed={0, 1}) == []
    assert pick([ORIGIN], missing=[0], claimed={0}, duplicates=True) == [Assignment(0, "origin")]
    # A peer holds 5 but serves all it may: wait for it rather than load the origin.
    busy = Holder("a", ShardSet(N, [5]))
    assert pick([ORIGIN, busy], missing=[5], uploads={"a": 4}) == []
    assert pick([ORIGIN, busy], missing=[5], uploads={"a": 4}, duplicates=True) == [
        Assignment(5, "origin")
    ]


def test_bounds_and_holders_left_out() -> None:
    a = Holder("a", ShardSet(N, [0]))
    assert pick([ORIGIN, a], missing=[0], uploads={"origin": 4, "a": 4}, duplicates=True) == []
    assert pick([ORIGIN, a], missing=[0], avoid={(0, "a")}, duplicates=True) == [
        Assignment(0, "origin")
    ]
    assert pick([ORIGIN, a], missing=[0], avoid_nodes={"a"}, duplicates=True) == [
        Assignment(0, "origin")
    ]
    assert pick([a], missing=[1]) == []
    assert pick([ORIGIN], slots=0) == []


def make_manifest(num_shards: int, shard_bytes: int = 100) -> Manifest:
    size = num_shards * shard_bytes
    sums = tuple(hashlib.sha256(bytes([i % 256, i // 256])).digest() for i in range(num_shards))
    return Manifest(
        "blob",
        1,
        "origin",
        "blob.bin",
        False,
        (ObjectFile("blob.bin", size, 0),),
        size,
        shard_bytes,
        "sha256",
        sums,
        digest_of("sha256", size, shard_bytes, sums),
    )


def call(
    node: str, have: ShardSet, reading: set[int], slots: int, wait_s: float = 0.0
) -> SwarmCall:
    return SwarmCall(
        "blob",
        1,
        node,
        f"{node}:1",
        have.hex(),
        True,
        tuple(sorted(reading)),
        slots=slots,
        wait_s=wait_s,
    )


def simulate(num_fetchers: int, num_shards: int, max_fetches: int, seed: int) -> dict[str, int]:
    """Fetchers join at once; each round every fetcher asks for what it has room
    for, then every read of the round lands. Returns reads per holder."""
    m = make_manifest(num_shards)
    config = ObjectsConfig(max_fetches=max_fetches, max_uploads=8, patience_s=0.0)
    swarm = Swarm(
        m,
        me="origin",
        address=lambda: "origin:1",
        config=config,
        clock=ManualClock(),
        rng=random.Random(seed),
    )
    names = [f"f{i}" for i in range(num_fetchers)]
    have = {n: ShardSet(num_shards) for n in names}
    reading: dict[str, dict[int, str]] = {n: {} for n in names}
    served: dict[str, int] = {}

    async def run() -> None:
        for _ in range(10 * num_shards):
            if all(h.complete for h in have.values()):
                return
            for n in names:
                free = max_fetches - len(reading[n])
                grants = await swarm.answer(call(n, have[n], set(reading[n]), free), have[n], ())
                for g in grants:
                    assert g.shard not in have[n] and g.shard not in reading[n]
                    reading[n][g.shard] = g.node
            for n in names:
                for shard, holder in reading[n].items():
                    have[n].add(shard)
                    served[holder] = served.get(holder, 0) + 1
                reading[n].clear()
        raise AssertionError("the fetchers did not finish")

    asyncio.run(run())
    return served


def test_fetchers_joining_together_share_the_load_the_origin_serves_each_shard_once() -> None:
    for seed in range(5):
        served = simulate(num_fetchers=3, num_shards=32, max_fetches=4, seed=seed)
        assert served["origin"] == 32, served
        assert sum(served.values()) == 3 * 32
    served = simulate(num_fetchers=5, num_shards=7, max_fetches=2, seed=0)
    assert served["origin"] == 7 and sum(served.values()) == 35


def test_an_idle_fetcher_waits_for_the_peer_fetching_what_it_needs_then_the_origin_serves_it() -> (
    None
):
    m = make_manifest(1)
    config = ObjectsConfig(patience_s=0.05)
    swarm = Swarm(
        m,
        me="origin",
        address=lambda: "origin:1",
        config=config,
        clock=ManualClock(),
        rng=random.Random(0),
    )
    empty = ShardSet(1)

    async def run() -> None:
        first = await swarm.answer(call("a", empty, set(), 1), empty, ())
        assert [(g.shard, g.node) for g in first] == [(0, "origin")]
        # b needs shard 0, which a fetches and will serve: b waits for a's
        # report, and gets it from a.
        waiting = asyncio.ensure_future(
            swarm.answer(call("b", empty, set(), 1, wait_s=5.0), empty, ())
        )
        await asyncio.sleep(0)
        assert not waiting.done()
        done = ShardSet.full(1)
        await swarm.answer(call("a", done, set(), 0), done, ())
        assert [(g.shard, g.node, g.address) for g in await waiting] == [(0, "a", "a:1")]
        # c waits too; a's read of it fails its patience: the origin serves it again.
        assert swarm.stats.duplicates == 0
        swarm2 = Swarm(
            m,
            me="origin",
            address=lambda: "origin:1",
            config=config,
            clock=ManualClock(),
            rng=random.Random(0),
        )
        await swarm2.answer(call("a", empty, set(), 1), empty, ())
        late = await swarm2.answer(call("c", empty, set(), 1, wait_s=5.0), empty, ())
        assert [(g.shard, g.node) for g in late] == [(0, "origin")]
        assert swarm2.stats.duplicates == 1

    asyncio.run(run())


def test_gossiped_holders_serve_and_failed_holders_are_left_out() -> None:
    m = make_manifest(2)
    clock = ManualClock()
    swarm = Swarm(
        m,
        me="origin",
        address=lambda: "origin:1",
        config=ObjectsConfig(),
        clock=clock,
        rng=random.Random(0),
    )
    empty = ShardSet(2)
    old = Copy("old", ShardSet.full(2), "old:1")

    async def run() -> None:
        got = await swarm.answer(call("a", empty, set(), 2), empty, [old])
        assert {(g.shard, g.node) for g in got} == {(0, "old"), (1, "old")}
        # a could not reach "old": it is left out (for everyone), and a's
        # claims on what it no longer reads are dropped.
        c = dataclasses.replace(call("a", empty, set(), 2), avoid_nodes=("old",))
        got = await swarm.answer(c, empty, [old])
        assert {(g.shard, g.node) for g in got} == {(0, "origin"), (1, "origin")}
        clock.now += 31.0
        c = dataclasses.replace(call("b", empty, set(), 1))
        got = await swarm.answer(c, empty, [old])
        assert [(g.node) for g in got] == ["old"]

    asyncio.run(run())
