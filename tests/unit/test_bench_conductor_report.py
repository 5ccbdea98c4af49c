"""tools/bench_conductor.py's figures from a result of known requests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import load_tool

bc = load_tool("bench_conductor")


def rec(start: float, chunks: list[float], **kw: Any) -> dict[str, Any]:
    return {"start_s": start, "chunk_s": chunks, "end_s": chunks[-1] if chunks else None, **kw}


def test_summary_counts_slo_attainment_over_all_sent_and_goodput() -> None:
    result = {
        "requests": [
            # TTFT 0.5 s, gaps of 50 ms: meets 1 s / 100 ms.
            rec(0.0, [0.5, 0.55, 0.60, 0.65], predicted_ttft_ms=400.0, predicted_tbt_ms=50.0),
            # TTFT 2 s: misses.
            rec(0.0, [2.0, 2.05, 2.10], predicted_ttft_ms=1000.0, predicted_tbt_ms=25.0),
            # Rejected.
            {"start_s": 0.1, "chunk_s": [], "end_s": None, "error_kind": "rejected"},
            # Meets; ends last, at 4 s.
            rec(3.0, [3.2, 3.3, 3.4, 4.0]),
        ]
    }
    s = bc.summarize(result, slo_ttft_ms=1000.0, slo_tbt_ms=100.0)
    # The last one's gaps: 100, 100, 600 ms -> mean 266 ms: misses TBT.
    assert (s["sent"], s["completed"], s["rejected"], s["errors"]) == (4, 3, 1, 0)
    assert s["slo_attainment"] == pytest.approx(1 / 4)
    assert s["admitted_meeting_slo"] == pytest.approx(1 / 3)
    assert s["goodput_rps"] == pytest.approx(1 / 4.0)
    assert s["mean_ttft_ms"] == pytest.approx((500 + 2000 + 200) / 3)
    acc = bc.accuracy(result)
    # |400-500|/500 = 0.2 and |1000-2000|/2000 = 0.5: median 0.35.
    assert acc["ttft_samples"] == 2 and acc["ttft_median_rel_error"] == pytest.approx(0.35)
    assert acc["ttft_median_ratio"] == pytest.approx((0.8 + 0.5) / 2)
    # TBT: 50 vs 50 (0) and 25 vs 50 (0.5).
    assert acc["tbt_median_rel_error"] == pytest.approx(0.25)


def test_rejections_are_counted_by_the_code_of_each_429() -> None:
    rejected = {"start_s": 0.0, "chunk_s": [], "end_s": 0.01, "error_kind": "rejected"}
    result = {
        "requests": [
            {**rejected, "error_code": "ttft_slo"},
            {**rejected, "error_code": "ttft_slo"},
            {**rejected, "error_code": "tbt_slo"},
            {**rejected, "error_code": "queue_full"},
            {**rejected, "error_code": "ttft_slo", "warmup": True},  # not timed
            rec(0.0, [0.5, 0.6]),
        ]
    }
    assert bc._rejections(result) == {"ttft_slo": 2, "tbt_slo": 1, "queue_full": 1}


def test_pin_gives_each_pool_cores_of_its_own() -> None:
    # Two cores: both prefill daemons on the first, the decode daemon alone on the second.
    assert bc.pool_cpus(2, 1, [0, 1]) == ["0", "0", "1"]
    assert bc.pool_cpus(1, 1, [4, 7]) == ["4", "7"]
    # Sixteen: split by the pools' sizes, each daemon its own share.
    assert bc.pool_cpus(2, 2, list(range(16))) == ["0,1,2,3", "4,5,6,7", "8,9,10,11", "12,13,14,15"]
    with pytest.raises(ValueError, match="two CPUs"):
        bc.pool_cpus(1, 1, [0])
