"""``bench cpp``'s figures without daemons: means, speedups, the checks, the
printed report and the JSON; its prompts and option checks."""

from __future__ import annotations

import argparse
import io

import pytest

from mooncakectl.bench.cpp import check_args, configure, make_prompts
from mooncakectl.bench.cpp_report import (
    Arrangement,
    NodeRow,
    Sample,
    failures,
    figures,
    print_report,
    speedup,
    text_mismatches,
    ttft_table,
)


def _samples(
    ttft: dict[tuple[int, bool], list[float]],
    *,
    text: str = "abc",
    node: str = "prefill-0",
    cached: int = 48,
) -> list[Sample]:
    out = []
    for (n, reuse), values in ttft.items():
        for rep, ms in enumerate(values):
            out.append(Sample(n, rep, reuse, ms, f"{text}{n}.{rep}", cached if reuse else 0, node))
    return out


def _arrangements() -> list[Arrangement]:
    single = Arrangement(
        1, "prefill-0", [NodeRow("prefill-0", "prefill", "0"), NodeRow("decode-0", "decode", "1")]
    )
    single.samples = _samples(
        {
            (64, False): [100.0, 120.0],
            (64, True): [30.0, 30.0],
            (256, False): [400.0, 400.0],
            (256, True): [50.0, 50.0],
        }
    )
    group = Arrangement(
        2,
        "prefill-0",
        [
            NodeRow("prefill-0", "prefill", "0", "cpp-0 stage 0/2, layers 0-1 of 4"),
            NodeRow("prefill-1", "prefill", "1", "cpp-0 stage 1/2, layers 2-3 of 4"),
            NodeRow("decode-0", "decode", "1"),
        ],
    )
    group.samples = _samples(
        {
            (64, False): [110.0, 110.0],
            (64, True): [40.0, 20.0],
            (256, False): [250.0, 250.0],
            (256, True): [50.0, 50.0],
        }
    )
    return [single, group]


def test_means_and_speedups() -> None:
    single, group = _arrangements()
    assert single.mean_ttft(64, reuse=False) == 110.0
    assert group.mean_ttft(64, reuse=True) == 30.0
    assert group.mean_ttft(1024, reuse=False) is None
    assert single.mean_cached() == 48.0
    assert speedup(400.0, 250.0) == 1.6
    assert speedup(None, 250.0) is None and speedup(400.0, None) is None
    assert speedup(400.0, 0.0) is None
    assert (single.name, group.name) == ("1P+1D", "CPP 2")


def test_ttft_table_puts_each_groups_speedup_after_it() -> None:
    arrs = _arrangements()
    assert ttft_table(arrs, [64, 256, 1024], reuse=False) == [
        " prompt    1P+1D ms    CPP 2 ms  speedup",
        "     64       110.0       110.0    1.00x",
        "    256       400.0       250.0    1.60x",
        "   1024           -           -        -",
    ]


def test_checks_pass_on_agreeing_runs() -> None:
    assert failures(_arrangements()) == []


def test_checks_name_every_kind_of_failure() -> None:
    single, group = _arrangements()
    # A text that differs, a prefill on a stage that is not the head, a
    # resent prompt without a cache hit, a fresh one with one.
    group.samples[1] = Sample(64, 1, False, 110.0, "other", 0, "prefill-0")
    group.samples[2] = Sample(64, 0, True, 40.0, "abc64.0", 48, "prefill-1")
    group.samples[3] = Sample(64, 1, True, 20.0, "abc64.1", None, "prefill-0")
    group.samples[4] = Sample(256, 0, False, 250.0, "abc256.0", 16, "prefill-0")
    assert text_mismatches(single, group) == [(64, 1, False)]
    assert failures([single, group]) == [
        "CPP 2: 1 text(s) differ from 1P+1D's: 64 tokens rep 1",
        "CPP 2: 1 of 8 requests prefilled on prefill-1, not on prefill-0: the Conductor "
        "placed them elsewhere",
        "CPP 2: 1 prefix-reuse request(s) reported no cached tokens: 64 tokens rep 1 + suffix",
        "CPP 2: 1 fresh prompt(s) reported cached tokens: 256 tokens rep 0 (16)",
    ]


def test_report_lists_nodes_tables_and_checks() -> None:
    out = io.StringIO()
    print_report(_arrangements(), [64, 256], "title", out)
    text = out.getvalue()
    assert text.splitlines()[:3] == [
        "title",
        "  1P+1D: prefill-0 cpu 0; decode-0 cpu 1",
        "  CPP 2: prefill-0 cpu 0 (cpp-0 stage 0/2, layers 0-1 of 4); prefill-1 cpu 1 "
        "(cpp-0 stage 1/2, layers 2-3 of 4); decode-0 cpu 1",
    ]
    assert "     64        30.0        30.0    1.00x\n" in text  # the prefix-cached table
    assert "  CPP 2 vs 1P+1D: fresh 4/4 same, prefix cached 4/4 same\n" in text
    assert "(mean): 1P+1D 48.0, CPP 2 48.0\n" in text
    assert text.endswith("checks: ok\n")


def test_figures_hold_means_speedups_and_requests() -> None:
    doc = figures(_arrangements(), [64, 256], {"model": "m"})
    assert doc["run"] == {"model": "m"}
    assert doc["mean_ttft_ms"]["1P+1D"]["fresh"] == {"64": 110.0, "256": 400.0}
    assert doc["speedup"] == {
        "CPP 2": {"fresh": {"64": 1.0, "256": 1.6}, "reuse": {"64": 1.0, "256": 1.0}}
    }
    assert [a["name"] for a in doc["arrangements"]] == ["1P+1D", "CPP 2"]
    assert doc["arrangements"][1]["nodes"][1]["stage"] == "cpp-0 stage 1/2, layers 2-3 of 4"
    assert len(doc["arrangements"][0]["samples"]) == 8
    assert doc["failures"] == []


def test_prompts_are_fresh_in_range_and_repeatable() -> None:
    prompts = make_prompts([16, 64], 3, 8, 300, seed=0)
    assert sorted(prompts) == [(16, 0), (16, 1), (16, 2), (64, 0), (64, 1), (64, 2)]
    firsts = {tuple(p[:16]) for p, _ in prompts.values()}
    assert len(firsts) == 6  # no two share a first block
    assert all(len(p) == n and len(s) == 8 for (n, _), (p, s) in prompts.items())
    assert all(32 <= t < 300 for p, s in prompts.values() for t in p + s)
    assert make_prompts([16, 64], 3, 8, 300, seed=0) == prompts
    assert make_prompts([16, 64], 3, 8, 300, seed=1) != prompts


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    configure(p)
    args = p.parse_args(argv)
    check_args(args)
    return args


def test_options_parsed_and_refused_by_name() -> None:
    args = _args("--stages", "2,3", "--prompt-lens", "32,96")
    assert (args.stages, args.prompt_lens) == ([2, 3], [32, 96])
    defaults = _args()
    assert defaults.stages == [2] and defaults.prompt_lens == [256, 2048, 4096, 6144]
    assert (defaults.reps, defaults.check_tokens, defaults.cpu_threads) == (3, 16, 1)
    with pytest.raises(ValueError, match=r"--stages 1: pipeline\.num_stages: must be in 2\.\.16"):
        _args("--stages", "2,1")
    with pytest.raises(ValueError, match=r"--stages: 'x' is not an integer"):
        _args("--stages", "x")
    with pytest.raises(ValueError, match=r"--prompt-lens: '0' must be >= 1"):
        _args("--prompt-lens", "64,0")
    with pytest.raises(ValueError, match="--check-tokens must be >= 1, got 0"):
        _args("--check-tokens", "0")
    with pytest.raises(ValueError, match="--chunk-tokens must be >= 0, got -1"):
        _args("--chunk-tokens", "-1")


def test_pin_refuses_more_stages_than_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    import mooncakectl.bench.cpp as cpp

    monkeypatch.setattr(cpp.os, "sched_getaffinity", lambda _pid: {0, 1})
    assert _args("--pin", "--stages", "2").pin
    with pytest.raises(
        ValueError, match="--pin: 3 prefill nodes need a core each, and this process may use 2"
    ):
        _args("--pin", "--stages", "2,3")
