"""The side-by-side benchmark against vLLM (``mooncakectl.bench.vllm_bench``, for
tools/bench_vllm.py): workloads, the command lines they become, the anchor
file, the ratio table. Nothing here needs vLLM installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from mooncakectl.bench import vllm_bench as vb
from mooncakectl.cli import build_parser
from tests.conftest import REPO_ROOT


def _figures(tok_s: float, ttft: float, tpot: float, done: int = 4) -> vb.Figures:
    return vb.Figures(
        output_tok_s=tok_s, ttft_ms=ttft, tpot_ms=tpot, completed=done, num_requests=4
    )


def test_the_workloads_are_the_issue_s_three() -> None:
    single, batch, prefix = (vb.WORKLOADS[n] for n in ("single", "batch", "prefix"))
    assert (single.max_concurrency, single.input_len, single.output_len) == (1, 128, 128)
    assert (batch.num_prompts, batch.max_concurrency, batch.range_ratio) == (64, 16, 0.5)
    assert (batch.input_len, batch.output_len) == (256, 128)
    assert (prefix.num_prompts, prefix.max_concurrency) == (16, 4)
    assert (prefix.prefix_len, prefix.input_len) == (1024, 64)
    assert batch.describe() == "64 requests, 16 at a time, 256±50% in, 128±50% out"
    assert prefix.describe() == (
        "16 requests, 4 at a time, 1,024-token shared prefix + 64 in, 64 out"
    )


def test_bench_argv_is_what_mooncakectl_bench_random_parses() -> None:
    w = vb.WORKLOADS["prefix"]
    argv = w.bench_argv(
        "http://127.0.0.1:9", vocab_size=49152, max_model_len=4096, seed=3, num_warmups=1
    )
    args = build_parser({}).parse_args(argv)
    assert (args.command, args.workload, args.json) == ("bench", "random", True)
    assert args.url == "http://127.0.0.1:9" and args.prompt_format == "ids"
    assert (args.vocab_size, args.max_model_len, args.seed, args.num_warmups) == (
        49152,
        4096,
        3,
        1,
    )
    assert (args.num_prompts, args.max_concurrency) == (16, 4)
    assert (args.random_input_len, args.random_output_len) == (64, 64)
    assert (args.random_range_ratio, args.random_prefix_len) == (0.0, 1024)


def test_a_smoke_run_scales_requests_and_concurrency() -> None:
    single, batch = vb.pick_workloads("single, batch", num_prompts=4)
    assert (single.num_prompts, single.max_concurrency) == (4, 1)
    assert (batch.num_prompts, batch.max_concurrency) == (4, 4)
    assert batch.input_len == 256 and batch.range_ratio == 0.5
    assert [w.name for w in vb.pick_workloads("prefix")] == ["prefix"]
    assert vb.pick_workloads("prefix")[0] == vb.WORKLOADS["prefix"]
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        vb.pick_workloads("single,nope")
    with pytest.raises(ValueError, match="no workload"):
        vb.pick_workloads(" , ")
    with pytest.raises(ValueError, match="--num-prompts"):
        vb.pick_workloads("single", num_prompts=0)


def test_vllm_runs_its_server_module_with_the_bench_s_settings() -> None:
    argv = vb.vllm_argv(
        "/venv/bin/python", Path("/m/hf-x"), 8123, dtype="bfloat16", max_model_len=4096
    )
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=True))
    assert flags == {
        "--model": "/m/hf-x",
        "--served-model-name": "hf-x",
        "--dtype": "bfloat16",
        "--max-model-len": "4096",
        "--host": "127.0.0.1",
        "--port": "8123",
    }
    assert vb.vllm_env(1.5)["VLLM_CPU_KVCACHE_SPACE"] == "1.5"


def test_the_anchor_file_names_vllm_s_python(tmp_path: Path) -> None:
    env = tmp_path / "anchor.env"
    env.write_text(
        "VLLM_ANCHOR_VENV='/v'\nVLLM_ANCHOR_PYTHON='/v/bin/python'\n"
        "VLLM_VERSION='0.32.0'\nVLLM_TORCH_VERSION=\"2.13.0+cpu\"\n"
    )
    anchor = vb.read_anchor(str(env))
    assert anchor == vb.VllmAnchor(Path("/v/bin/python"), "0.32.0", "2.13.0+cpu")
    env.write_text("VLLM_VERSION=0.32.0\n")
    with pytest.raises(vb.AnchorError, match="VLLM_ANCHOR_PYTHON"):
        vb.read_anchor(str(env))
    with pytest.raises(vb.AnchorError, match="cannot read"):
        vb.read_anchor(str(tmp_path / "missing.env"))
    with pytest.raises(vb.AnchorError, match="no anchor script"):
        vb.read_anchor("auto")


def test_the_anchor_script_says_when_vllm_is_missing(tmp_path: Path) -> None:
    script = REPO_ROOT / "tools" / "vllm_anchor.sh"
    done = subprocess.run(
        ["bash", str(script), "--print"],
        env=os.environ | {"VLLM_ANCHOR_VENV": str(tmp_path / "none")},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1 and "not installed" in done.stderr


def test_figures_read_the_bench_summary() -> None:
    summary = {
        "output_throughput": 120.5,
        "mean_ttft_ms": 80.0,
        "mean_tpot_ms": None,
        "completed": 3,
        "num_requests": 4,
    }
    f = vb.Figures.from_summary(summary)
    assert (f.output_tok_s, f.ttft_ms, f.completed, f.num_requests) == (120.5, 80.0, 3, 4)
    assert f.tpot_ms != f.tpot_ms  # no TPOT (one-token outputs): NaN, never 0


def test_the_ratio_is_of_the_medians_over_rounds() -> None:
    assert vb.ratio([10.0, 30.0, 20.0], [10.0]) == 2.0
    assert vb.ratio([], [1.0]) is None and vb.ratio([1.0], [0.0]) is None


def test_the_ratio_table_puts_mooncaked_over_vllm() -> None:
    single, batch = vb.pick_workloads("single,batch")
    runs = {
        "single": {
            vb.OURS: [_figures(100.0, 50.0, 10.0), _figures(120.0, 70.0, 8.0)],
            vb.THEIRS: [_figures(50.0, 100.0, 20.0), _figures(50.0, 100.0, 20.0, done=3)],
        },
        "batch": {vb.OURS: [_figures(300.0, 200.0, 30.0)]},
    }
    lines = vb.ratio_table([single, batch], runs).splitlines()
    header, rule, *rows = lines
    assert header.split() == ["workload", "metric", "mooncaked", "vllm", "mooncaked", "/", "vllm"]
    assert set(rule.replace(" ", "")) == {"-"}
    table = {tuple(r.split()[:3]): r for r in rows}
    tok = table[("single", "output", "tok/s")]
    assert "110.0 [100.0-120.0]" in tok and "50.0 [50.0-50.0]" in tok
    assert "2.20x (higher is better)" in tok
    assert "0.60x (lower is better)" in table[("single", "mean", "TTFT")]
    assert "0.45x" in table[("single", "mean", "TPOT")]
    assert table[("single", "completed", "8/8")].split()[2:] == ["8/8", "7/8"]
    # A server with no run: a dash, and no ratio.
    assert table[("batch", "output", "tok/s")].split()[3:] == ["300.0", "-", "-"]
    assert table[("batch", "completed", "4/4")].split()[2:] == ["4/4", "-"]


def test_the_greedy_report_shows_where_the_texts_part() -> None:
    check = vb.GreedyCheck(
        ("a", "b"), {vb.OURS: (" Paris.", " two"), vb.THEIRS: (" Paris.", " too")}
    )
    lines = check.report().splitlines()
    assert lines[0] == "greedy text: 1/2 prompts identical"
    assert lines[1] == "  'b': the same for 2 chars; then"
    assert lines[2].split() == ["mooncaked:", "'wo'"] and lines[3].split() == ["vllm:", "'oo'"]
