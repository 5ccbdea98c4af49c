"""``mooncakectl simulate``: hand-computed timelines on tiny traces, the real
Conductor deciding, and the command's outputs and failures."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest

import mooncakectl.simulate.cluster as cluster_mod
import mooncaked.cluster.conductor as conductor_mod
from mooncakectl.bench.trace import TraceRecord
from mooncakectl.bench.workloads import TraceScale
from mooncakectl.cli import run
from mooncakectl.registry import Env, ExitStatus
from mooncakectl.simulate.cache import DRAM_MASK, SSD_MASK, BlockCache
from mooncakectl.simulate.cluster import Shape, SimConfig, SimResult, simulate, trace_requests
from mooncakectl.simulate.command import parse_ratio, shape_for
from mooncakectl.simulate.costs import (
    LLAMA3_70B,
    PRESETS,
    NodeSpec,
    analytic_step_cost,
    costs_from_json,
    preset_node,
)
from mooncakectl.simulate.events import EventQueue
from mooncakectl.simulate.network import Flow, Network
from mooncakectl.simulate.node import SimRequest
from mooncakectl.simulate.results import sim_summary
from mooncaked.cluster.costs import NodeCosts, StepCost, StepFeatures, prefill_pairs
from mooncaked.cluster.placement import ConductorParams, EarlyReject, Policy
from mooncaked.cluster.slo import Slo, tbt_s

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "conversation_trace_head200.jsonl"
# Tokens per hash id in the hand-made traces.
BS = 100


def make_env() -> Env:
    return Env(stdout=io.StringIO(), stderr=io.StringIO(), environ={}, stdout_isatty=False)


def node(*, chunk: int, nic_bps: float = 1e9, max_batch: int = 8) -> NodeSpec:
    # 10 ms a step, 1 ms a prompt token, 2 ms a decode; 1000 bytes of KV a token.
    costs = NodeCosts(
        StepCost(base_s=0.01, token_s=0.001, seq_s=0.002),
        kv_bytes_per_token=1000,
        chunk_tokens=chunk,
        max_batch=max_batch,
    )
    return NodeSpec(costs, nic_bps=nic_bps, dram_bytes=1e9)


def exact(**kw: object) -> ConductorParams:
    """Every choice the best alone, ties by node id, and no late binding:
    the hand-computed timelines below follow one order."""
    base: dict[str, object] = {
        "spread": 0.0,
        "decode_spread": 0.0,
        "late_binding": False,
        "best_effort_wait": 0.0,
    }
    return ConductorParams(**(base | kw))  # type: ignore[arg-type]


def rec(line: int, ms: float, tokens: int, out: int, ids: list[int]) -> TraceRecord:
    return TraceRecord(line, ms, tokens, out, tuple(ids))


def run_sim(
    records: list[TraceRecord],
    shape: Shape,
    spec: NodeSpec,
    policy: Policy = Policy.LOAD_BALANCE,
    early_reject: EarlyReject = EarlyReject.OFF,
    slo: Slo | None = None,
    host_cores: float = 0.0,
) -> SimResult:
    cfg = SimConfig(
        shape,
        spec,
        params=exact(policy=policy, early_reject=early_reject),
        slo=slo or Slo(),
        gossip_s=0.0,
        scale=TraceScale(block_tokens=BS, input_scale=1.0),
        host_cores=host_cores,
    )
    return simulate(cfg, records)


# ------------------------------------------------------------ hand-computed timelines


def chunked_trace() -> list[TraceRecord]:
    return [
        rec(1, 0, 1000, 3, list(range(1, 11))),
        rec(2, 500, 500, 1, list(range(101, 106))),
        # Shares A's first five blocks.
        rec(3, 2000, 800, 1, [1, 2, 3, 4, 5, 201, 202, 203]),
    ]


def test_chunked_prefill_ttft_tbt_and_cache_hit_by_hand() -> None:
    res = run_sim(chunked_trace(), Shape(1, 1), node(chunk=400))
    a, b, c = res.requests
    # A: steps of 400, 400 tokens (0.41 s each); B arrives during the second;
    # the third step carries A's last 200 and B's first 200: A's first token at 1.23.
    assert a.ttft_s == pytest.approx(1.23)
    # B: its last 300 tokens in a step of its own, 1.23 -> 1.54, arrived at 0.5.
    assert b.ttft_s == pytest.approx(1.04)
    # C: five blocks of A's prompt in p0's cache; 300 tokens left, one step.
    assert c.local_cached_tokens == 500 and c.fetched_tokens == 0
    assert c.ttft_s == pytest.approx(0.31)
    # A decodes two more tokens on d0 at batch 1: 10 ms + 2 ms a step. Its KV
    # (1 MB at 1 GB/s) arrived long before its prefill ended.
    assert (a.prefill_node, a.decode_node) == ("p0", "d0")
    assert a.done_s == pytest.approx(1.23 + 2 * 0.012)
    assert a.tbt_s == pytest.approx(0.012)
    assert b.done_s == pytest.approx(1.54) and c.done_s == pytest.approx(2.31)
    s = sim_summary(res)
    assert s.completed == 3 and s.rejected == 0
    assert s.local_hit_rate == pytest.approx(500 / 2300)
    # KV moved to d0 for A only (B and C produce one token, on the prefill node).
    assert s.bytes_moved == {"kv": 1000 * 1000}


def test_early_rejection_on_the_ttft_slo_only_when_enabled() -> None:
    # A's predicted TTFT on an idle node is 0.41 + 0.41 + 0.21 = 1.03 s.
    slo = Slo(ttft_s=1.0)
    off = run_sim(chunked_trace(), Shape(1, 1), node(chunk=400), slo=slo)
    assert [r.reject_code for r in off.requests] == [None, None, None]
    on = run_sim(
        chunked_trace(), Shape(1, 1), node(chunk=400), early_reject=EarlyReject.CURRENT, slo=slo
    )
    assert [r.reject_code for r in on.requests] == ["ttft_slo", None, None]
    # Without A ahead of it, B runs alone: steps of 400 and 100 tokens, 0.52 s;
    # and C finds nothing cached: 400 + 400 tokens, 0.82 s.
    assert on.requests[1].ttft_s == pytest.approx(0.52)
    assert on.requests[2].ttft_s == pytest.approx(0.82)
    s = sim_summary(on)
    assert s.rejected == 1 and s.rejections == {"ttft_slo": 1}
    # B and C met the 1 s SLO; A was rejected: two of three, both admitted.
    assert s.slo_attainment == pytest.approx(2 / 3)
    assert s.admitted_slo_attainment == 1.0


def test_a_request_over_the_slo_even_alone_is_served_when_it_need_not_wait() -> None:
    # A alone would take 1.03 s, over a 1 s SLO wherever it ran: rejected, a
    # retry would fail the same way. Served as well as can be instead (a
    # late failure), it leaves its prefix cached for C; B, behind it, would
    # wait past the SLO and is rejected as before.
    slo = Slo(ttft_s=1.0)
    cfg = SimConfig(
        Shape(1, 1),
        node(chunk=400),
        params=exact(early_reject=EarlyReject.CURRENT, best_effort_wait=0.1),
        slo=slo,
        gossip_s=0.0,
        scale=TraceScale(block_tokens=BS, input_scale=1.0),
    )
    res = simulate(cfg, chunked_trace())
    assert [r.reject_code for r in res.requests] == [None, "ttft_slo", None]
    assert res.requests[0].ttft_s == pytest.approx(1.03)
    assert res.requests[2].local_cached_tokens == 500
    s = sim_summary(res)
    assert s.late_failures == 1 and s.rejected == 1


def fetch_trace() -> list[TraceRecord]:
    return [
        rec(1, 0, 1000, 1, list(range(1, 11))),
        rec(2, 1100, 800, 1, list(range(1001, 1009))),
        # A's ten blocks and five of its own.
        rec(3, 1500, 1500, 1, [*range(1, 11), *range(2001, 2006)]),
    ]


def test_policies_place_by_their_own_rules_by_hand() -> None:
    # Unchunked prefill (one step a prompt); NICs of 100 MB/s.
    spec = node(chunk=0, nic_bps=1e8)
    shape = Shape(2, 1)
    # R1 runs on p0 (every tie goes to the first node id), 0 -> 1.01, and
    # leaves its ten blocks in p0's cache; R2 keeps p0 busy 1.1 -> 1.91.
    # R3 at 1.5:
    # - local_cache: p0 = queue 0.81 + 500 uncached tokens 0.51 = 1.32 s
    #   beats p1's 1.51 s: it waits for R2 on p0 and starts at 1.91: TTFT 0.92;
    lc = run_sim(fetch_trace(), shape, spec, Policy.LOCAL_CACHE).requests[2]
    assert (lc.prefill_node, lc.local_cached_tokens, lc.fetched_tokens) == ("p0", 1000, 0)
    assert lc.ttft_s == pytest.approx(0.92)
    # - load_balance: the shortest queue, p1, computes all 1500 tokens: 1.51 s;
    lb = run_sim(fetch_trace(), shape, spec, Policy.LOAD_BALANCE).requests[2]
    assert (lb.prefill_node, lb.local_cached_tokens, lb.fetched_tokens) == ("p1", 0, 0)
    assert lb.ttft_s == pytest.approx(1.51)
    # - conductor: p1 fetches the ten blocks from p0 (5 ms lease + 1 MB at
    #   100 MB/s) and computes 500 tokens: 0.015 + 0.51 = 0.525 s, as predicted.
    res = run_sim(fetch_trace(), shape, spec, Policy.CONDUCTOR)
    cd = res.requests[2]
    assert (cd.prefill_node, cd.local_cached_tokens, cd.fetched_tokens) == ("p1", 0, 1000)
    assert cd.ttft_s == pytest.approx(0.525)
    assert cd.predicted_ttft_s == pytest.approx(0.525)
    s = sim_summary(res)
    assert s.global_hit_rate == pytest.approx(1000 / 3300) and s.local_hit_rate == 0.0
    assert s.bytes_moved["fetch"] == 1000 * 1000


def test_the_simulation_runs_the_daemons_conductor(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every tie among prefill nodes goes to p0 ...
    before = run_sim(fetch_trace(), Shape(2, 1), node(chunk=0), Policy.LOAD_BALANCE)
    assert [r.prefill_node for r in before.requests] == ["p0", "p0", "p1"]
    # ... until the Conductor's own ordering changes: the simulation follows it.
    order = conductor_mod.order_prefill
    monkeypatch.setattr(
        conductor_mod, "order_prefill", lambda *a, **k: list(reversed(order(*a, **k)))
    )
    after = run_sim(fetch_trace(), Shape(2, 1), node(chunk=0), Policy.LOAD_BALANCE)
    assert [r.prefill_node for r in after.requests] == ["p1", "p1", "p1"]


def test_colocated_nodes_serve_what_enters_them() -> None:
    res = run_sim(chunked_trace(), Shape(num_both=3), node(chunk=400))
    for r in res.requests:
        assert r.prefill_node == r.decode_node == r.entry
    assert sim_summary(res).bytes_moved == {}


def test_trace_requests_scale_and_clip_as_the_bench_does() -> None:
    records = [rec(1, 1000, 1024, 10, [7, 8]), rec(2, 3000, 600, 4, [7, 9])]
    reqs = trace_requests(records, TraceScale(block_tokens=16, time_scale=0.5), max_model_len=20)
    # 1024 tokens of 512-token ids -> 32 tokens of 16-token ids, clipped to
    # 20 with the output: the prompt keeps 10 (its first block and a part).
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in reqs] == [(10, 10), (16, 4)]
    assert [len(r.hashes) for r in reqs] == [1, 1]
    assert [r.arrival_s for r in reqs] == [0.0, 1.0]
    assert reqs[0].hashes[0] == reqs[1].hashes[0]


# ----------------------------------------------------------------- parts


def test_flows_share_a_nic() -> None:
    events = EventQueue()
    net = Network(events, {"a": 1e8, "b": 1e8, "c": 1e8})
    done: dict[str, float] = {}

    def mark(f: Flow) -> None:
        done[f.tag] = events.now

    net.start("a", "b", 1e6, mark, "first")
    events.at(0.005, lambda _: net.start("a", "c", 1e6, mark, "second"))
    events.run()
    # Alone for 5 ms (half moved), then half the NIC each: 5 ms more for the
    # first's other half at 50 MB/s is 10 ms; the second then runs alone.
    assert done["first"] == pytest.approx(0.015)
    assert done["second"] == pytest.approx(0.020)
    assert net.bytes_moved == {"first": 1e6, "second": 1e6}


def test_flows_that_end_together_end_in_the_order_they_started() -> None:
    # Ties are settled by start order, not by where the flows sit in memory:
    # a run's results must not depend on what the process allocated before.
    # Flows are made at scattered addresses (objects freed in between), on
    # one NIC, equal in size, so all end at the same instant.
    for trial in range(5):
        events = EventQueue()
        net = Network(events, {"src": 1e8, **{f"d{i}": 1e8 for i in range(40)}})
        order: list[str] = []
        keep: list[object] = []
        for i in range(40):
            keep.append([object() for _ in range((i * 7 + trial) % 13)])
            if i % 3 == 0:
                keep.pop(0)
            net.start("src", f"d{i}", 1e6, lambda f, order=order: order.append(f.tag), f"f{i}")
        events.run()
        assert order == [f"f{i}" for i in range(40)], trial


def test_block_cache_lru_with_an_ssd_tier() -> None:
    cache = BlockCache(2, 1)
    cache.insert([b"a", b"b", b"c"])
    assert cache.prefix([b"a", b"b", b"c"], 3) == (3, 1)  # a went to SSD
    cache.use([b"a"])  # read back into DRAM; b, least recent, goes to SSD
    assert cache.take_changes() == {b"a": DRAM_MASK, b"b": SSD_MASK, b"c": DRAM_MASK}
    cache.insert([b"d"])  # c to SSD, b off the end
    assert cache.prefix([b"b"], 1) == (0, 0)
    assert cache.prefix([b"a", b"d", b"c"], 2) == (2, 0)
    assert cache.take_changes() == {b"c": SSD_MASK, b"b": 0, b"d": DRAM_MASK}
    assert cache.num_evicted == 1 and len(cache) == 3
    cache.check_integrity()
    with pytest.raises(ValueError, match="-1"):
        BlockCache(-1)


def test_slowest_tenth_of_gaps() -> None:
    assert tbt_s([0.01] * 18 + [0.1, 0.3]) == pytest.approx(0.2)
    assert tbt_s([0.05]) == pytest.approx(0.05)


def test_analytic_costs_follow_the_papers_formula() -> None:
    m = LLAMA3_70B
    assert m.kv_bytes_per_token == 80 * 2 * 8192 // 8 * 2 == 327_680
    hw = PRESETS["llama3-70b-8xa800"].hardware
    step = analytic_step_cost(m, hw)
    flops = hw.num_gpus * hw.gpu_flops * hw.compute_efficiency
    n, d = 4096, m.hidden_size
    # One step of n prompt tokens: layers x (4 n (n+1) d + 22 n d^2) flops,
    # n (n+1) being twice the (query, key) pairs.
    compute = step.step_s(StepFeatures(n, prefill_pairs(n, 0))) - step.base_s
    assert compute == pytest.approx(m.num_layers * (4 * n * (n + 1) * d + 22 * n * d * d) / flops)
    spec = preset_node("llama3-70b-8xa800")
    assert spec.nic_bps == pytest.approx(4 * 200e9 / 8)
    assert spec.kv_capacity_tokens > 1_000_000
    with pytest.raises(ValueError, match="llama-9000"):
        preset_node("llama-9000")


def test_profile_json_from_a_nodes_status() -> None:
    costs = NodeCosts(StepCost(0.002, 1e-5, 1e-9, 1e-4, 1e-7), 4096, 256, 32, (("n2", 5e8),))
    status = {"conductor": {"policy": "conductor", "costs": costs.to_json()}}
    assert costs_from_json(status) == costs
    assert costs_from_json(costs.to_json()) == costs
    with pytest.raises(ValueError, match="no cost model"):
        costs_from_json({"conductor": {}})
    bad = costs.to_json() | {"step": {"base_s": -1}}
    with pytest.raises(ValueError, match=r"step\.base_s"):
        costs_from_json(bad)
    with pytest.raises(ValueError, match="not fitted"):
        costs_from_json({"step": {}})


def test_sweep_shapes() -> None:
    assert parse_ratio("1:2") == (1, 2) and parse_ratio("both") is None
    with pytest.raises(ValueError, match="'3'"):
        parse_ratio("3")
    assert shape_for((1, 1), 4) == Shape(2, 2)
    assert shape_for((1, 2), 3) == Shape(1, 2)
    assert shape_for((3, 1), 2) == Shape(1, 1)
    assert shape_for(None, 3) == Shape(num_both=3)
    assert shape_for((1, 1), 1) is None


# ----------------------------------------------------------------- the command


def test_command_compares_policies_and_writes_json_and_plots(tmp_path: Path) -> None:
    env = make_env()
    out = tmp_path / "r.json"
    code = run(
        [
            "simulate",
            "--trace",
            str(FIXTURE),
            "--trace-count",
            "60",
            "--prefill",
            "2",
            "--decode",
            "1",
            "--policy",
            "random,conductor",
            "--early-reject",
            "off",
            "--result-json",
            str(out),
            "--plot",
            str(tmp_path / "plots"),
        ],
        env,
    )
    assert code == ExitStatus.OK, env.stderr.getvalue()  # type: ignore[attr-defined]
    text = env.stdout.getvalue()  # type: ignore[attr-defined]
    assert "random" in text and "conductor" in text and "2P+1D" in text
    data = json.loads(out.read_text())
    assert [r["summary"]["policy"] for r in data["runs"]] == ["random", "conductor"]
    for r in data["runs"]:
        assert r["summary"]["num_requests"] == 60 == len(r["requests"])
        assert r["summary"]["completed"] == 60
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {
        "latency_cdf.png",
        "throughput.png",
        "nodes.png",
    }


def test_command_sweep_prints_the_smallest_cluster() -> None:
    env = make_env()
    code = run(
        [
            "simulate",
            "--trace",
            str(FIXTURE),
            "--trace-count",
            "40",
            "--sweep",
            "--sweep-nodes",
            "2,4",
            "--sweep-ratios",
            "1:1,both",
            "--target",
            "0.5",
        ],
        env,
    )
    text = env.stdout.getvalue()  # type: ignore[attr-defined]
    assert code == ExitStatus.OK, env.stderr.getvalue()  # type: ignore[attr-defined]
    assert "smallest cluster meeting 50% SLO attainment" in text


def test_command_with_a_measured_profile(tmp_path: Path) -> None:
    costs = NodeCosts(StepCost(0.002, 2e-5, 0.0, 1e-4, 1e-7), 4096, 256, 32, (("n2", 5e8),))
    prof = tmp_path / "status.json"
    prof.write_text(json.dumps({"conductor": {"costs": costs.to_json()}}))
    env = make_env()
    code = run(
        [
            *("simulate", "--trace", str(FIXTURE), "--trace-count", "20", "--both", "2"),
            *("--profile", str(prof), "--trace-block-tokens", "16", "--json"),
        ],
        env,
    )
    assert code == ExitStatus.OK, env.stderr.getvalue()  # type: ignore[attr-defined]
    [summary] = json.loads(env.stdout.getvalue())  # type: ignore[attr-defined]
    assert summary["cluster"] == "2B" and summary["completed"] == 20


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--prefill", "1", "--decode", "1", "--policy", "fastest"], "'fastest'"),
        (["--prefill", "1", "--decode", "1", "--early-reject", "never"], "'never'"),
        (["--prefill", "2"], "none that can decode"),
        ([], "no node"),
        (["--both", "1", "--speed", "0"], "--speed"),
        (["--both", "1", "--profile", "/nonexistent/p.json"], "/nonexistent/p.json"),
        (["--both", "1", "--trace-count", "0"], "--trace-count"),
        (["--both", "1", "--host-cores", "-1"], "--host-cores"),
        (["--both", "1", "--host-cores", "2", "--node-threads", "0"], "--node-threads"),
        (["--both", "1", "--sweep", "--sweep-ratios", "2"], "'2'"),
    ],
)
def test_command_names_the_bad_value(argv: list[str], needle: str) -> None:
    env = make_env()
    code = run(["simulate", "--trace", str(FIXTURE), *argv], env)
    assert code == ExitStatus.USAGE
    assert needle in env.stderr.getvalue()  # type: ignore[attr-defined]


@pytest.mark.parametrize("shape", [Shape(2, 1), Shape(num_both=2)])
def test_decode_runs_give_the_step_by_step_timeline(shape: Shape) -> None:
    # One event per run of decode-only steps must change nothing but the event count.
    from mooncakectl.bench.trace import read_trace

    records = read_trace(FIXTURE)[:80]
    base = SimConfig(
        shape,
        node(chunk=256),
        params=exact(early_reject=EarlyReject.CURRENT),
        slo=Slo(ttft_s=5.0, tbt_s=0.02),
        scale=TraceScale(block_tokens=BS, input_scale=BS / 512, time_scale=0.2),
    )
    runs = simulate(base, records)
    steps = simulate(replace(base, coalesce_decode=False), records)
    assert runs.num_events < steps.num_events
    # Overloaded on purpose: decodes finish, and both SLOs reject some requests.
    assert sum(r.done_s is not None for r in runs.requests) >= 10
    assert {r.reject_code for r in runs.requests} >= {"ttft_slo", "tbt_slo"}
    for a, b in zip(runs.requests, steps.requests, strict=True):
        assert (a.prefill_node, a.decode_node, a.reject_code) == (
            b.prefill_node,
            b.decode_node,
            b.reject_code,
        )
        assert a.ttft_s == pytest.approx(b.ttft_s)
        assert a.tbt_s == pytest.approx(b.tbt_s)
        assert a.done_s == pytest.approx(b.done_s)


def test_a_decode_run_under_way_is_gossiped_as_its_steps_complete(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A decodes on one node from ~1.2 s on, in one run (nothing joins it: C
    # goes to the other, idle decode node). Ticks at 2 s (C) and 3 s (B)
    # must both show A's context as it is then, in runs as in steps.
    trace = [
        rec(1, 0, 1000, 400, list(range(1, 11))),
        rec(2, 2000, 100, 50, [101]),
        rec(3, 3000, 100, 50, [201]),
    ]
    seen: dict[bool, list[tuple[str, int]]] = {}
    arrive = cluster_mod.Simulation._arrive

    def spy(self: cluster_mod.Simulation, r: SimRequest) -> None:
        busiest = max(self._members.items(), key=lambda m: m[1].state.load.decode_context_tokens)
        seen[self.config.coalesce_decode].append(
            (busiest[0], busiest[1].state.load.decode_context_tokens)
        )
        arrive(self, r)

    monkeypatch.setattr(cluster_mod.Simulation, "_arrive", spy)
    base = SimConfig(
        Shape(1, 2),
        node(chunk=1000),
        gossip_s=0.0,
        scale=TraceScale(block_tokens=BS, input_scale=1.0),
    )
    for coalesce in (True, False):
        seen[coalesce] = []
        simulate(replace(base, coalesce_decode=coalesce), trace)
    assert seen[True] == seen[False]
    (_, c0), (n2, c2), (n3, c3) = seen[True]
    assert c0 == 0 and n2 == n3 and 1001 < c2 < c3 < 1400


def test_slow_kv_delays_the_first_token_and_decode_nodes_prefill_alone() -> None:
    # NICs of 0.5 MB/s: A's 1 MB of KV takes 2 s, longer than its 1.01 s of
    # compute (one step of 1000 tokens).
    res = run_sim(chunked_trace()[:1], Shape(1, 1), node(chunk=1000, nic_bps=5e5))
    [a] = res.requests
    assert a.ttft_s == pytest.approx(2.0)
    assert a.done_s == pytest.approx(2.0 + 2 * 0.012)
    # Decode nodes and nobody to prefill: the decode node computes the prompt.
    res = run_sim(chunked_trace(), Shape(0, 1), node(chunk=400))
    assert [r.prefill_node for r in res.requests] == ["d0", "d0", "d0"]
    assert all(r.done_s is not None for r in res.requests)


def test_entries_calibrate_their_forecasts_by_what_they_measured() -> None:
    # As the first half of the test above, one request every 5 s: each
    # waits 2 s for its KV against a forecast of its 1.01 s of compute. With
    # a 1.5 s TTFT SLO the forecast alone admits every one and every one
    # misses; the entry, once it has measured enough of them, forecasts
    # what it measured and rejects the rest.
    trace = [rec(i, 5000 * i, 1000, 3, [10 * i + k for k in range(10)]) for i in range(40)]
    res = run_sim(
        trace,
        Shape(1, 1),
        node(chunk=1000, nic_bps=5e5),
        early_reject=EarlyReject.CURRENT,
        slo=Slo(ttft_s=1.5),
    )
    admitted = [r for r in res.requests if r.reject_code is None]
    assert all(r.ttft_s == pytest.approx(2.0) for r in admitted)
    assert all(r.model_ttft_s == pytest.approx(1.01) for r in admitted)
    # Each entry (two: requests enter at either node) calibrates by its own.
    for entry in ("p0", "d0"):
        mine = [r for r in res.requests if r.entry == entry]
        served = [r.reject_code is None for r in mine]
        first_reject = served.index(False)
        assert first_reject >= 8 and not any(served[first_reject:])
        assert {r.reject_code for r in mine[first_reject:]} == {"ttft_slo"}


def test_nodes_on_one_host_share_its_cores_by_hand() -> None:
    spec = node(chunk=0)
    # Two 100-token prompts at once on two prefill nodes: 0.11 s each alone.
    pair = [rec(1, 0, 100, 1, [1]), rec(2, 0, 100, 1, [2])]
    own = run_sim(pair, Shape(2, 1), spec)
    assert [r.ttft_s for r in own.requests] == [pytest.approx(0.11)] * 2
    assert run_sim(pair, Shape(2, 1), spec, host_cores=2).requests[1].ttft_s == pytest.approx(0.11)
    # One core: the second step starts with the first under way and takes
    # twice as long; the first was priced alone when it started.
    one = run_sim(pair, Shape(2, 1), spec, host_cores=1)
    a, b = one.requests
    assert (a.prefill_node, b.prefill_node) == ("p0", "p1")
    assert (a.ttft_s, b.ttft_s) == (pytest.approx(0.11), pytest.approx(0.22))
    # Decode steps share too. A prefills alone (0 -> 0.11) and decodes two
    # tokens on d0; B, queued behind it on p0, prefills from 0.11 on. d0's
    # first step starts first (12 ms alone), its second beside B's prefill
    # (24 ms); B's prefill started beside d0's first step (0.22 s).
    seq = [rec(1, 0, 100, 3, [1]), rec(2, 100, 100, 1, [2])]
    res = run_sim(seq, Shape(1, 1), spec, host_cores=1)
    a, b = res.requests
    assert a.done_s == pytest.approx(0.11 + 0.012 + 0.024)
    assert a.tbt_s == pytest.approx(0.024)
    assert b.ttft_s == pytest.approx(0.11 + 0.22 - 0.1)
