"""The simulator against a real loopback cluster on the same slice of a trace.

    python tools/bench_simcheck.py --trace ../shared/data/traces/conversation_trace.jsonl
    python tools/bench_simcheck.py --trace T --count 100 --time-scale 2 --output-scale 0.25

A cluster of ``--prefill`` prefill + ``--decode`` decode ``python -m
mooncaked`` daemons (as ``bench_conductor.py`` starts them, one policy)
replays the records of the trace that the options select (``--start``,
``--count``, ``--from-s``, ``--until-s``, ``--conversations``) with
``mooncakectl bench trace``. The same records, sized and timed as the bench
sizes and times them, then go through ``mooncakectl simulate``'s
simulation of the same cluster shape, on the costs the real nodes measured:

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
simulated / real.

The machine may be shared and small: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_conductor import POLICIES, add_trace_args, run_policy, select_records

from mooncakectl.bench.workloads import TraceScale
from mooncakectl.simulate.cluster import Shape, SimConfig, Simulation, trace_requests
from mooncakectl.simulate.costs import NodeSpec, costs_from_json
from mooncakectl.simulate.results import latency_stats, summarize
from mooncaked.cluster.costs import StepCost
from mooncaked.cluster.placement import ConductorParams, EarlyReject, Policy
from mooncaked.cluster.slo import Slo, tbt_s

METRICS = (
    ("requests/s", "req_s", ".3f"),
    ("output tokens/s", "tok_s", ".1f"),
    ("mean TTFT ms", "ttft_mean", ".0f"),
    ("p50 TTFT ms", "ttft_p50", ".0f"),
    ("p90 TTFT ms", "ttft_p90", ".0f"),
    ("TBT ms (slowest 10%)", "tbt_mean", ".1f"),
    ("prompt from cache", "hit", ".3f"),
)


def real_figures(result: dict[str, Any]) -> dict[str, Any]:
    recs = [r for r in result["requests"] if not r.get("warmup")]
    done = [r for r in recs if r.get("error_kind") is None and r.get("chunk_s")]
    # As the simulator counts them (results.latency_stats, slo.tbt_s).
    ttft = latency_stats([r["chunk_s"][0] - r["start_s"] for r in done])
    tbt = latency_stats(
        [
            tbt_s([b - a for a, b in itertools.pairwise(r["chunk_s"])])
            for r in done
            if len(r["chunk_s"]) >= 2
        ]
    )
    start = min(r["start_s"] for r in recs)
    end = max(r["end_s"] for r in done)
    duration = max(end - start, 1e-9)
    tokens = sum(r.get("output_tokens") or len(r["chunk_s"]) for r in done)
    cached = sum(r.get("cached_tokens") or 0 for r in done)
    prompt = sum(r.get("prompt_tokens") or r.get("prompt_len") or 0 for r in done)
    return {
        "sent": len(recs),
        "completed": len(done),
        "req_s": len(done) / duration,
        "tok_s": tokens / duration,
        "ttft_mean": ttft["mean"],
        "ttft_p50": ttft["p50"],
        "ttft_p90": ttft["p90"],
        "tbt_mean": tbt["mean"],
        "cached_tokens": cached,
        # The engine's cached tokens: its own tiers' and what it fetched.
        "hit": cached / prompt if prompt else None,
    }


def _spec(docs: list[dict[str, Any]], args: argparse.Namespace, source: str) -> NodeSpec:
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
    prefill_docs: list[dict[str, Any]],
    decode_docs: list[dict[str, Any]],
    max_model_len: int | None,
    host_cores: float,
) -> dict[str, Any]:
    records = args.records
    scale = TraceScale(args.block_tokens, None, args.output_scale, args.time_scale)
    cfg = SimConfig(
        shape=Shape(args.prefill, args.decode),
        node=_spec(prefill_docs, args, "prefill"),
        decode_node=_spec(decode_docs, args, "decode"),
        params=ConductorParams(policy=Policy(args.policy), early_reject=EarlyReject.OFF),
        slo=Slo(args.slo_ttft_ms / 1e3, args.slo_tbt_ms / 1e3),
        gossip_s=0.1,
        scale=scale,
        max_model_len=max_model_len,
        host_cores=host_cores,
        node_threads=args.cpu_threads,
    )
    res = Simulation(cfg, trace_requests(records, scale, max_model_len)).run()
    s = summarize(res)
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


def print_table(real: dict[str, Any], sims: dict[str, dict[str, Any]]) -> None:
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
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    slo = {"ttft_s": args.slo_ttft_ms / 1e3, "tbt_s": args.slo_tbt_ms / 1e3}
    with tempfile.TemporaryDirectory(prefix="bench-simcheck-") as tmp:
        result = await run_policy(
            args,
            Path(tmp),
            args.policy,
            {"policy": args.policy, "early_reject": "off"},
            slo,
            args.time_scale,
        )
    before = result["status_before"]
    after = result["node_costs"]
    prefill_ids = [n for n, s in before.items() if s.get("role") == "prefill"]
    decode_ids = [n for n, s in before.items() if s.get("role") == "decode"]
    mml = args.max_model_len or result.get("max_model_len")
    real = real_figures(result)
    sims = {
        "start-up": sim_figures(
            args, [before[n] for n in prefill_ids], [before[n] for n in decode_ids], mml, 0.0
        ),
        "start-up, shared host": sim_figures(
            args,
            [before[n] for n in prefill_ids],
            [before[n] for n in decode_ids],
            mml,
            args.host_cores,
        ),
        "refit": sim_figures(
            args, [after[n] for n in prefill_ids], [after[n] for n in decode_ids], mml, 0.0
        ),
    }
    print(
        f"\n{args.prefill}P+{args.decode}D {args.model}, policy {args.policy}, {args.count} trace "
        f"records ({args.selection}), {args.block_tokens} tokens per hash id, "
        f"time scale {args.time_scale}, output scale {args.output_scale}; shared host: "
        f"{args.host_cores:g} cores, {args.cpu_threads} per node"
    )
    print(
        f"real: {real['completed']}/{real['sent']} completed, "
        f"{real['cached_tokens']} prompt tokens from cache"
    )
    print_table(real, sims)
    return {
        "args": {k: v for k, v in vars(args).items() if k not in ("lines", "records")},
        "real": real,
        "simulated": sims,
        "profiles": {"before": before, "after": after},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_trace_args(p, count=100, block_tokens=16, output_scale=0.25, time_scale=2.0)
    p.add_argument("--policy", choices=POLICIES, default="conductor")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--kv-blocks", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16, help="the daemons' kv.block_size")
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    p.add_argument("--dram-mb", type=int, default=256)
    p.add_argument("--max-model-len", type=int, help="default: as the bench clipped")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tbt-ms", type=float, default=100.0)
    p.add_argument(
        "--host-cores",
        type=float,
        default=float(os.cpu_count() or 1),
        help="cores the simulated nodes share (default: this machine's)",
    )
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args()
    if not Path(args.trace).is_file():
        p.error(f"--trace: no file {args.trace!r}")
    if not args.host_cores > 0:
        p.error(f"--host-cores must be > 0, got {args.host_cores}")
    select_records(p, args)
    args.entries = 1
    args.warmups = 0
    out = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
