"""``mooncakectl simulate --against-cluster``: the real side's figures from
requests of known timing, and the simulated nodes made of measured costs."""

from __future__ import annotations

import argparse
import io
from typing import Any

import pytest

from mooncakectl.cli import run
from mooncakectl.registry import Env
from mooncakectl.simulate.against import node_spec, real_figures
from tests.conftest import REPO_ROOT


def rec(start: float, chunks: list[float], **kw: Any) -> dict[str, Any]:
    """A request as the bench's result JSON records it."""
    return {"index": 0, "start_s": start, "chunk_s": chunks, "end_s": chunks[-1], **kw}


def test_real_figures_as_the_simulator_measures() -> None:
    result = {
        "requests": [
            rec(-1.0, [-0.5, -0.4], warmup=True),  # left out
            # TTFT 0.2 s; ten gaps, one of 100 ms: the slowest tenth is it.
            rec(
                0.0,
                [0.2 + 0.01 * i for i in range(10)] + [0.39],
                prompt_tokens=100,
                cached_tokens=50,
                output_tokens=11,
            ),
            # TTFT 0.6 s, one gap of 40 ms.
            rec(1.0, [1.6, 1.64], prompt_tokens=100, cached_tokens=0, output_tokens=2),
            {"index": 0, "start_s": 1.5, "chunk_s": [], "end_s": 1.6, "error_kind": "rejected"},
        ]
    }
    f = real_figures(result)
    assert (f["sent"], f["completed"]) == (3, 2)
    # From the first start (0) to the last token (1.64 s).
    assert f["req_s"] == pytest.approx(2 / 1.64)
    assert f["tok_s"] == pytest.approx(13 / 1.64)
    assert f["ttft_mean"] == pytest.approx(400.0)
    assert f["tbt_mean"] == pytest.approx((100.0 + 40.0) / 2)
    assert f["hit"] == pytest.approx(50 / 200)


def test_a_role_is_simulated_on_its_nodes_averaged_costs() -> None:
    def status(base_s: float, token_s: float, links: dict[str, float]) -> dict[str, Any]:
        step = {"base_s": base_s, "token_s": token_s, "pair_s": 0.0, "seq_s": 0.0, "ctx_s": 0.0}
        costs = {"step": step, "kv_bytes_per_token": 2048, "chunk_tokens": 1024, "max_batch": 64}
        return {"conductor": {"costs": {**costs, "links": links}}}

    args = argparse.Namespace(dram_mb=256, kv_blocks=4096, block_size=16)
    spec = node_spec([status(0.004, 1e-4, {"d0": 2e8}), status(0.006, 3e-4, {})], args, "prefill")
    assert spec.costs.step.base_s == pytest.approx(0.005)
    assert spec.costs.step.token_s == pytest.approx(2e-4)
    assert spec.costs.kv_bytes_per_token == 2048 and spec.costs.links == ()
    assert spec.nic_bps == 2e8  # the fastest link either measured
    assert spec.kv_capacity_tokens == 4096 * 16 and spec.dram_bytes == 256 << 20


def test_against_cluster_refuses_what_it_cannot_run() -> None:
    trace = str(REPO_ROOT / "tests/fixtures/conversation_trace_head200.jsonl")
    for argv, msg in (
        (["--both", "2"], "not --both"),
        (["--prefill", "1"], "--prefill and --decode must be >= 1, got 1 and 0"),
        (["--policy", "random,conductor"], "--against-cluster runs one of"),
        (["--host-cores", "-1"], "--host-cores must be > 0"),
    ):
        env = Env(stdout=io.StringIO(), stderr=io.StringIO(), environ={})
        status = run(["simulate", "--against-cluster", "--trace", trace, *argv], env)
        err = env.stderr.getvalue()  # type: ignore[attr-defined]
        assert status == 2 and msg in err, err
