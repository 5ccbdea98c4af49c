"""``mooncakectl bench disagg``, run with tiny settings so it cannot rot."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from mooncakectl.cli import run
from mooncakectl.registry import Env
from mooncaked.engine.loader import builtin_arch

# A disaggregated cluster benchmarked end to end; its report has unit tests.
pytestmark = pytest.mark.slow


def bench_disagg(*args: str) -> tuple[int, str, str]:
    env = Env(stdout=io.StringIO(), stderr=io.StringIO(), environ={})
    status = run(["bench", "disagg", *args], env)
    return status, env.stdout.getvalue(), env.stderr.getvalue()  # type: ignore[attr-defined]


def test_bench_disagg_smoke(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    status, stdout, stderr = bench_disagg(
        "--prompt-lens", "32,96", "--hop-prompt", "8", "--reps", "2",
        "--streams", "2", "--stream-prompt", "16", "--stream-tokens", "8",
        "--long-prompt", "64", "--long-every-s", "0.5", "--window-s", "1",
        "--result-json", str(out),
    )  # fmt: skip
    assert status == 0, stderr[-4000:]
    figures = json.loads(out.read_text())

    # The builtin model's KV (float32 on CPU): K and V rows of every layer.
    arch = builtin_arch("tiny")
    token_bytes = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * 4
    rows = {(r["prompt_tokens"], r["layerwise"]): r for r in figures["handoff"]}
    assert sorted(rows) == [(n, lw) for n in (8, 32, 96) for lw in (False, True)]
    for (n, _), r in rows.items():
        # Every rep handed off (none fell back), all of the prompt's KV sent.
        assert r["handoffs_ok"] == 2
        assert r["kv_bytes"] == n * token_bytes
        assert r["exposed_ms"] > 0 and r["ttft_ms"] > 0
        assert r["send_window_ms"] >= r["exposed_ms"]
    for n in ("32", "96"):
        assert figures["exposed_ratio"][n] > 0
        assert n in figures["exposed_ratio_over_floor"]
    assert set(figures["ttft_disagg_ms"]) == set(figures["ttft_colocated_ms"]) == {"8", "32", "96"}
    assert figures["hop_ms"] is not None
    setups = [r["setup"] for r in figures["interference"]]
    assert setups == ["1P+1D", "2x both"]
    for r in figures["interference"]:
        assert r["gaps"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0
        assert r["long_prompts"] == 2
    assert figures["interference_ratio"] > 0

    # /metrics and /admin/status of the prefill node agree; every step sent
    # (none failed) is in the per-step histograms.
    m = figures["prefill_metrics"]
    assert m["metrics_sent_bytes"] == m["status_sent_bytes"] == m["metrics_step_bytes_sum"]
    assert m["metrics_steps"] == m["status_steps"] == m["metrics_step_histogram_count"]
    assert m["status_steps"] >= 3 * 3  # warm-up and two reps, three prompt lengths

    # The printed table names the goals next to the ratios.
    assert "exposed / raw" in stdout and "goal <= 0.2" in stdout
    assert "1P+1D / 2x both" in stdout and "goal <= 0.5" in stdout
    assert "fixed cost of the extra hop" in stdout


def test_bench_disagg_rejects_bad_arguments() -> None:
    status, _, stderr = bench_disagg("--prompt-lens", "1024,abc")
    assert status == 2
    assert "'1024,abc'" in stderr
    status, _, stderr = bench_disagg("--reps", "0")
    assert status == 2
    assert "--reps must be >= 1, got 0" in stderr
