"""The Conductor with cost models: every branch of ``decide`` on constructed views.

Costs are round numbers so each expected TTFT is computable by hand: a step
costs 10 ms + 1 ms per prefill token + 1 ms per decode sequence (+ 1 us per
context token), KV is 1,000 bytes a token, blocks are 16 tokens.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from mooncaked.cluster.admission import PendingLedger
from mooncaked.cluster.conductor import Decision, decide
from mooncaked.cluster.costs import NodeCosts, StepCost
from mooncaked.cluster.forecast import DecodeForecast
from mooncaked.cluster.placement import (
    EarlyReject,
    PendingLoad,
    Placement,
    PlacementRequest,
    Policy,
    Reject,
)
from mooncaked.cluster.slo import Slo
from mooncaked.cluster.state import ClusterView, NodeLoad, NodeState
from tests.cluster_views import EXACT, MODEL, add_node, exact, h

COSTS = NodeCosts(
    step=StepCost(base_s=0.010, token_s=1e-3, pair_s=0.0, seq_s=1e-3, ctx_s=1e-6),
    kv_bytes_per_token=1000,
    chunk_tokens=4096,
    max_batch=64,
)


def add(view: ClusterView, node_id: str, role: str, **fields: Any) -> None:
    """``add_node`` with the round costs of the module docstring unless told otherwise."""
    add_node(view, node_id, role, **{"costs": COSTS, **fields})


def request(blocks: int = 64, max_tokens: int = 100, slo: Slo | None = None) -> PlacementRequest:
    # One token past the last full block: every full block is usable.
    return PlacementRequest(
        MODEL, tuple(h(i) for i in range(blocks)), blocks * 16 + 1, max_tokens, 100.0, slo
    )


def placed(d: object) -> Placement:
    assert isinstance(d, Placement), d
    return d


def test_local_hit_wins_when_fetching_would_only_add_a_round_trip() -> None:
    view = ClusterView("p1", clock=lambda: 0.0)
    add(view, "p1", "prefill", cached=32)
    add(view, "p2", "prefill")
    add(view, "d1", "decode")
    dec = decide(view, request(), rng=random.Random(0), params=EXACT)
    p = placed(dec.result)
    assert p.prefill[0].node_id == "p1" and not p.fetch
    # 10 ms + 513 tokens.
    assert p.predicted_ttft_s == pytest.approx(0.010 + 0.513)
    s2 = next(s for s in dec.prefill if s.node_id == "p2")
    # p2 would fetch p1's 32 blocks: 5 ms + 512 KB at 1 GB/s, then compute 513.
    assert s2.fetch and s2.ttft_s == pytest.approx(0.005 + 0.000512 + 0.010 + 0.513)


def test_remote_hit_worth_fetching() -> None:
    # A decode node's DRAM holds 48 blocks; no prefill node holds any.
    view = ClusterView("p1", clock=lambda: 0.0)
    add(view, "p1", "prefill")
    add(view, "p2", "prefill", load=NodeLoad(predicted_queue_s=0.1, queued_prefill_tokens=90))
    add(view, "d1", "decode", cached=48)
    dec = decide(view, request(), rng=random.Random(0), params=EXACT)
    p = placed(dec.result)
    assert p.prefill[0].node_id == "p1" and p.fetch
    best = dec.prefill[0] if dec.prefill[0].node_id == "p1" else dec.prefill[1]
    assert best.holder == "d1" and best.remote_blocks == 48
    # max(queue 0, 5 ms + 768 KB / 1 GB/s) + 10 ms + 257 tokens.
    assert p.predicted_ttft_s == pytest.approx(0.005 + 0.000768 + 0.010 + 0.257)
    # The same view under local_cache: nobody fetches, recompute on the idle node.
    lc = placed(
        decide(
            view, request(), rng=random.Random(0), params=exact(policy=Policy.LOCAL_CACHE)
        ).result
    )
    assert lc.prefill[0].node_id == "p1" and not lc.fetch
    assert lc.predicted_ttft_s == pytest.approx(0.010 + 1.025)


def test_remote_hit_not_worth_fetching_over_a_slow_link_or_below_the_threshold() -> None:
    slow = NodeCosts(COSTS.step, COSTS.kv_bytes_per_token, 4096, 64, links=(("d1", 1e5),))
    view = ClusterView("p1", clock=lambda: 0.0)
    add(view, "p1", "prefill", costs=slow)
    add(view, "d1", "decode", cached=48)
    dec = decide(view, request(), rng=random.Random(0), params=EXACT)
    p = placed(dec.result)
    # 768 KB at 100 KB/s is 7.7 s: recomputing 1,025 tokens (1.035 s) wins.
    assert not p.fetch and p.predicted_ttft_s == pytest.approx(1.035)
    assert dec.prefill[0].note == "recompute faster"
    # Remote 44 blocks vs 40 local: under balancing_threshold 1.2, no fetch considered.
    view2 = ClusterView("p1", clock=lambda: 0.0)
    add(view2, "p1", "prefill", cached=40)
    add(view2, "d1", "decode", cached=44)
    dec2 = decide(view2, request(), rng=random.Random(0), params=EXACT)
    assert not placed(dec2.result).fetch and dec2.prefill[0].transfer_s == 0.0
    # With the threshold at 1.0 the 4 extra blocks are worth a fetch (64 ms
    # of compute against a 5 ms round trip).
    dec3 = decide(view2, request(), rng=random.Random(0), params=exact(balancing_threshold=1.0))
    assert placed(dec3.result).fetch


def test_a_busy_holder_makes_an_idle_node_replicate_its_prefix() -> None:
    view = ClusterView("p2", clock=lambda: 0.0)
    busy = NodeLoad(queued_prefill_tokens=3000, predicted_queue_s=3.0)
    add(view, "p1", "prefill", cached=48, load=busy)
    add(view, "p2", "prefill")
    add(view, "d1", "decode")
    dec = decide(view, request(), rng=random.Random(0), params=EXACT)
    p = placed(dec.result)
    assert p.prefill[0].node_id == "p2" and p.fetch
    s = next(s for s in dec.prefill if s.node_id == "p2")
    assert s.holder == "p1" and s.note == "replicates a busy holder's prefix"
    # When the holder is idle, it serves the prefix itself: no replication.
    view_idle = ClusterView("p2", clock=lambda: 0.0)
    add(view_idle, "p1", "prefill", cached=48)
    add(view_idle, "p2", "prefill")
    add(view_idle, "d1", "decode")
    assert (
        placed(decide(view_idle, request(), rng=random.Random(0), params=EXACT).result)
        .prefill[0]
        .node_id
        == "p1"
    )


def test_copies_are_capped_per_prefix() -> None:
    view = ClusterView("p4", clock=lambda: 0.0)
    busy = NodeLoad(queued_prefill_tokens=3000, predicted_queue_s=3.0)
    for i in (1, 2, 3):
        add(view, f"p{i}", "prefill", cached=48, load=busy)
    add(view, "p4", "prefill")
    add(view, "d1", "decode")
    dec = decide(view, request(), rng=random.Random(0), params=exact(max_replicas=3))
    p = placed(dec.result)
    # Three copies exist: p4 may not become a fourth; it recomputes (1.035 s
    # beats a holder's 3 s queue).
    assert p.prefill[0].node_id == "p4" and not p.fetch
    assert next(s for s in dec.prefill if s.node_id == "p4").note == "3 copies already"
    # One more replica allowed: p4 fetches.
    assert placed(
        decide(view, request(), rng=random.Random(0), params=exact(max_replicas=4)).result
    ).fetch


def test_reject_when_the_best_ttft_misses_the_slo() -> None:
    view = ClusterView("p1", clock=lambda: 0.0)
    q = NodeLoad(queued_prefill_tokens=2000, predicted_queue_s=2.0)
    add(view, "p1", "prefill", load=q)
    add(view, "p2", "prefill", load=q)
    add(view, "d1", "decode")
    r = decide(view, request(), rng=random.Random(0), params=EXACT, slo=Slo(ttft_s=1.0)).result
    assert isinstance(r, Reject) and r.status == 429 and r.code == "ttft_slo"
    assert "3.04 s exceeds the SLO of 1.00 s" in r.reason
    assert r.retry_after_s == 3.0  # ceil(3.035 - 1.0)
    # The request's own SLO wins over the node's; early rejection off admits.
    assert isinstance(
        decide(view, request(slo=Slo(ttft_s=5.0)), rng=random.Random(0), slo=Slo(1.0)).result,
        Placement,
    )
    off = exact(early_reject=EarlyReject.OFF)
    assert isinstance(
        decide(view, request(), rng=random.Random(0), slo=Slo(1.0), params=off).result, Placement
    )


def test_admission_allows_for_the_margin_recent_requests_needed() -> None:
    # The forecast, 3.035 s, meets a 3.5 s SLO; with a margin of 1.2 (the
    # ratio measured / forecast a target share of recent requests stayed
    # within) it does not: 3.64 s.
    view = ClusterView("p1", clock=lambda: 0.0)
    q = NodeLoad(queued_prefill_tokens=2000, predicted_queue_s=2.0)
    add(view, "p1", "prefill", load=q)
    add(view, "d1", "decode")
    assert isinstance(
        decide(view, request(), rng=random.Random(0), params=EXACT, slo=Slo(ttft_s=3.5)).result,
        Placement,
    )
    r = decide(
        view, request(), rng=random.Random(0), slo=Slo(ttft_s=3.5), params=exact(ttft_margin=1.2)
    ).result
    assert isinstance(r, Reject) and r.code == "ttft_slo"
    assert "3.04 s, 1.20x with the margin" in r.reason and r.retry_after_s == 1.0
    # A margin below 1 (forecasts that ran long) admits what the forecast alone would not.
    low = exact(ttft_margin=0.8)
    assert isinstance(
        decide(view, request(), rng=random.Random(0), slo=Slo(ttft_s=3.0), params=low).result,
        Placement,
    )
    # The TBT side likewise: 10 ms + 41 x 1 ms at batch 40 is within 60 ms, not x 1.3.
    add(view, "d1", "decode", load=NodeLoad(running_decode_batch=40, pending_decode=40))
    cur = EarlyReject.CURRENT
    ok = decide(
        view, request(), rng=random.Random(0), slo=Slo(tbt_s=0.060), params=exact(early_reject=cur)
    )
    assert isinstance(ok.result, Placement)
    tight = exact(early_reject=cur, tbt_margin=1.3)
    r = decide(view, request(), rng=random.Random(0), slo=Slo(tbt_s=0.060), params=tight).result
    assert isinstance(r, Reject) and r.code == "tbt_slo"
    assert "1.30x with the margin" in r.reason and "on d1 at batch 40" in r.reason


def test_costs_not_measured_never_reject() -> None:
    view = ClusterView("p1", clock=lambda: 0.0)
    add(view, "p1", "prefill", costs=NodeCosts(), load=NodeLoad(queued_prefill_tokens=10**6))
    add(view, "d1", "decode", costs=NodeCosts(), load=NodeLoad(running_decode_batch=60))
    p = placed(
        decide(view, request(), rng=random.Random(0), params=EXACT, slo=Slo(0.001, 0.001)).result
    )
    assert p.predicted_ttft_s == 0.0 and p.predicted_tbt_s == 0.0


def test_no_decode_node_within_the_tbt_slo() -> None:
    view = ClusterView("p1", clock=lambda: 0.0)
    add(view, "p1", "prefill")
    # Batch 40: a step is 10 + 41 ms (+ context) with this request: over 50 ms.
    add(view, "d1", "decode", load=NodeLoad(running_decode_batch=40, pending_decode=40))
    add(view, "d2", "decode", load=NodeLoad(running_decode_batch=45, pending_decode=45))
    r = decide(
        view,
        request(),
        rng=random.Random(0),
        slo=Slo(tbt_s=0.050),
        params=exact(early_reject=EarlyReject.CURRENT),
    ).result
    assert isinstance(r, Reject) and r.code == "tbt_slo" and r.status == 429
    # The message gives the best node's forecast, the one closest to the SLO.
    assert "(current load; predicted 52.1 ms on d1 at batch 40)" in r.reason, r.reason
    # With a looser SLO the least loaded decode node takes it.
    p = placed(
        decide(view, request(), rng=random.Random(0), params=EXACT, slo=Slo(tbt_s=0.2)).result
    )
    assert p.decode.node_id == "d1"
    assert p.predicted_tbt_s == pytest.approx(0.010 + 41e-3 + (1025 + 50) * 1e-6)


def _behind_a_queue(running: int, forecast: DecodeForecast) -> ClusterView:
    """A prefill node a second of queue behind, and a decode node with
    ``running`` of the 40 requests it holds KV for (40,000 tokens) decoding."""
    view = ClusterView("p1", clock=lambda: 0.0)
    add(view, "p1", "prefill", load=NodeLoad(queued_prefill_tokens=1000, predicted_queue_s=1.0))
    load = NodeLoad(running_decode_batch=running, pending_decode=40, decode_context_tokens=40000)
    add(view, "d1", "decode", load=load, forecast=forecast)
    return view


def _judged(view: ClusterView, early_reject: EarlyReject) -> Decision:
    """``decide`` against a TBT SLO of 30 ms, judging the decode load as told."""
    params = exact(early_reject=early_reject)
    return decide(view, request(), rng=random.Random(0), slo=Slo(tbt_s=0.030), params=params)


def test_early_rejection_judges_the_load_when_the_prefill_ends() -> None:
    # 40 decoding now, but the node forecasts 2 left in a second, 1 in two.
    fc = DecodeForecast((20.0, 2.0, 1.0, 0.0, 0.0, 0.0), (2e4, 2e3, 1e3, 0.0, 0.0, 0.0))
    view = _behind_a_queue(40, fc)
    now = _judged(view, EarlyReject.CURRENT)
    assert isinstance(now.result, Reject) and now.result.code == "tbt_slo"
    later = _judged(view, EarlyReject.PREDICTED)
    p = placed(later.result)
    # The prefill ends in ~2 s (1 s queue + 1.035 s): about one request left.
    assert later.decode[0].batch_at_join < 2.0
    assert p.predicted_tbt_s < 0.030


def test_current_load_is_blind_to_handoffs_and_the_forecast_is_not() -> None:
    # 2 decoding now, 38 handoffs whose prefills end within the second: the
    # forecast has all 40 decoding from 1 s on.
    view = _behind_a_queue(2, DecodeForecast((2.0, *[40.0] * 5), (2e3, *[4e4] * 5)))
    # The load now: a batch of 2 and its 2,000 tokens of context (a 40th of
    # the 40,000 that the handoffs hold too), well within 30 ms.
    now = _judged(view, EarlyReject.CURRENT)
    assert now.decode[0].batch_at_join == 2.0
    assert placed(now.result).predicted_tbt_s == pytest.approx(
        0.010 + 3e-3 + (2000 + 1025 + 50) * 1e-6
    )
    # At the load forecast over its run: 40 others at every step.
    later = _judged(view, EarlyReject.PREDICTED)
    assert isinstance(later.result, Reject) and later.result.code == "tbt_slo"
    assert later.decode[0].batch_at_join == 40.0


def test_the_ledger_spreads_a_burst_until_gossip_catches_up() -> None:
    view = ClusterView("p1", clock=lambda: 0.0)
    for i in (1, 2, 3):
        add(view, f"p{i}", "prefill")
    add(view, "d1", "decode")
    ledger = PendingLedger(min_age_s=0.3, max_age_s=3.0)
    chosen = []
    for _ in range(3):
        dec = decide(
            view, request(), rng=random.Random(0), params=EXACT, pending=ledger.pending(view, 0.0)
        )
        p = placed(dec.result)
        first = p.prefill[0].node_id
        chosen.append(first)
        score = next(s for s in dec.prefill if s.node_id == first)
        ledger.add(view, first, PendingLoad(score.prefill_s, score.new_tokens, 0), 0.0)
    assert sorted(chosen) == ["p1", "p2", "p3"]
    # Gossip shows p1's new state after 0.5 s: its pending entry goes.
    view.members["p1"].state = NodeState(**{**_fields(view.members["p1"].state), "version": 2})
    assert set(ledger.pending(view, 0.5)) == {"p2", "p3"}
    assert ledger.pending(view, 3.0) == {}


def _fields(st: object) -> dict[str, object]:
    return {f: getattr(st, f) for f in st.__slots__}  # type: ignore[attr-defined]


def test_policies_differ_as_documented() -> None:
    view = ClusterView("p1", clock=lambda: 0.0)
    queued = NodeLoad(queued_prefill_tokens=300, predicted_queue_s=0.3)
    add(view, "p1", "prefill", cached=60, load=queued)
    add(view, "p2", "prefill", load=NodeLoad(queued_prefill_tokens=100, predicted_queue_s=0.1))
    add(view, "d1", "decode", load=NodeLoad(running_decode_batch=3, pending_decode=3))
    add(view, "d2", "decode", load=NodeLoad(running_decode_batch=1, pending_decode=1))

    def first(policy: Policy, seed: int = 0) -> tuple[str, str]:
        p = placed(
            decide(view, request(), params=exact(policy=policy), rng=random.Random(seed)).result
        )
        return p.prefill[0].node_id, p.decode.node_id

    # Shortest queue, cache ignored.
    assert first(Policy.LOAD_BALANCE) == ("p2", "d2")
    # p1: 0.3 + 0.010 + 0.065 beats p2: 0.1 + 1.035.
    assert first(Policy.LOCAL_CACHE) == ("p1", "d2")
    # p2 fetches p1's 60 blocks while its own 0.1 s queue drains:
    # 0.1 + 0.010 + 0.065, and p1 (busy) is spared.
    assert first(Policy.CONDUCTOR) == ("p2", "d2")
    seen = {first(Policy.RANDOM, seed) for seed in range(20)}
    assert len(seen) > 1


def test_decision_explains_itself() -> None:
    view = ClusterView("p1", clock=lambda: 0.0)
    add(view, "p1", "prefill")
    add(view, "d1", "decode", cached=48)
    doc = decide(view, request(), rng=random.Random(0), params=EXACT).to_json()
    assert doc["placement"]["fetch"] is True
    assert "fetching 48 blocks from d1" in str(doc["why"])
    [cand] = doc["prefill_candidates"]
    assert cand["holder"] == "d1" and cand["ttft_s"] > cand["prefill_s"] > 0
