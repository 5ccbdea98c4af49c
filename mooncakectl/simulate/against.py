"""``mooncakectl simulate --against-cluster``: the simulator against a real
loopback cluster on the same slice of a trace.

    mooncakectl simulate --against-cluster --trace ../shared/data/traces/conversation_trace.jsonl
    mooncakectl simulate --against-cluster --trace T --trace-count 100 --time-scale 2 \\
        --output-scale 0.25

A cluster of ``--prefill`` prefill + ``--decode`` decode ``python -m
mooncaked`` daemons (as ``bench policies`` starts them, one policy)
replays the records of the trace that the options select (the trace
options of ``mooncakectl bench trace``) with ``mooncakectl bench trace``.
The same records, sized and timed as the bench sizes and times them, then
go through the simulation of the same cluster shape, on the costs the real
nodes measured:

- ``start-up``: each node's profile as it stood before the replay (its
  start-up profiling), every node on a machine of its own;
- ``start-up, shared host``: the same costs, the nodes sharing this
  machine's cores as the real ones do (``--host-cores``, default every core
  of this machine; each step keeps ``--cpu-threads`` of them busy);
- ``refit``: each node's costs as it refitted them from the replay's own
  steps (the sharing of the cores is in what they measured).

Printed side by side: request and output throughput, mean, p50 and p90
TTFT, TBT (the mean of each request's slowest tenth of token gaps, as the
simulator and the Mooncake paper measure it; mean over requests), the
share of prompt tokens served from cache (own tiers and fetched), and
simulated / real. Both sides are summarized by ``mooncakectl bench``'s own
summary (``bench.metrics.summarize``).

The machine may be shared and small: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from mooncakectl.bench.metrics import run_duration_s, summarize
from mooncakectl.bench.policies_report import records_of
from mooncakectl.bench.replay import POLICIES, replay_spec, run_policy
from mooncakectl.bench.trace import TraceRecord, describe_slice, slice_from_args
from mooncakectl.bench.workloads import TraceScale
from mooncakectl.registry import Env, ExitStatus
from mooncakectl.simulate.cluster import Shape, SimConfig, Simulation, trace_requests
from mooncakectl.simulate.costs import NodeSpec, costs_from_json
from mooncakectl.simulate.results import sim_summary
from mooncaked.cluster.costs import StepCost
from mooncaked.cluster.placement import ConductorParams, EarlyReject, Policy
from mooncaked.cluster.slo import Slo

METRICS = (
    ("requests/s", "req_s", ".3f"),
    ("output tokens/s", "tok_s", ".1f"),
    ("mean TTFT ms", "ttft_mean", ".0f"),
    ("p50 TTFT ms", "ttft_p50", ".0f"),
    ("p90 TTFT ms", "ttft_p90", ".0f"),
    ("TBT ms (slowest 10%)", "tbt_mean", ".1f"),
    ("prompt from cache", "hit", ".3f"),
)
# The command line's own options, not the comparison's: left out of the figures.
_NOT_FIGURES = ("command", "url", "admin_token", "timeout", "json", "result_json", "plot")


def real_figures(result: dict[str, Any]) -> dict[str, Any]:
    """The replay's figures, as the simulator's are named."""
    records = records_of(result)
    s = summarize(
        records, run_duration_s(records), percentiles=(50.0, 90.0), metrics=("ttft", "tbt")
    )
    return {
        "sent": s.num_requests,
        "completed": s.completed,
        "req_s": s.request_throughput,
        "tok_s": s.output_throughput,
        "ttft_mean": s.latency_ms["ttft"]["mean"],
        "ttft_p50": s.latency_ms["ttft"]["p50"],
        "ttft_p90": s.latency_ms["ttft"]["p90"],
        "tbt_mean": s.latency_ms["tbt"]["mean"],
        "cached_tokens": s.cached_tokens or 0,
        # The engine's cached tokens: its own tiers' and what it fetched.
        "hit": s.cached_share,
    }


def node_spec(docs: list[dict[str, Any]], args: argparse.Namespace, source: str) -> NodeSpec:
    """One simulated node from the measured costs of the real nodes of a role:
    their step coefficients averaged (each fitted on its own)."""
    costs = [costs_from_json(d, source) for d in docs]
    columns = zip(*(c.step.coefficients() for c in costs), strict=True)
    step = StepCost(*(statistics.fmean(col) for col in columns))
    links = [bps for c in costs for _, bps in c.links]
    return NodeSpec(
        replace(costs[0], step=step, links=()),
        # Loopback links: the fastest a node measured stands for its NIC.
        nic_bps=max(links, default=1e9),
        dram_bytes=float(args.dram_mb << 20),
        kv_capacity_tokens=args.kv_blocks * args.block_size,
    )


def sim_figures(
    args: argparse.Namespace,
    records: list[TraceRecord],
    nodes: tuple[list[dict[str, Any]], list[dict[str, Any]]],
    max_model_len: int | None,
    host_cores: float,
) -> dict[str, Any]:
    """The simulation of the replayed slice on the costs of ``nodes``
    (prefill nodes' documents, decode nodes'), as ``real_figures`` names them."""
    scale = TraceScale(
        args.trace_block_tokens, args.input_scale, args.output_scale, args.time_scale
    )
    cfg = SimConfig(
        shape=Shape(args.prefill, args.decode),
        node=node_spec(nodes[0], args, "prefill"),
        decode_node=node_spec(nodes[1], args, "decode"),
        params=ConductorParams(policy=Policy(args.policy), early_reject=EarlyReject.OFF),
        slo=Slo(args.slo_ttft, args.slo_tbt / 1e3),
        gossip_s=0.1,
        scale=scale,
        max_model_len=max_model_len,
        host_cores=host_cores,
        node_threads=args.cpu_threads,
    )
    s = sim_summary(Simulation(cfg, trace_requests(records, scale, max_model_len)).run())
    return {
        "sent": s.num_requests,
        "completed": s.completed,
        "req_s": s.request_throughput,
        "tok_s": s.output_throughput,
        "ttft_mean": s.ttft_ms["mean"],
        "ttft_p50": s.ttft_ms["p50"],
        "ttft_p90": s.ttft_ms["p90"],
        "tbt_mean": s.tbt_ms["mean"],
        "hit": s.global_hit_rate,
        "prefill_busy": s.prefill_busy,
        "decode_busy": s.decode_busy,
    }


def print_table(real: dict[str, Any], sims: dict[str, dict[str, Any]], out: TextIO) -> None:
    head = ["", "real"]
    for name in sims:
        head += [name, "sim/real"]
    rows = [head]
    for label, key, spec in METRICS:
        row = [label, "-" if real[key] is None else format(real[key], spec)]
        for s in sims.values():
            v = s[key]
            row.append("-" if v is None else format(v, spec))
            row.append(f"{v / real[key]:.2f}" if v is not None and real[key] else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        out.write("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() + "\n")


def compare(
    args: argparse.Namespace, records: list[TraceRecord], result: dict[str, Any]
) -> dict[str, Any]:
    """The replay's ``result`` against the three simulations of it."""
    before = result["status_before"]
    after = result["node_costs"]
    prefill_ids = [n for n, s in before.items() if s.get("role") == "prefill"]
    decode_ids = [n for n, s in before.items() if s.get("role") == "decode"]
    mml = args.max_model_len or result.get("max_model_len")

    def docs(of: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        return [of[n] for n in prefill_ids], [of[n] for n in decode_ids]

    return {
        "real": real_figures(result),
        "simulated": {
            "start-up": sim_figures(args, records, docs(before), mml, 0.0),
            "start-up, shared host": sim_figures(args, records, docs(before), mml, args.host_cores),
            "refit": sim_figures(args, records, docs(after), mml, 0.0),
        },
        "profiles": {"before": before, "after": after},
    }


def command(args: argparse.Namespace, env: Env, records: list[TraceRecord]) -> int:
    """Replays ``records`` on a loopback cluster and simulates them; the table
    printed (to stderr with ``--json``, which prints the figures as JSON
    instead), and with ``--result-json`` every figure written there."""
    if args.policy not in POLICIES:
        raise ValueError(
            f"--policy: --against-cluster runs one of {list(POLICIES)}, not {args.policy!r}"
        )
    slo = {"ttft_s": args.slo_ttft, "tbt_s": args.slo_tbt / 1e3}
    conductor = {"policy": args.policy, "early_reject": "off"}
    with tempfile.TemporaryDirectory(prefix="simulate-against-") as tmp:
        spec = replay_spec(args, records, (args.slo_ttft * 1e3, args.slo_tbt))
        run = run_policy(
            spec, Path(tmp), args.policy, conductor, slo, args.time_scale, progress=env.stderr
        )
        result = asyncio.run(run)
    figures = compare(args, records, result)
    real = figures["real"]
    out = env.stderr if args.json else env.stdout
    out.write(
        f"\n{args.prefill}P+{args.decode}D {args.model}, policy {args.policy}, {len(records)} "
        f"trace records ({describe_slice(slice_from_args(args), records)}), "
        f"{args.trace_block_tokens} tokens per hash id, time scale {args.time_scale}, "
        f"output scale {args.output_scale}; shared host: {args.host_cores:g} cores, "
        f"{args.cpu_threads} per node\n"
    )
    out.write(
        f"real: {real['completed']}/{real['sent']} completed, "
        f"{real['cached_tokens']} prompt tokens from cache\n"
    )
    print_table(real, figures["simulated"], out)
    figures["args"] = {k: v for k, v in vars(args).items() if k not in _NOT_FIGURES}
    if args.json:
        env.stdout.write(json.dumps(figures, indent=1) + "\n")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(figures, indent=2))
    return ExitStatus.OK
