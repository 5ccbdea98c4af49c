"""Put with a replica count on real in-process nodes joined on loopback.

Node A computes a prompt (its blocks land in A's DRAM tier) and puts them
with 2 replicas: one other node reserves inbox rows, A writes its leased
slots into them through the transfer engine, the holder checks every
block's bytes against A's checksum and publishes them. Both copies are
then in gossip's block index, as A's view shows within a gossip round, and
byte for byte the same. Lowering the count to 1 drops one copy (never A's,
never the last). A block whose bytes do not match the checksum stated for
it is refused and appears nowhere.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
import torch

import mooncaked.wire.replicator as replicator_module
from mooncaked.cache.hashing import block_hashes
from mooncaked.client import AsyncStoreClient
from mooncaked.cluster.replicas import holders
from mooncaked.daemon import Node
from tests.conftest import wait_until
from tests.integration.clusters import ClusterFactory

BLOCK = 16
# One gossip round, and a little for the batch of block events to leave.
GOSSIP = {"cluster": {"gossip_interval_s": 0.2}}


def prompt(seed: int, num_blocks: int = 6) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (num_blocks * BLOCK + 1,), generator=g).tolist()
    ids[0] = 256 + seed % 100
    return ids


async def complete(node: Node, ids: list[int], **extra: Any) -> dict[str, Any]:
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, **extra}
    async with (
        aiohttp.ClientSession() as s,
        s.post(node.url + "/v1/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        return await r.json()


def full_blocks(node: Node, ids: list[int]) -> list[bytes]:
    engine = node.engine
    assert engine is not None
    return block_hashes(ids, BLOCK, engine.model_id)[: len(ids) // BLOCK]


async def in_dram(node: Node, hashes: list[bytes]) -> None:
    store = node.store
    assert store is not None
    await wait_until(lambda: all(store.dram.contains(h) for h in hashes), "blocks in DRAM")


def slot_bytes(node: Node, h: bytes) -> bytes:
    store = node.store
    assert store is not None
    slot = store.dram.get_slot(h)
    assert slot is not None
    return bytes(store.dram.slot(slot).numpy())


async def test_put_two_replicas_verified_then_lowered_to_one(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = await cluster_factory(["both", "both", "both"], **GOSSIP)
    a = cluster.nodes[0]
    ids = prompt(1)
    await complete(a, ids)
    hashes = full_blocks(a, ids)
    await in_dram(a, hashes)
    assert a.services.replicator is not None and a.cluster is not None

    report = await a.services.replicator.put(hashes, 2)
    assert report.holders_before == [1] * len(hashes)
    assert report.holders_after == [2] * len(hashes) and report.short == 0
    (target,) = report.nodes
    assert report.nodes[target].stored == len(hashes) and report.nodes[target].corrupt == 0
    b = next(n for n in cluster.nodes if n.node_id == target)
    # The copy is byte for byte A's, in B's DRAM tier.
    assert all(slot_bytes(b, h) == slot_bytes(a, h) for h in hashes)

    # Both copies in A's view of the cluster-wide index within a gossip round.
    view = a.cluster.view
    loop = asyncio.get_running_loop()
    published = loop.time()
    await wait_until(
        lambda: all(h_ == {a.node_id, target} for h_ in holders(view, hashes)),
        "both holders in A's view",
        timeout_s=5.0,
    )
    print(f"both holders in A's view {loop.time() - published:.3f} s after the put returned")

    # Lower to one: B's copy goes (A asked: its copy is kept last).
    lowered = await a.services.replicator.change(hashes, 1)
    assert lowered.holders_after == [1] * len(hashes)
    assert lowered.nodes[target].dropped == len(hashes)
    assert b.store is not None and not any(b.store.tiers_of(h) for h in hashes)
    assert a.store is not None and all(a.store.tiers_of(h) for h in hashes)
    await wait_until(
        lambda: all(h_ == {a.node_id} for h_ in holders(view, hashes)), "B's copy gone from view"
    )
    # Never the last copy.
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        await a.services.replicator.change(hashes, 0)
    # The same through the admin API, as a program would: put, then remove.
    async with AsyncStoreClient(a.url) as client:
        put = await client.kv.put(hashes=hashes, replicas=2)
        assert put.holders_after == [2] * len(hashes) and put.short == 0
        await wait_until(
            lambda: all(len(h_) == 2 for h_ in holders(view, hashes)), "two holders again"
        )
        found = await client.kv.exists(hashes=hashes)
        assert all(len(b.holders) == 2 and b.here == ["dram"] for b in found.blocks)
        removed = await client.kv.remove(hashes=hashes)
        assert sum(r.dropped for r in removed.nodes.values()) == 2 * len(hashes)
    assert not any(
        n.store is not None and n.store.tiers_of(h) for n in cluster.nodes for h in hashes
    )
    await wait_until(lambda: holders(view, hashes) == [set()] * len(hashes), "no holder left")
    for n in cluster.nodes:
        assert n.store is not None
        n.store.check_integrity()
        desk = n.services.desk
        assert desk is not None and desk.inbox is not None
        desk.inbox.check_integrity()


async def test_a_block_whose_bytes_do_not_match_is_refused_and_never_visible(
    cluster_factory: ClusterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = await cluster_factory(["both", "both"], **GOSSIP)
    a, b = cluster.nodes
    ids = prompt(2)
    await complete(a, ids)
    hashes = full_blocks(a, ids)
    await in_dram(a, hashes)
    bad = hashes[2]
    real_crc = replicator_module.data_crc

    def lying_crc(block_hash: bytes, data: Any) -> int:
        # The writer states a checksum its bytes do not have, for one block.
        crc = real_crc(block_hash, data)
        return crc ^ 1 if block_hash == bad else crc

    monkeypatch.setattr(replicator_module, "data_crc", lying_crc)
    assert a.services.replicator is not None and a.cluster is not None
    report = await a.services.replicator.put(hashes, 2)
    result = report.nodes[b.node_id]
    assert (result.stored, result.corrupt) == (len(hashes) - 1, 1)
    assert report.holders_after[2] == 1 and report.short == 1
    assert b.store is not None
    assert not b.store.dram.has(bad) and b.store.tiers_of(bad) == ()
    desk = b.services.desk
    assert desk is not None and desk.inbox is not None
    assert desk.inbox.stats().corrupt == 1
    # The others are in gossip; the refused one never is, on any node.
    view = a.cluster.view
    others = [h for h in hashes if h != bad]
    await wait_until(
        lambda: all(b.node_id in h_ for h_ in holders(view, others)), "B's copies in A's view"
    )
    assert holders(view, [bad]) == [{a.node_id}]
    assert b.cluster is not None
    b_view = b.cluster.view
    # B's view learns A's blocks by gossip too: once it shows A holding the
    # block, it must show no one else.
    await wait_until(lambda: holders(b_view, [bad]) != [set()], "A's copy in B's view")
    assert holders(b_view, [bad]) == [{a.node_id}]
    b.store.check_integrity()
    desk.inbox.check_integrity()
