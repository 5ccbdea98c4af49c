"""``simulate --memory``: decode attention on memory nodes, and its cost table."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest

from mooncakectl.bench.trace import TraceRecord
from mooncakectl.bench.workloads import TraceScale
from mooncakectl.cli import run
from mooncakectl.registry import Env, ExitStatus
from mooncakectl.simulate.cluster import Shape, SimConfig, simulate
from mooncakectl.simulate.costs import preset_node
from mooncakectl.simulate.memory import (
    MEMORY_PRESETS,
    OFFLOAD_MAX_BATCH,
    capacity,
    hourly_usd,
    offloaded_node,
)
from mooncaked.cluster.placement import ConductorParams, EarlyReject
from mooncaked.cluster.slo import Slo
from tests.unit.test_simulate import FIXTURE

PRESET = "llama3-70b-8xh800"
H20 = MEMORY_PRESETS["8xh20"]


def test_the_offloaded_node_holds_its_share_of_the_memory_nodes_kv() -> None:
    local = preset_node(PRESET)
    two = offloaded_node(local, PRESET, H20, 2.0)
    half = offloaded_node(local, PRESET, H20, 0.5)
    kvb = local.costs.kv_bytes_per_token
    assert two.kv_capacity_tokens == int(H20.kv_bytes * 2 // kvb)
    assert half.kv_capacity_tokens == int(H20.kv_bytes * 0.5 // kvb)
    assert two.costs.max_batch == OFFLOAD_MAX_BATCH
    assert two.offload is not None and local.offload is None


def test_the_conductor_reads_the_serial_step_an_upper_bound_of_the_real_one() -> None:
    node = offloaded_node(preset_node(PRESET), PRESET, H20, 1.0)
    assert node.offload is not None
    for batch, ctx in ((1, 1000), (64, 800_000), (300, 4_000_000)):
        serial = node.costs.step.decode_step_s(batch, ctx)
        assert node.offload.decode_s(batch, ctx) <= serial + 1e-12


def test_capacity_names_what_bounds_the_batch() -> None:
    local = preset_node(PRESET)
    cap = capacity(local, 14_000, 0.06)
    # 8 x 80 GB less the weights holds about 1.3 M tokens: 95 sequences of 14k.
    assert (cap.batch, cap.bound) == (local.kv_capacity_tokens // 14_000, "KV memory")
    assert cap.tbt_s < 0.06
    roomy = offloaded_node(local, PRESET, H20, 8.0)
    big = capacity(roomy, 14_000, 0.06)
    assert roomy.offload is not None
    assert big.bound == "TBT SLO"
    assert big.batch > cap.batch
    assert big.tbt_s <= 0.06 < roomy.offload.decode_s(big.batch + 1, (big.batch + 1) * 14_000)


def test_prices_come_from_the_server_prices() -> None:
    h800, h20 = hourly_usd("8xh800"), hourly_usd("8xh20")
    assert h800 is not None and h20 is not None
    assert h20 / h800 == pytest.approx(1.4 / 2.0)
    assert hourly_usd("8xa800") is None


def _records() -> list[TraceRecord]:
    # Twelve requests a few ms apart: long prompts, some output each.
    return [TraceRecord(i, 5.0 * i, 9000, 40, tuple(range(i * 20, i * 20 + 18))) for i in range(12)]


def test_a_memory_run_decodes_on_the_offloaded_step() -> None:
    local = preset_node(PRESET)
    cfg = SimConfig(
        Shape(num_prefill=2, num_decode=1),
        local,
        params=ConductorParams(early_reject=EarlyReject.OFF, spread=0.0, decode_spread=0.0),
        slo=Slo(0.0, 0.0),
        gossip_s=0.0,
        scale=TraceScale(block_tokens=512),
    )
    plain = simulate(cfg, _records())
    off_node = offloaded_node(local, PRESET, H20, 2.0)
    shape = replace(cfg.shape, num_memory=2)
    offloaded = simulate(replace(cfg, shape=shape, decode_node=off_node), _records())
    assert shape.label() == "2P+1D+2M"
    assert all(r.tbt_s is not None for r in plain.requests + offloaded.requests)
    # Same arrivals and prefills: only the decode steps differ, and every
    # token still comes out.
    assert [r.first_token_s for r in plain.requests] == [
        r.first_token_s for r in offloaded.requests
    ]
    assert [r.tbt_s for r in plain.requests] != [r.tbt_s for r in offloaded.requests]


def test_memory_nodes_need_decode_nodes() -> None:
    with pytest.raises(ValueError, match="--memory"):
        Shape(num_both=1, num_memory=1)


def test_the_command_prints_the_cost_table() -> None:
    env = Env(stdout=io.StringIO(), stderr=io.StringIO(), environ={}, stdout_isatty=False)
    argv = ["--trace-count", "20", "--preset", PRESET, "--prefill", "1", "--decode", "1"]
    code = run(["simulate", "--trace", str(FIXTURE), *argv, "--memory", "0,1"], env)
    out = env.stdout.getvalue()  # type: ignore[attr-defined]
    assert code == ExitStatus.OK, env.stderr.getvalue()  # type: ignore[attr-defined]
    assert "decode throughput per cost" in out
    assert "1P+1D+1M" in out
    assert "KV memory" in out or "TBT SLO" in out


def test_the_command_refuses_memory_nodes_without_a_price() -> None:
    env = Env(stdout=io.StringIO(), stderr=io.StringIO(), environ={}, stdout_isatty=False)
    argv = ["--trace-count", "5", "--preset", "llama3-70b-8xa800", "--prefill", "1"]
    code = run(["simulate", "--trace", str(FIXTURE), *argv, "--decode", "1", "--memory", "1"], env)
    assert code == ExitStatus.USAGE
    assert "--compute-price" in env.stderr.getvalue()  # type: ignore[attr-defined]
