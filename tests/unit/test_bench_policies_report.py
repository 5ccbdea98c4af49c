"""``mooncakectl bench policies``' figures from a result of known requests."""

from __future__ import annotations

import io
from typing import Any

import pytest

from mooncakectl.bench.metrics import RequestRecord, meets_slo
from mooncakectl.bench.policies import entries_runs
from mooncakectl.bench.policies_report import (
    accuracy,
    print_entries_table,
    rejections,
    run_row,
    split,
)
from mooncakectl.bench.replay import entry_nodes
from mooncakectl.cli import run
from mooncakectl.local.plan import pool_cpus
from mooncakectl.registry import Env


def rec(start: float, chunks: list[float], **kw: Any) -> dict[str, Any]:
    """A request as the bench's result JSON records it."""
    end = chunks[-1] if chunks else None
    return {"index": 0, "start_s": start, "chunk_s": chunks, "end_s": end, **kw}


def test_summary_counts_slo_attainment_over_all_sent_and_goodput() -> None:
    result = {
        "requests": [
            # TTFT 0.5 s, gaps of 50 ms: meets 1 s / 100 ms.
            rec(0.0, [0.5, 0.55, 0.60, 0.65], predicted_ttft_ms=400.0, predicted_tbt_ms=50.0),
            # TTFT 2 s: misses.
            rec(0.0, [2.0, 2.05, 2.10], predicted_ttft_ms=1000.0, predicted_tbt_ms=25.0),
            # Rejected.
            rec(0.1, [], error_kind="rejected"),
            # Meets; ends last, at 4 s.
            rec(3.0, [3.2, 3.3, 3.4, 4.0]),
        ]
    }
    s = run_row(result, slo_ttft_ms=1000.0, slo_tbt_ms=100.0)
    # The last one's gaps: 100, 100, 600 ms -> mean 266 ms: misses TBT.
    assert (s["num_requests"], s["completed"], s["rejected"], s["failed"]) == (4, 3, 1, 0)
    assert s["slo_attainment"] == pytest.approx(1 / 4)
    assert s["admitted_slo_attainment"] == pytest.approx(1 / 3)
    assert s["request_goodput"] == pytest.approx(1 / 4.0)
    assert s["mean_ttft_ms"] == pytest.approx((500 + 2000 + 200) / 3)
    acc = accuracy(result)
    # |400-500|/500 = 0.2 and |1000-2000|/2000 = 0.5: median 0.35.
    assert acc["ttft_samples"] == 2 and acc["ttft_median_rel_error"] == pytest.approx(0.35)
    assert acc["ttft_median_ratio"] == pytest.approx((0.8 + 0.5) / 2)
    # TBT: 50 vs 50 (0) and 25 vs 50 (0.5).
    assert acc["tbt_median_rel_error"] == pytest.approx(0.25)


def test_rejections_are_counted_by_the_code_of_each_429() -> None:
    rejected = {**rec(0.0, []), "end_s": 0.01, "error_kind": "rejected"}
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
    assert rejections(result) == {"ttft_slo": 2, "tbt_slo": 1, "queue_full": 1}


def test_pin_gives_each_pool_cores_of_its_own() -> None:
    # Two cores: both prefill daemons on the first, the decode daemon alone on the second.
    assert pool_cpus(2, 1, [0, 1]) == ["0", "0", "1"]
    assert pool_cpus(1, 1, [4, 7]) == ["4", "7"]
    # Sixteen: split by the pools' sizes, each daemon its own share.
    assert pool_cpus(2, 2, list(range(16))) == ["0,1,2,3", "4,5,6,7", "8,9,10,11", "12,13,14,15"]
    with pytest.raises(ValueError, match="two CPUs"):
        pool_cpus(1, 1, [0])


def test_slo_and_tbt_are_judged_as_slo_py_defines_them() -> None:
    # Two tokens, one gap of 300 ms: a TBT of 300 ms (slo.tbt_s), which
    # misses 100 ms even if the entry would not calibrate on one gap.
    two = rec(0.0, [0.2, 0.5])
    # One token: no gap, no TBT; meets the TBT target.
    one = rec(0.0, [0.3])
    # Nine gaps of 10 ms and one of 150: the slowest tenth is the 150 ms one.
    stall = rec(0.0, [0.1 + 0.01 * i for i in range(10)] + [0.34])
    slo_ms = {"ttft": 1000.0, "tbt": 100.0}
    records = [RequestRecord.from_json(r) for r in (two, one, stall)]
    assert records[0].tbt == pytest.approx(0.3)
    assert records[1].tbt is None
    assert records[2].tbt == pytest.approx(0.15)
    assert [meets_slo(r, slo_ms) for r in records] == [False, True, False]
    row = run_row({"requests": [two, one, stall]}, 1000.0, 100.0)
    assert row["admitted_slo_attainment"] == pytest.approx(1 / 3)
    # The forecasts are checked only against TBTs over MIN_TBT_GAPS gaps or more.
    acc = accuracy(
        {"requests": [{**two, "predicted_tbt_ms": 10.0}, {**stall, "predicted_tbt_ms": 150.0}]}
    )
    assert acc["tbt_samples"] == 1 and acc["tbt_median_rel_error"] == pytest.approx(0.0)


def test_decode_split_counts_requests_per_decode_node() -> None:
    result = {
        "requests": [
            rec(0.0, [0.1, 0.2], decode_node="c-1e-t1-d0"),
            rec(0.0, [0.1, 0.2], decode_node="c-1e-t1-d1"),
            rec(0.0, [0.1, 0.2], decode_node="c-1e-t1-d0"),
            rec(-1.0, [-0.5], decode_node="c-1e-t1-d1", warmup=True),  # not timed
            rec(0.1, [], error_kind="rejected"),
        ]
    }
    s = run_row(result, 1000.0, 100.0)
    assert s["nodes"]["decode"] == {"c-1e-t1-d0": 2, "c-1e-t1-d1": 1}
    assert split(s["nodes"]["decode"]) == "d0 2, d1 1"
    assert split({}) == "-"


def test_entry_nodes_of_a_run_with_more_include_the_one_of_a_run_with_one() -> None:
    daemons = ["p0", "d0", "d1"]
    assert entry_nodes(daemons, 1) == ["d1"]
    assert entry_nodes(daemons, 2) == ["d1", "d0"]
    assert entry_nodes(daemons, 3) == ["d1", "d0", "p0"]
    for n in (0, 4):
        with pytest.raises(ValueError, match=f"{n} entry nodes"):
            entry_nodes(daemons, n)


def test_entries_comparison_runs_and_table() -> None:
    assert entries_runs(2) == [
        ("conductor-1e", "conductor", 1),
        ("conductor-2e", "conductor", 2),
        ("load_balance-2e", "load_balance", 2),
    ]
    herded = {
        "requests": [rec(0.0, [0.5, 0.55], decode_node="conductor-1e-t1-d1")] * 3
        + [rec(0.1, [], error_kind="rejected")]
    }
    spread = {
        "requests": [
            rec(0.0, [0.2, 0.25], decode_node="conductor-2e-t1-d0"),
            rec(0.0, [0.4, 0.45], decode_node="conductor-2e-t1-d1"),
            rec(0.0, [1.5, 1.55], decode_node="conductor-2e-t1-d1"),  # TTFT misses
        ]
    }
    runs = {
        "conductor-1e": run_row(herded, 1000.0, 100.0),
        "conductor-2e": run_row(spread, 1000.0, 100.0),
    }
    out = io.StringIO()
    print_entries_table([runs], out)
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:2] == ["run", "trial"]
    one = lines[1].split()
    # Mean and p90 TTFT, goodput (3 over 0.55 s), attainment, rejected, the split.
    assert one == ["conductor-1e", "1", "500.0", "500.0", "5.455", "75.0%", "1", "d1", "3"]
    two = lines[2].split()
    # The p90 is the bench's (interpolated, as numpy's): 400 + 0.8 x (1500 - 400).
    assert two[:7] == ["conductor-2e", "1", "700.0", "1280.0", "1.290", "66.7%", "0"]
    assert " ".join(two[7:]) == "d0 1, d1 2"


def test_bad_entry_counts_are_refused_naming_the_flag() -> None:
    for argv, msg in (
        (["--entries", "4"], "--entries: 4 is not between 1 and the cluster's 3 nodes"),
        (["--entries-compare", "1"], "--entries-compare: 1 is not between 2"),
        (["--entries-compare", "4"], "the cluster's 3 nodes"),
        (["--entries-compare", "2", "--repeats", "0"], "--repeats: 0"),
    ):
        env = Env(stdout=io.StringIO(), stderr=io.StringIO(), environ={})
        status = run(["bench", "policies", "--trace", "x", *argv], env)
        err = env.stderr.getvalue()  # type: ignore[attr-defined]
        assert status == 2 and msg in err, err
