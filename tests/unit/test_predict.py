"""Cost models: the fit recovers known coefficients, forecasts and the wire form."""

from __future__ import annotations

import random

import pytest

from mooncaked.cluster.costs import NodeCosts, StepCost, StepFeatures, prefill_pairs
from mooncaked.cluster.fit import (
    Calibration,
    LinkMeter,
    StepFitter,
    fit_nonnegative,
    fit_relative_l1,
)
from mooncaked.cluster.forecast import (
    DecodeForecast,
    DecodeWork,
    OutputLengths,
    PrefillWork,
    forecast_decode,
    predicted_queue_s,
)
from mooncaked.cluster.state import NodeLoad, NodeState
from mooncaked.cluster.wire import WireError, state_from_json, state_to_json

TRUE = StepCost(base_s=0.004, token_s=2e-4, pair_s=3e-8, seq_s=5e-4, ctx_s=2e-7)


def test_prefill_pairs_count_queries_times_keys() -> None:
    assert prefill_pairs(1, 0) == 1
    assert prefill_pairs(4, 0) == 1 + 2 + 3 + 4
    assert prefill_pairs(2, 10) == 11 + 12


def test_the_fit_recovers_the_coefficients_of_mixed_steps() -> None:
    rng = random.Random(1)
    fitter = StepFitter(refit_every=10**9)
    for _ in range(300):
        n = rng.choice([0, 0, rng.randrange(2, 2048)])
        start = rng.randrange(0, 2048)
        seqs = rng.randrange(0, 32)
        ctx = seqs * rng.randrange(1, 2048)
        f = StepFeatures(n, prefill_pairs(n, start) if n else 0, seqs, ctx)
        noise = 1.0 + rng.uniform(-0.02, 0.02)
        fitter.add(f, TRUE.step_s(f) * noise)
    got = fitter.refit()
    for want, have in zip(TRUE.coefficients(), got.coefficients(), strict=True):
        assert have == pytest.approx(want, rel=0.15)
    assert fitter.median_relative_error() < 0.02


def test_the_fit_never_goes_negative() -> None:
    # Time falls with tokens in these samples: a negative slope fits best,
    # but a cost cannot be negative.
    rows = [(1.0, float(n), 0.0, 0.0, 0.0) for n in (10, 20, 30)]
    coef = fit_nonnegative(rows, [0.3, 0.2, 0.1])
    assert all(c >= 0.0 for c in coef) and coef[1] == 0.0


def test_prefill_time_sums_the_chunks() -> None:
    one = TRUE.prefill_s(1000, 0)
    chunked = TRUE.prefill_s(1000, 0, chunk_tokens=256)
    by_hand = sum(
        TRUE.step_s(StepFeatures(k, prefill_pairs(k, pos), 0, 0))
        for pos, k in ((0, 256), (256, 256), (512, 256), (768, 232))
    )
    assert chunked == pytest.approx(by_hand)
    # Four step overheads instead of one; the same attention pairs.
    assert chunked == pytest.approx(one + 3 * TRUE.base_s)
    # A cached prefix makes the rest dearer (attention over it).
    assert TRUE.prefill_s(500, 500) > TRUE.prefill_s(500, 0)
    costs = NodeCosts(TRUE, 1000, 256, 64)
    work = [PrefillWork(1000, 0), PrefillWork(10, 100)]
    assert predicted_queue_s(costs, work) == pytest.approx(
        chunked + TRUE.prefill_s(10, 100, chunk_tokens=256)
    )
    assert predicted_queue_s(NodeCosts(), work) == 0.0


def test_output_lengths_condition_on_what_was_produced() -> None:
    lengths = OutputLengths(default_tokens=50)
    assert lengths.expected_more(0, 1000) == 50
    for n in (10, 10, 100, 100):
        lengths.add(n)
    assert lengths.expected_more(0, 1000) == pytest.approx(55)
    # Past 10 tokens only the long ones remain: 100 - 20.
    assert lengths.expected_more(20, 1000) == pytest.approx(80)
    assert lengths.expected_more(20, 30) == 30


def test_the_decode_forecast_drops_requests_as_they_are_expected_to_end() -> None:
    costs = NodeCosts(StepCost(base_s=0.01), 1000, 256, 64)
    lengths = OutputLengths()
    for _ in range(10):
        lengths.add(100)
    # Steps of 10 ms: with 10 tokens out, 90 to go (0.9 s); with 90 out, 10
    # to go (0.1 s); past every length seen, as long again as the mean (1 s)
    # unless capped by max_tokens (20 more: 0.2 s).
    work = [
        DecodeWork(500, 10, 1000),
        DecodeWork(500, 90, 1000),
        DecodeWork(500, 150, 1000),
        DecodeWork(500, 150, 20),
    ]
    fc = forecast_decode(costs, work, lengths)
    assert fc.batch[0] == 2  # at 0.5 s
    assert fc.batch[1] == 0  # at 1 s
    b, _ = fc.at(0.25, 4, 2000)
    assert 2.0 < b < 4.0


def test_link_meter_averages_and_ignores_small_transfers() -> None:
    links = LinkMeter(alpha=0.5, min_bytes=1000)
    links.add("a", 100, 0.001)
    assert links.links() == ()
    links.add("a", 10_000_000, 0.01)
    links.add("a", 10_000_000, 0.02)
    links.add("b", 10_000_000, 1.0)
    assert links.links() == (("a", 750_000_000.0), ("b", 10_000_000.0))
    costs = NodeCosts(links=links.links())
    assert costs.link_bps("b") == 10_000_000.0
    assert costs.link_bps("zzz") == 750_000_000.0  # the median of those measured


def _state(costs: NodeCosts) -> NodeState:
    return NodeState(
        "n", 1, 1, "h:1", "prefill", "m", "h:2", False, NodeLoad(), 0, 0, 0, costs=costs
    )


def test_costs_and_forecast_cross_the_wire_and_bad_ones_are_refused() -> None:
    costs = NodeCosts(TRUE, 1000, 256, 64, links=(("a", 1e9),))
    st = _state(costs)
    back = state_from_json(state_to_json(st))
    assert back.costs == costs and back.forecast == st.forecast
    for bad in (
        [-1.0, 0, 0, 0, 0, 1, 1, 1, []],
        [1e9, 0, 0, 0, 0, 1, 1, 1, []],
        [0, 0, 0, 0, 0, 1, 1, 1, [["a", 1.0]] * 9],
        [0, 0, 0, 0, 0, 1, 1, 1, [["", 1.0]]],
        [0, 0, 0, 0, 0],
    ):
        doc = state_to_json(st)
        doc["costs"] = bad
        with pytest.raises(WireError):
            state_from_json(doc)
    doc = state_to_json(st)
    doc["fc"] = [[1.0] * 6, [1.0] * 5]
    with pytest.raises(WireError):
        state_from_json(doc)


def test_the_forecast_counts_steady_arrivals_and_forgets_a_past_burst() -> None:
    costs = NodeCosts(StepCost(base_s=0.01), 1000, 256, 64)
    lengths = OutputLengths()
    for _ in range(10):
        lengths.add(100)
    # Runs of 100 steps of 10 ms: 1 s. Two a second join: at 0.5 s, one of
    # them is there; from 1 s on, two (those of the last second).
    fc = forecast_decode(costs, [], lengths, arrival_rate=2.0, arrival_context_tokens=100)
    assert fc.batch[:3] == (1.0, 2.0, 2.0)
    # A burst of 20 fresh requests with nobody arriving after it: gone in 1 s.
    burst = forecast_decode(costs, [DecodeWork(100, 0, 1000)] * 20, lengths)
    assert burst.batch[0] == 20 and burst.batch[1] == 0


def test_calibration_fits_a_line_and_keeps_the_model_in_play() -> None:
    cal = Calibration(min_samples=8)
    assert cal.apply(0.1) == 0.1  # the identity until enough pairs
    for p in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8):
        cal.add(p, 0.05 + 2.0 * p)
    assert cal.scale == pytest.approx(2.0, rel=1e-6)
    assert cal.offset_s == pytest.approx(0.05, abs=1e-6)
    flat = Calibration(min_samples=8)
    for p in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8):
        flat.add(p, 0.5)  # measured ignores the model
    # The scale stays at its floor; the offset is the median residual.
    assert flat.scale == 0.25
    assert flat.offset_s == pytest.approx(0.5 - 0.25 * 0.4)


def test_calibration_is_not_dragged_by_stalls_and_leaves_a_right_model_alone() -> None:
    rng = random.Random(3)
    # A fixed 60 ms of hops on top of the model, a few percent of noise, and
    # one request in ten stalled 5x: the line goes through the typical
    # requests, not toward the stalls (a least-squares line would).
    hops = Calibration(min_samples=8)
    for i in range(128):
        p = rng.uniform(0.05, 2.0)
        m = (0.06 + p) * rng.uniform(0.97, 1.03) * (5.0 if i % 10 == 0 else 1.0)
        hops.add(p, m)
    assert hops.offset_s == pytest.approx(0.06, abs=0.02)
    assert hops.scale == pytest.approx(1.0, abs=0.05)
    # A model that is right up to symmetric noise keeps its own forecasts.
    right = Calibration(min_samples=8)
    for _ in range(128):
        p = rng.uniform(0.05, 2.0)
        right.add(p, p * rng.uniform(0.7, 1.3))
    assert (right.offset_s, right.scale) == (0.0, 1.0)


def test_a_correction_the_newest_requests_do_not_bear_out_is_dropped() -> None:
    cal = Calibration(min_samples=8)
    ps = [0.1 + 0.01 * i for i in range(100)]
    for p in ps[:75]:
        cal.add(p, 2.0 * p)  # twice the model for a while...
    assert cal.scale == pytest.approx(2.0, rel=1e-3)
    for p in ps[75:]:
        cal.add(p, p)  # ...then the model is right again
    # Fitted on all 100 pairs the line still says about 2x; judged on the
    # newest quarter, which it was not fitted to, it is worse than the model.
    assert (cal.offset_s, cal.scale) == (0.0, 1.0)


def test_relative_l1_fit_bounds() -> None:
    pairs = [(p, 3.0 * p) for p in (0.1, 0.2, 0.4, 0.8)]
    assert fit_relative_l1(pairs) == pytest.approx((0.0, 3.0), abs=1e-6)
    # A bound scale: the offset is the median residual under it (0.1, 0.2,
    # 0.4, 0.8), weighed by 1 / measured: the first already holds over half.
    offset, scale = fit_relative_l1(pairs, max_scale=2.0)
    assert scale == 2.0 and offset == pytest.approx(0.1, abs=1e-9)
    with pytest.raises(ValueError):
        fit_relative_l1([])


def test_calibration_margin_is_the_target_quantile_of_measured_over_forecast() -> None:
    cal = Calibration(min_samples=8)
    assert cal.margin(0.95) == 1.0  # nothing measured yet
    # A right model, requests taking 0.8x to 1.3x of it in steps of 0.05.
    ratios = [0.8 + 0.05 * i for i in range(11)]
    for i in range(40):
        cal.add(1.0, ratios[i % len(ratios)])
    assert (cal.offset_s, cal.scale) == (0.0, 1.0)
    seen = sorted(ratios[i % 11] for i in range(40))
    # 95% of the 40 pairs: the 38th smallest ratio (1.3); half: the 20th (1.0).
    assert cal.margin(0.95) == pytest.approx(seen[37]) == pytest.approx(1.3)
    assert cal.margin(0.5) == pytest.approx(seen[19]) == pytest.approx(1.0)
    assert cal.margin(0.0) == 1.0


def test_calibration_margin_for_an_slo_judges_each_forecast_by_the_requests_forecast_near_it() -> (
    None
):
    cal = Calibration(min_samples=8)
    # A third of the requests forecast at 10 ms took 30 (short streams, a
    # step stalled by a prefill chunk), a tenth of all: a quantile of every
    # ratio says 3x. Those forecast at 80 ms took 0.9x to 1.1x of it. No line
    # fits both, so the correction stays the identity.
    near = [0.9, 0.95, 1.0, 1.05, 1.1]
    for i in range(60):
        if i % 10 == 0:
            cal.add(0.010, 0.030)
        elif i % 10 in (1, 2):
            cal.add(0.010, 0.010)
        else:
            cal.add(0.080, 0.080 * near[i % 5])
    assert (cal.offset_s, cal.scale) == (0.0, 1.0)
    assert cal.margin(0.95) == pytest.approx(3.0)
    # Against a 100 ms SLO: forecasts near 10 ms need 3x (30 ms: within it),
    # those near 80 ms need 1.1x: admitted is every forecast up to the first
    # one (of the grid) at which 1.1x passes 100 ms, just above 90 ms.
    limit = 0.100 / cal.margin(0.95, 0.100)
    assert 0.100 / 1.1 < limit < 0.100 / 1.1 * 1.15
    # Against a 25 ms SLO the 10 ms forecasts decide: 3x passes it from
    # 8.3 ms on, so the margin admits no more than that.
    limit = 0.025 / cal.margin(0.95, 0.025)
    assert 0.025 / 3.0 < limit < 0.025 / 3.0 * 1.15
    # Forecasts that ran long near the SLO: a margin below 1.
    fast = Calibration(min_samples=8)
    for i in range(20):
        if i % 2:
            fast.add(0.010, 0.010)
        else:
            fast.add(0.090, 0.060)
    assert fast.margin(0.95, 0.100) < 1.0


def test_handoffs_join_the_forecast_when_their_kv_is_expected_in() -> None:
    costs = NodeCosts(StepCost(base_s=0.01), 1000, 256, 64)
    lengths = OutputLengths()
    for _ in range(10):
        lengths.add(100)
    # Runs of 1 s. One request decoding now; one handoff expected in at
    # 1.5 s, so decoding over [1.5 s, 2.5 s): not counted before it starts.
    work = [DecodeWork(100, 0, 1000), DecodeWork(300, 0, 1000, starts_in_s=1.5)]
    fc = forecast_decode(costs, work, lengths)
    assert fc.batch[:4] == (1.0, 0.0, 1.0, 0.0)  # at 0.5, 1, 2 and 4 s
    # Its context at 2 s: its prompt and the 50 tokens of its first 0.5 s.
    assert fc.context_tokens[2] == 350.0
    # Unknown arrivals (two a second) only from the last known one on.
    fc = forecast_decode(costs, work, lengths, arrival_rate=2.0, arrival_context_tokens=100)
    assert fc.batch[:4] == (1.0, 0.0, 2.0, 2.0)


def test_the_forecast_averages_over_a_run() -> None:
    fc = DecodeForecast((4.0, 2.0, 0.0, 0.0, 0.0, 0.0), (400.0, 200.0, 0.0, 0.0, 0.0, 0.0))
    # Over [0.5 s, 1.5 s], linear between the horizons 0.5, 1 and 2 s: 4, 3,
    # 2, 1.5 and 1 at its five points.
    assert fc.mean_over(0.5, 1.0, 8, 800) == pytest.approx((2.3, 230.0))
    assert fc.mean_over(0.5, 0.0, 8, 800) == (4.0, 400.0)
