"""The decode TBT of a compute node whose attention runs on a memory node."""

from __future__ import annotations

import math

import pytest

from mooncaked.cluster.costs import (
    AttentionTraffic,
    MemoryLink,
    NodeCosts,
    Offload,
    StepCost,
    decode_tbt_s,
    dense_step_s,
    offloaded_step,
    predicted_tbt_s,
)

# A 70B-like model: 80 layers, 64 query heads and 8 KV heads of 128, bf16.
TRAFFIC = AttentionTraffic(num_layers=80, qkv_bytes=(64 + 16) * 128 * 2, out_bytes=64 * 128 * 2)
KVB = 80 * 2 * 8 * 128 * 2
STEP = StepCost(base_s=0.0125, token_s=30e-6, pair_s=1e-9, seq_s=55e-6, ctx_s=KVB / 18e12)
COSTS = NodeCosts(step=STEP, kv_bytes_per_token=KVB, chunk_tokens=8192, max_batch=128)
LINK = MemoryLink(kv_read_bps=22e12, link_bps=400e9, rtt_s=20e-6, layer_s=10e-6)


def test_dense_step_is_the_fitted_step_without_its_context_term() -> None:
    assert dense_step_s(STEP, 10) == pytest.approx(STEP.decode_step_s(10, 0))
    assert dense_step_s(STEP, 0) == 0.0


def test_local_attention_is_the_local_tbt() -> None:
    assert decode_tbt_s(COSTS, 40, 400_000) == predicted_tbt_s(COSTS, 40, 400_000)


def test_a_memory_node_like_the_compute_node_and_a_free_link_give_the_local_step() -> None:
    # Reading KV at the bandwidth the compute node's ctx term stands for, with
    # nothing on the wire and no overlap, is the local step exactly.
    same = MemoryLink(kv_read_bps=KVB / STEP.ctx_s, link_bps=math.inf)
    s = offloaded_step(STEP, KVB, TRAFFIC, same, 40, 400_000, micro_batches=1)
    assert s.serial_s == pytest.approx(STEP.decode_step_s(40, 400_000))
    assert s.overlapped_s == s.serial_s


def test_serial_is_dense_plus_every_layers_remote_trip() -> None:
    s = offloaded_step(STEP, KVB, TRAFFIC, LINK, 100, 1_200_000)
    attn = LINK.layer_s + 1_200_000 * KVB / 80 / LINK.kv_read_bps
    trip = LINK.rtt_s + 100 * (TRAFFIC.qkv_bytes + TRAFFIC.out_bytes) / LINK.link_bps
    assert s.dense_s == pytest.approx(STEP.base_s + STEP.seq_s * 100)
    assert s.attention_s == pytest.approx(attn)
    assert s.round_trip_s == pytest.approx(trip)
    assert s.serial_s == pytest.approx(s.dense_s + 80 * (attn + trip))


@pytest.mark.parametrize("micro", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 2, 16, 100, 400])
def test_overlap_is_never_worse_than_the_serial_sum(micro: int, batch: int) -> None:
    for ctx in (1_000, 100_000, 1_000_000, 5_000_000):
        s = offloaded_step(STEP, KVB, TRAFFIC, LINK, batch, ctx, micro_batches=micro)
        assert s.tbt_s <= s.serial_s
        assert s.tbt_s == min(s.serial_s, s.overlapped_s)


def test_overlap_pays_where_remote_attention_is_as_long_as_the_dense_part() -> None:
    s = offloaded_step(STEP, KVB, TRAFFIC, LINK, 400, 4_800_000)
    assert s.overlaps
    assert s.overlapped_s < 0.8 * s.serial_s
    # A tiny batch over a short context: a second weight read costs more than it hides.
    small = offloaded_step(STEP, KVB, TRAFFIC, LINK, 2, 2_000)
    assert not small.overlaps
    assert small.tbt_s == small.serial_s


def test_tbt_grows_with_context_and_with_batch() -> None:
    off = Offload(TRAFFIC, LINK)
    by_ctx = [decode_tbt_s(COSTS, 64, c, off) for c in (0, 10_000, 100_000, 1_000_000, 4e6)]
    assert by_ctx == sorted(by_ctx)
    assert by_ctx[0] < by_ctx[-1]
    by_batch = [decode_tbt_s(COSTS, b, 500_000, off) for b in (1, 2, 8, 64, 256, 1024)]
    assert by_batch == sorted(by_batch)
    assert by_batch[0] < by_batch[-1]


def test_other_nodes_kv_on_the_memory_node_slows_the_attention() -> None:
    busy = MemoryLink(LINK.kv_read_bps, LINK.link_bps, LINK.rtt_s, LINK.layer_s, 200e9)
    mine = offloaded_step(STEP, KVB, TRAFFIC, LINK, 64, 500_000)
    shared = offloaded_step(STEP, KVB, TRAFFIC, busy, 64, 500_000)
    assert shared.attention_s > mine.attention_s
    assert shared.tbt_s > mine.tbt_s


def test_an_unknown_bandwidth_or_link_is_never_chosen() -> None:
    dead = MemoryLink(kv_read_bps=0.0, link_bps=400e9)
    assert offloaded_step(STEP, KVB, TRAFFIC, dead, 4, 1000).tbt_s == math.inf
    cut = MemoryLink(kv_read_bps=1e12, link_bps=0.0)
    assert offloaded_step(STEP, KVB, TRAFFIC, cut, 4, 1000).tbt_s == math.inf
