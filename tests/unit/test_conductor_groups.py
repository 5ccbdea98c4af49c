"""Pipelined prefill groups in ``conductor.decide``: which groups are candidates,
what their TTFT is, and when one beats a single prefill node."""

from __future__ import annotations

import random

import pytest

from mooncaked.cache.hashing import layer_hashes
from mooncaked.cluster.admission import Admission
from mooncaked.cluster.conductor import decide
from mooncaked.cluster.costs import NodeCosts, StepCost, equal_time_chunks, pipeline_prefill_s
from mooncaked.cluster.placement import Placement, PlacementRequest
from mooncaked.cluster.slo import Slo
from mooncaked.cluster.state import ClusterView, MemberStatus, StageInfo
from tests.cluster_views import DRAM, EXACT, MODEL, h
from tests.cluster_views import add_node as add

# The whole model's steps, and a half's (two stages of equal layers).
WHOLE = StepCost(0.01, 1e-3, 1e-7)
HALF = StepCost(0.01, 5e-4, 5e-8)
CHUNK = 512


def info(index: int, n: int = 2, group: str = "g", lo: int | None = None) -> StageInfo:
    per = 30 // n
    start = index * per if lo is None else lo
    hi = 30 if index == n - 1 else (index + 1) * per
    return StageInfo(group, index, n, start, hi, 30, 1152, CHUNK)


def request(tokens: int) -> PlacementRequest:
    return PlacementRequest(MODEL, tuple(h(i) for i in range(tokens // 16)), tokens)


def cluster(*, single: bool = True, stages: int = 2) -> ClusterView:
    view = ClusterView("d", clock=lambda: 0.0)
    add(view, "d", "decode", costs=NodeCosts(WHOLE, chunk_tokens=1024, max_batch=64))
    if single:
        add(view, "p", "prefill", costs=NodeCosts(WHOLE, chunk_tokens=1024))
    step = StepCost(0.01, 1e-3 / stages, 1e-7 / stages)
    for i in range(stages):
        add(
            view,
            f"s{i}",
            "prefill",
            costs=NodeCosts(step, chunk_tokens=1024),
            stage=info(i, stages),
        )
    return view


def placed(view: ClusterView, tokens: int) -> Placement:
    p = decide(view, request(tokens), rng=random.Random(0), params=EXACT).result
    assert isinstance(p, Placement), p
    return p


def test_a_complete_group_is_one_candidate_and_its_stages_none_of_their_own() -> None:
    p = placed(cluster(single=False), 4096)
    assert [c.node_id for c in p.prefill] == ["s0"]
    assert [(s.node_id, s.layer_lo, s.layer_hi) for s in p.prefill[0].stages] == [
        ("s0", 0, 15),
        ("s1", 15, 30),
    ]
    # The group's stages pull what a peer holds of their layers.
    assert p.fetches(0)


@pytest.mark.parametrize(
    "breakage",
    ["dead", "draining", "duplicate", "gap", "missing", "rows"],
)
def test_a_group_missing_or_contradicting_a_stage_serves_nothing(breakage: str) -> None:
    view = cluster()
    if breakage == "dead":
        view.members["s1"].status = MemberStatus.DEAD
    elif breakage == "draining":
        add(view, "s1", "prefill", draining=True, stage=info(1))
    elif breakage == "duplicate":
        add(view, "s2", "prefill", stage=info(1))
    elif breakage == "rows":
        # Its input rows hold 4,096 tokens: an 8k prompt cannot go there.
        add(view, "s1", "prefill", stage=StageInfo("g", 1, 2, 15, 30, 30, 1152, CHUNK, 4096))
    elif breakage == "gap":
        add(view, "s1", "prefill", stage=StageInfo("g", 1, 2, 16, 30, 30, 1152, CHUNK))
    else:
        del view.members["s1"]
        del view.blocks["s1"]
    p = placed(view, 8192)
    assert [c.node_id for c in p.prefill] == ["p"]
    assert not p.prefill[0].stages


def test_a_long_prompt_goes_to_the_group_and_a_short_one_to_the_single_node() -> None:
    view = cluster()
    long_ = decide(view, request(8192), rng=random.Random(0), params=EXACT)
    assert isinstance(long_.result, Placement)
    assert [c.node_id for c in long_.result.prefill] == ["s0", "p"]
    group = long_.prefill[[s.node_id for s in long_.prefill].index("s0")]
    single = long_.prefill[[s.node_id for s in long_.prefill].index("p")]
    # The pipeline's time, as the head cuts the chunks.
    chunks = equal_time_chunks(HALF, 8192, 0, CHUNK, align=16)
    hops = [EXACT.fetch_rtt_s + k * 1152 / EXACT.default_link_bps for k in chunks]
    assert group.ttft_s == pytest.approx(pipeline_prefill_s([HALF, HALF], chunks, 0, hop_s=hops))
    assert single.ttft_s == pytest.approx(WHOLE.prefill_s(8192, chunk_tokens=1024))
    assert single.ttft_s / group.ttft_s > 1.7
    doc = group.to_json()
    assert doc["stages"] == ["s0", "s1"] and doc["num_chunks"] == len(chunks)
    assert doc["fill_s"] > 0 and doc["hop_s"] > 0 and len(doc["stage_s"]) == 2
    assert "stages" not in single.to_json()
    # 32 tokens: one chunk through two stages and a hop costs more than one node.
    short = placed(view, 32)
    assert [c.node_id for c in short.prefill] == ["p", "s0"]


def test_a_group_holds_the_prefix_its_stages_all_hold_of_their_layers() -> None:
    view = cluster(single=False)
    hashes = [h(i) for i in range(256)]
    # s0 holds 200 blocks of its layers, s1 only 120 of its own.
    view.blocks["s0"].masks.update({k: DRAM for k in layer_hashes(hashes[:200], 0, 15)})
    view.blocks["s1"].masks.update({k: DRAM for k in layer_hashes(hashes[:120], 15, 30)})
    d = decide(view, request(4096), rng=random.Random(0), params=EXACT)
    (score,) = d.prefill
    assert score.local_blocks == 120 and score.new_tokens == 4096 - 120 * 16


def test_an_unfitted_stage_is_priced_by_another_s_model_by_layer_share() -> None:
    view = cluster(single=False, stages=3)
    add(view, "s2", "prefill", stage=info(2, 3))  # costs unknown yet
    d = decide(view, request(4096), rng=random.Random(0), params=EXACT)
    (score,) = d.prefill
    assert score.costs_known and len(score.stage_s) == 3
    # Stage 2 holds 10 layers as stage 0 does: the same compute.
    assert score.stage_s[2] == pytest.approx(score.stage_s[0])


def test_an_entry_counts_what_it_placed_on_each_stage() -> None:
    view = cluster(single=False)
    adm = Admission(EXACT, Slo(0.0, 0.0), rng=random.Random(0), target=0.9, now=0.0)
    d = adm.place(view, request(4096), 0.0)
    assert isinstance(d.result, Placement)
    pending = adm.ledger.pending(view, 0.0)
    (score,) = d.prefill
    assert pending["s0"].prefill_s == pytest.approx(score.stage_s[0])
    assert pending["s1"].prefill_s == pytest.approx(score.stage_s[1])
    assert pending["d"].decodes == 1
