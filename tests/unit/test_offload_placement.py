"""Choosing a compute node and a memory node together (``offload.choose_pair``)."""

from __future__ import annotations

import math

import pytest

from mooncaked.cluster.costs import AttentionTraffic, NodeCosts, StepCost
from mooncaked.cluster.offload import ComputeNode, MemoryNode, choose_pair, link_between, pair_tbt

TRAFFIC = AttentionTraffic(num_layers=80, qkv_bytes=(64 + 16) * 128 * 2, out_bytes=64 * 128 * 2)
KVB = 80 * 2 * 8 * 128 * 2
COSTS = NodeCosts(
    step=StepCost(base_s=0.0125, token_s=30e-6, seq_s=55e-6, ctx_s=KVB / 18e12),
    kv_bytes_per_token=KVB,
    max_batch=1024,
)
GB = 1e9


def compute(node_id: str, batch: float = 0, ctx: float = 0) -> ComputeNode:
    return ComputeNode(node_id, COSTS, batch, ctx, nic_bps=400 * GB)


def memory(node_id: str, free: float = 600 * GB, resident: float = 0.0) -> MemoryNode:
    return MemoryNode(node_id, 22e12, free, resident, nic_bps=400 * GB, rtt_s=20e-6)


def test_the_least_loaded_pair_wins() -> None:
    got = choose_pair(
        [compute("c0", 200, 2.4e6), compute("c1", 20, 240_000)],
        [memory("m0", resident=500 * GB), memory("m1", resident=50 * GB)],
        TRAFFIC,
        12_000,
        400,
        0.1,
    )
    assert got is not None
    assert (got.compute, got.memory) == ("c1", "m1")
    expected = pair_tbt(compute("c1", 20, 240_000), memory("m1", resident=50 * GB), TRAFFIC, 12_200)
    assert got.tbt_s == pytest.approx(expected.tbt_s)


def test_a_memory_node_without_room_for_the_sequence_is_refused() -> None:
    need = (12_000 + 400) * KVB
    full = memory("m0", free=need - 1)
    assert choose_pair([compute("c0")], [full], TRAFFIC, 12_000, 400, 0.1) is None
    roomy = memory("m1", free=need, resident=400 * GB)
    got = choose_pair([compute("c0")], [full, roomy], TRAFFIC, 12_000, 400, 0.1)
    assert got is not None and got.memory == "m1"


def test_no_pair_within_the_slo_is_none() -> None:
    busy = [compute("c0", 900, 10e6)]
    assert choose_pair(busy, [memory("m0")], TRAFFIC, 12_000, 400, 0.05) is None
    # Without an SLO the same pair is taken.
    assert choose_pair(busy, [memory("m0")], TRAFFIC, 12_000, 400, 0.0) is not None


def test_no_memory_node_is_no_choice() -> None:
    assert choose_pair([compute("c0")], [], TRAFFIC, 100, 10, 0.1) is None


def test_a_full_batch_is_skipped() -> None:
    full = ComputeNode("c0", COSTS, COSTS.max_batch, 1000, nic_bps=400 * GB)
    got = choose_pair([full, compute("c1", 500, 6e6)], [memory("m0")], TRAFFIC, 100, 10, 0.0)
    assert got is not None and got.compute == "c1"


def test_ties_go_to_the_memory_node_with_more_room() -> None:
    got = choose_pair(
        [compute("c0")],
        [memory("m0", free=100 * GB), memory("m1", free=300 * GB)],
        TRAFFIC,
        1000,
        10,
        0.1,
    )
    assert got is not None and got.memory == "m1"


def test_the_link_is_the_slower_nic_and_others_kv_is_what_is_not_mine() -> None:
    c = ComputeNode("c0", COSTS, 10, 100_000, nic_bps=100 * GB)
    m = MemoryNode("m0", 22e12, 1e12, 100_000 * KVB + 5 * GB, nic_bps=400 * GB)
    link = link_between(c, m)
    assert link.link_bps == 100 * GB
    assert link.other_bytes == pytest.approx(5 * GB)
    unknown = link_between(ComputeNode("c1", COSTS, 0, 0), MemoryNode("m1", 22e12, 1e12, 0))
    assert unknown.link_bps == math.inf
