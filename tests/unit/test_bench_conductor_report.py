"""tools/bench_conductor.py's figures from a result of known requests."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from mooncaked.cluster.slo import Slo
from tests.conftest import REPO_ROOT, _env, load_tool

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


def test_slo_and_tbt_are_judged_as_slo_py_defines_them() -> None:
    # Two tokens, one gap of 300 ms: a TBT of 300 ms (slo.tbt_s), which
    # misses 100 ms even if the entry would not calibrate on one gap.
    two = rec(0.0, [0.2, 0.5])
    # One token: no gap, no TBT; meets the TBT target.
    one = rec(0.0, [0.3])
    # Nine gaps of 10 ms and one of 150: the slowest tenth is the 150 ms one.
    stall = rec(0.0, [0.1 + 0.01 * i for i in range(10)] + [0.34])
    slo = Slo(1.0, 0.1)
    assert bc._tbt_ms(two) == pytest.approx(300.0)
    assert bc._tbt_ms(one) is None
    assert bc._tbt_ms(stall) == pytest.approx(150.0)
    assert [bc.meets_slo(r, slo) for r in (two, one, stall)] == [False, True, False]
    assert bc.summarize({"requests": [two, one, stall]}, 1000.0, 100.0)["admitted_meeting_slo"] == (
        pytest.approx(1 / 3)
    )
    # The forecasts are checked only against TBTs over MIN_TBT_GAPS gaps or more.
    acc = bc.accuracy(
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
            {"start_s": 0.1, "chunk_s": [], "end_s": None, "error_kind": "rejected"},
        ]
    }
    s = bc.summarize(result, 1000.0, 100.0)
    assert s["decode_split"] == {"c-1e-t1-d0": 2, "c-1e-t1-d1": 1}
    assert bc._split(s["decode_split"]) == "d0 2, d1 1"
    assert bc._split({}) == "-"


def test_entry_nodes_of_a_run_with_more_include_the_one_of_a_run_with_one() -> None:
    daemons = ["p0", "d0", "d1"]
    assert bc.entry_nodes(daemons, 1) == ["d1"]
    assert bc.entry_nodes(daemons, 2) == ["d1", "d0"]
    assert bc.entry_nodes(daemons, 3) == ["d1", "d0", "p0"]
    for n in (0, 4):
        with pytest.raises(ValueError, match=f"{n} entry nodes"):
            bc.entry_nodes(daemons, n)


def test_entries_comparison_runs_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert bc.entries_runs(2) == [
        ("conductor-1e", "conductor", 1),
        ("conductor-2e", "conductor", 2),
        ("load_balance-2e", "load_balance", 2),
    ]
    herded = {
        "requests": [rec(0.0, [0.5, 0.55], decode_node="conductor-1e-t1-d1")] * 3
        + [{"start_s": 0.1, "chunk_s": [], "end_s": None, "error_kind": "rejected"}]
    }
    spread = {
        "requests": [
            rec(0.0, [0.2, 0.25], decode_node="conductor-2e-t1-d0"),
            rec(0.0, [0.4, 0.45], decode_node="conductor-2e-t1-d1"),
            rec(0.0, [1.5, 1.55], decode_node="conductor-2e-t1-d1"),  # TTFT misses
        ]
    }
    runs = {
        "conductor-1e": bc.summarize(herded, 1000.0, 100.0),
        "conductor-2e": bc.summarize(spread, 1000.0, 100.0),
    }
    bc.print_entries_table([runs])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["run", "trial"]
    one = lines[1].split()
    # Mean and p90 TTFT, goodput (3 over 0.55 s), attainment, rejected, the split.
    assert one == ["conductor-1e", "1", "500.0", "500.0", "5.455", "75.0%", "1", "d1", "3"]
    two = lines[2].split()
    assert two[:7] == ["conductor-2e", "1", "700.0", "400.0", "1.290", "66.7%", "0"]
    assert " ".join(two[7:]) == "d0 1, d1 2"


def test_bad_entry_counts_are_refused_naming_the_flag() -> None:
    for argv, msg in (
        (["--entries", "4"], "--entries: 4 is not between 1 and the cluster's 3 nodes"),
        (["--entries-compare", "1"], "--entries-compare: 1 is not between 2"),
        (["--entries-compare", "4"], "the cluster's 3 nodes"),
        (["--entries-compare", "2", "--repeats", "0"], "--repeats: 0"),
    ):
        done = subprocess.run(
            [
                sys.executable,
                str(REPO_ROOT / "tools" / "bench_conductor.py"),
                "--trace",
                "x",
                *argv,
            ],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=60,
        )
        assert done.returncode == 2 and msg in done.stderr, done.stderr
