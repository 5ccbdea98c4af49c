"""``mooncakectl simulate --cpp``: pipelined prefill groups, timed by hand on
tiny traces, placed by the daemon's own Conductor, and the command's output."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from itertools import accumulate
from pathlib import Path

import pytest

from mooncakectl.bench.trace import TraceRecord
from mooncakectl.bench.workloads import TraceScale
from mooncakectl.cli import run
from mooncakectl.registry import Env, ExitStatus
from mooncakectl.simulate.cache import BlockCache
from mooncakectl.simulate.cluster import (
    Shape,
    SimConfig,
    SimResult,
    Simulation,
    simulate,
    trace_requests,
)
from mooncakectl.simulate.costs import (
    PRESETS,
    NodeSpec,
    StageModel,
    preset_node,
    preset_stage_model,
    stage_spec,
)
from mooncakectl.simulate.node import SimRequest
from mooncakectl.simulate.pipeline import PipelineRun, StageTask
from mooncakectl.simulate.results import sim_summary, ttft_by_prompt
from mooncaked.cache.hashing import layer_hashes
from mooncaked.cluster.costs import (
    NodeCosts,
    StepCost,
    StepFeatures,
    equal_time_chunks,
    pipeline_prefill_s,
    prefill_pairs,
)
from mooncaked.cluster.placement import ConductorParams, EarlyReject, Policy
from mooncaked.cluster.state import MemberStatus
from mooncaked.handoff import LayerSpan, split_layers

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "conversation_trace_head200.jsonl"
# Tokens per hash id in the hand-made traces.
BS = 100
# Four layers, 1000 bytes of activations a token, 4 ms of a step whatever its layers.
MODEL = StageModel(num_layers=4, act_bytes_per_token=1000, step_fixed_s=0.004)


def node(*, chunk: int = 1000, pair_s: float = 0.0) -> NodeSpec:
    # The whole model: 10 ms a step, 1 ms a prompt token, 2 ms a decode;
    # 1000 bytes of KV a token; NICs of 1 GB/s.
    costs = NodeCosts(
        StepCost(base_s=0.01, token_s=0.001, pair_s=pair_s, seq_s=0.002),
        kv_bytes_per_token=1000,
        chunk_tokens=chunk,
        max_batch=8,
    )
    return NodeSpec(costs, nic_bps=1e9, dram_bytes=1e9)


def config(shape: Shape, spec: NodeSpec | None = None, *, first_chunk: int = 200) -> SimConfig:
    """Every choice the best alone, no late binding, an up-to-date view."""
    params = ConductorParams(
        policy=Policy.CONDUCTOR,
        early_reject=EarlyReject.OFF,
        spread=0.0,
        decode_spread=0.0,
        late_binding=False,
        best_effort_wait=0.0,
    )
    return SimConfig(
        shape,
        spec or node(),
        params=params,
        gossip_s=0.0,
        scale=TraceScale(block_tokens=BS, input_scale=1.0),
        stage_model=MODEL,
        cpp_chunk_tokens=first_chunk,
    )


def rec(line: int, ms: float, tokens: int, out: int, ids: list[int]) -> TraceRecord:
    return TraceRecord(line, ms, tokens, out, tuple(ids))


def make_env() -> Env:
    return Env(stdout=io.StringIO(), stderr=io.StringIO(), environ={}, stdout_isatty=False)


# Each stage: half the layers. Its step: the 4 ms fixed part whole and half
# the rest of the base (3 ms), half a ms a token; 500 bytes of KV a token.
STAGE_BASE = 0.004 + 0.006 / 2
STAGE_TOKEN = 0.0005
RTT = ConductorParams().fetch_rtt_s
# 200 tokens of activations (200 KB) over 1 GB/s, then the notice's round trip.
HOP = 200 * 1000 / 1e9 + RTT


def test_a_stage_costs_its_share_of_the_layers_and_the_fixed_part_whole() -> None:
    spans = split_layers(4, 2)
    head, tail = (stage_spec(node(pair_s=1e-6), MODEL, s) for s in spans)
    assert head.costs.step == tail.costs.step
    assert head.costs.step.base_s == pytest.approx(STAGE_BASE)
    assert head.costs.step.token_s == pytest.approx(STAGE_TOKEN)
    assert head.costs.step.pair_s == pytest.approx(0.5e-6)
    assert head.costs.step.seq_s == pytest.approx(0.001)
    assert head.costs.kv_bytes_per_token == 500
    # The 70B preset on 8 A800: 80 layers, 16 KiB of activations a token;
    # two stages' per-token costs add up to the whole model's, their bases to
    # it and one more fixed part (1 ms).
    whole = preset_node("llama3-70b-8xa800")
    model = preset_stage_model("llama3-70b-8xa800")
    assert (model.num_layers, model.act_bytes_per_token) == (80, 8192 * 2)
    assert model.step_fixed_s == PRESETS["llama3-70b-8xa800"].hardware.step_fixed_s == 0.001
    a, b = (stage_spec(whole, model, s).costs for s in split_layers(80, 2))
    assert a.step.token_s + b.step.token_s == pytest.approx(whole.costs.step.token_s)
    assert a.step.base_s + b.step.base_s == pytest.approx(whole.costs.step.base_s + 0.001)
    assert a.kv_bytes_per_token + b.kv_bytes_per_token == whole.costs.kv_bytes_per_token
    with pytest.raises(ValueError, match="8-layer"):
        stage_spec(whole, model, LayerSpan(0, 4, 8))


def test_a_groups_request_runs_chunk_by_chunk_through_every_stage_by_hand() -> None:
    # 400 tokens, 3 out: two chunks of 200 (no attention cost, so the chunks
    # stay level) on a group of two stages.
    trace = [rec(1, 0, 400, 3, [1, 2, 3, 4])]
    res = simulate(config(Shape(2, 1, cpp=2)), trace)
    [r] = res.requests
    assert (r.prefill_node, r.stages, r.decode_node) == ("p0", ("p0", "p1"), "d0")
    step = STAGE_BASE + 200 * STAGE_TOKEN
    # The head is open after a round trip (it opened p1), then computes its
    # two chunks back to back; p1 computes each once its activations landed.
    head_ends = [RTT + step, RTT + 2 * step]
    tail_1 = head_ends[0] + HOP + step
    tail_2 = max(tail_1, head_ends[1] + HOP) + step
    assert r.ttft_s == pytest.approx(tail_2)
    # The Conductor's forecast is costs.pipeline_prefill_s's: all but the opening.
    assert r.model_ttft_s == pytest.approx(tail_2 - RTT)
    # Two decode steps on d0 at batch 1: 10 ms + 2 ms each.
    assert r.done_s == pytest.approx(tail_2 + 2 * 0.012)
    p0, p1 = (n for n in res.nodes if n.node_id in ("p0", "p1"))
    for stage, (lo, hi) in ((p0, (0, 2)), (p1, (2, 4))):
        assert stage.num_prefilled == 1  # type: ignore[union-attr]
        assert stage.busy_s == pytest.approx(2 * step)
        # Each stage caches its own layers' keys of the prompt, nothing else.
        keys = layer_hashes(r.hashes, lo, hi)
        assert stage.cache.prefix(keys, 4) == (4, 0)
        assert stage.cache.prefix(r.hashes, 4) == (0, 0)
    s = sim_summary(res)
    # Activations once across the boundary; each stage's half of the KV to d0.
    assert s.bytes_moved == {"act": 400 * 1000, "kv": 2 * 400 * 500}
    assert s.cluster == "1x2P+1D"


def test_chunks_level_in_time_as_the_context_grows() -> None:
    # Attention priced: the head cuts 1000 tokens as equal_time_chunks does on
    # its own model: 200 first, then (a block at least) what takes as long.
    trace = [rec(1, 0, 1000, 1, list(range(1, 11)))]
    sim = Simulation(config(Shape(2, 1, cpp=2), node(pair_s=2e-6)), trace_requests(trace))
    head, tail = sim.groups["p0"].stages
    chunks = equal_time_chunks(head.costs.step, 1000, 0, 200, align=BS)
    assert chunks == [200] + [100] * 8
    [r] = sim.run().requests
    starts = list(accumulate(chunks, initial=0))
    steps = [
        head.costs.step.step_s(StepFeatures(k, prefill_pairs(k, pos)))
        for k, pos in zip(chunks, starts, strict=False)
    ]
    # One step a chunk on each stage, none shared.
    assert head.busy_s == pytest.approx(sum(steps)) == tail.busy_s
    hops = [RTT + k * 1000 / 1e9 for k in chunks]
    expected = pipeline_prefill_s([head.costs.step] * 2, chunks, 0, queue_s=[RTT, 0], hop_s=hops)
    assert r.ttft_s == pytest.approx(expected)


def test_activations_landing_out_of_order_wait_for_the_earlier() -> None:
    sim = Simulation(config(Shape(2, 1, cpp=2)), [])
    tail = sim.groups["p0"].stages[1]
    r = SimRequest(0, 0.0, 400, 1, (b"a", b"b", b"c", b"d"))
    t = StageTask(PipelineRun(r), 1, [], 0, 400, 0, ready=True)
    tail.land(t, 1, 400)
    assert t.arrived == 0 and not tail.busy
    tail.land(t, 0, 200)
    assert t.arrived == 400 and t.landed == {}


def test_the_group_starts_from_the_least_prefix_its_stages_hold() -> None:
    # A's 400 tokens leave four blocks on both stages; B shares A's first
    # three blocks. Before B, p1 loses all but its first two (evicted): the
    # group computes B from block 2 on, as every stage must start alike.
    trace = [rec(1, 0, 400, 1, [1, 2, 3, 4]), rec(2, 5000, 600, 1, [1, 2, 3, 7, 8, 9])]
    sim = Simulation(config(Shape(2, 1, cpp=2)), trace_requests(trace, config(Shape(2, 1)).scale))
    a, b = sim.requests
    tail = sim.groups["p0"].stages[1]

    def evict(_: object) -> None:
        # Gone unannounced: the view still shows p1 with A's four blocks.
        tail.cache = BlockCache(2)
        tail.cache.insert(layer_hashes(a.hashes, 2, 4)[:2])

    sim.events.at(4.0, evict)
    res = sim.run()
    assert b.local_cached_tokens == 200
    # Computed: 400 tokens in chunks of 200 on both stages.
    step = STAGE_BASE + 200 * STAGE_TOKEN
    assert b.ttft_s == pytest.approx(RTT + step + HOP + step + step)
    assert sim_summary(res).local_hit_rate == pytest.approx(200 / 1000)


def _with_dead(shape: Shape, dead: list[str], trace: list[TraceRecord]) -> SimResult:
    cfg = config(shape)
    sim = Simulation(cfg, trace_requests(trace, cfg.scale))
    for node_id in dead:
        sim._members[node_id].status = MemberStatus.DEAD
    return sim.run()


def test_an_incomplete_group_is_never_chosen() -> None:
    trace = [rec(i, 100 * i, 400, 2, [10 * i + k for k in range(4)]) for i in range(1, 9)]
    # Two groups; g0 lost its second stage: every prompt goes to g1, whole.
    res = _with_dead(Shape(4, 1, cpp=2), ["p1"], trace)
    assert {r.stages for r in res.requests} == {("p2", "p3")}
    assert all(r.done_s is not None for r in res.requests)
    # No group complete: nothing is placed on a stage; the decode node prefills.
    res = _with_dead(Shape(4, 1, cpp=2), ["p1", "p2"], trace)
    assert {(r.prefill_node, r.stages) for r in res.requests} == {("d0", ())}


def test_without_cpp_the_shape_and_the_runs_are_as_before() -> None:
    trace = [rec(1, 0, 400, 3, [1, 2, 3, 4]), rec(2, 100, 800, 2, [1, 2, 9, 8, 7, 6, 5, 4])]
    off = simulate(config(Shape(2, 1)), trace)
    plain = simulate(replace(config(Shape(2, 1)), stage_model=None), trace)
    for a, b in zip(off.requests, plain.requests, strict=True):
        assert (a.prefill_node, a.stages, a.ttft_s, a.done_s) == (
            b.prefill_node,
            (),
            b.ttft_s,
            b.done_s,
        )
    assert Shape(8, 8).label() == "8P+8D" and Shape(8, 8, cpp=2).label() == "4x2P+8D"
    assert Shape(4, 2, cpp=2).groups() == [["p0", "p1"], ["p2", "p3"]]


@pytest.mark.parametrize(
    ("shape", "needle"),
    [
        (dict(num_prefill=8, num_decode=1, cpp=3), "--cpp 3 does not divide --prefill 8"),
        (dict(num_decode=1, cpp=2), "there are none: give --prefill"),
        (dict(num_prefill=2, num_decode=1, cpp=1), "2..16"),
    ],
)
def test_a_shape_refuses_groups_that_do_not_fit(shape: dict[str, int], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Shape(**shape)


def test_ttft_by_prompt_length() -> None:
    trace = [
        rec(1, 0, 500, 1, [1, 2, 3, 4, 5]),
        rec(2, 0, 2000, 1, list(range(10, 30))),
        rec(3, 0, 900, 1, list(range(40, 49))),
    ]
    reqs = simulate(config(Shape(2, 1)), trace).requests
    buckets = {b["bucket"]: b for b in ttft_by_prompt(reqs)}
    assert list(buckets) == ["<1k", "1k-4k", "4k-16k", "16k-64k", ">=64k"]
    short = sorted(r.ttft_s * 1000 for r in reqs if r.num_prompt_tokens < 1024)  # type: ignore[operator]
    assert buckets["<1k"]["requests"] == buckets["<1k"]["served"] == 2
    assert buckets["<1k"]["mean_ms"] == pytest.approx(sum(short) / 2)
    assert buckets["<1k"]["p90_ms"] == pytest.approx(short[0] + 0.9 * (short[1] - short[0]))
    assert buckets["1k-4k"]["requests"] == 1
    assert buckets[">=64k"] == {
        "bucket": ">=64k",
        "requests": 0,
        "served": 0,
        "mean_ms": None,
        "p90_ms": None,
    }


def test_command_runs_with_and_without_groups_side_by_side() -> None:
    env = make_env()
    argv = ["simulate", "--trace", str(FIXTURE), "--trace-count", "40", "--prefill", "2"]
    argv += ["--decode", "1", "--early-reject", "off", "--json"]
    code = run([*argv, "--cpp", "0,2"], env)
    assert code == ExitStatus.OK, env.stderr.getvalue()  # type: ignore[attr-defined]
    off, cpp = json.loads(env.stdout.getvalue())  # type: ignore[attr-defined]
    assert (off["cluster"], cpp["cluster"]) == ("2P+1D", "1x2P+1D")
    assert cpp["completed"] == 40 and cpp["bytes_moved"]["act"] > 0
    assert sum(b["requests"] for b in cpp["ttft_by_prompt"]) == 40
    # The run without groups is the plain run, whatever ran beside it.
    env = make_env()
    assert run(argv, env) == ExitStatus.OK
    [plain] = json.loads(env.stdout.getvalue())  # type: ignore[attr-defined]
    for summary in (off, plain):
        del summary["sim_wall_s"]
    assert off == plain
    # The table: a TTFT column pair per run.
    env = make_env()
    assert run([*argv[:-1], "--cpp", "0,2"], env) == ExitStatus.OK
    text = env.stdout.getvalue()  # type: ignore[attr-defined]
    assert "TTFT by prompt length" in text and "1x2P+1D conductor off" in text


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--prefill", "8", "--decode", "1", "--cpp", "3"], "--cpp 3 does not divide --prefill 8"),
        (["--prefill", "2", "--decode", "1", "--cpp", "0,x"], "--cpp: 'x'"),
        (["--prefill", "2", "--decode", "1", "--cpp", "2", "--cpp-chunk", "-1"], "--cpp-chunk"),
        (["--both", "2", "--cpp", "2", "--sweep"], "--sweep"),
    ],
)
def test_command_refuses_groups_that_do_not_fit(argv: list[str], needle: str) -> None:
    env = make_env()
    code = run(["simulate", "--trace", str(FIXTURE), *argv], env)
    assert code == ExitStatus.USAGE
    assert needle in env.stderr.getvalue()  # type: ignore[attr-defined]


def test_command_refuses_groups_on_a_measured_profile(tmp_path: Path) -> None:
    costs = NodeCosts(StepCost(0.002, 2e-5, 0.0, 1e-4, 1e-7), 4096, 256, 32, (("n2", 5e8),))
    prof = tmp_path / "status.json"
    prof.write_text(json.dumps({"conductor": {"costs": costs.to_json()}}))
    env = make_env()
    argv = ["simulate", "--trace", str(FIXTURE), "--prefill", "2", "--decode", "1"]
    code = run([*argv, "--cpp", "2", "--profile", str(prof)], env)
    assert code == ExitStatus.USAGE
    assert "needs a --preset" in env.stderr.getvalue()  # type: ignore[attr-defined]
