"""``mooncakectl simulate``: replay a trace on a simulated cluster.

One run, or one per policy x early-rejection variant given (a comparison
table), or ``--sweep``: cluster shapes tried smallest first, printing the
smallest that meets the SLOs at the trace's rate (a capacity plan), or
``--against-cluster``: the simulation beside a real loopback cluster
replaying the same slice (``against``).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from rich.console import Console
from rich.table import Table

from mooncakectl.bench.replay import add_cluster_arguments
from mooncakectl.bench.report import write_result
from mooncakectl.bench.trace import (
    TraceRecord,
    add_scale_arguments,
    add_slice_arguments,
    read_trace,
    slice_from_args,
)
from mooncakectl.bench.workloads import TraceScale
from mooncakectl.flags import number_list
from mooncakectl.registry import Env, ExitStatus, command
from mooncakectl.simulate import against, memory_report
from mooncakectl.simulate.cluster import Shape, SimConfig, SimResult, Simulation, trace_requests
from mooncakectl.simulate.costs import (
    GB,
    PRESETS,
    NodeSpec,
    preset_node,
    preset_stage_model,
    profile_node,
)
from mooncakectl.simulate.memory import MEMORY_PRESETS, offloaded_node
from mooncakectl.simulate.results import SimSummary, false_rejections, result_json, sim_summary
from mooncaked.cluster.placement import ConductorParams, EarlyReject, Policy
from mooncaked.cluster.slo import Slo

DEFAULT_PRESET = "llama3-70b-8xa800"


def _csv(kind: type[Policy] | type[EarlyReject], text: str, flag: str) -> list[Any]:
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            out.append(kind(part))
        except ValueError:
            known = ", ".join(v.value for v in kind)
            raise ValueError(f"{flag}: unknown value {part!r}; known: {known}") from None
    return out


def _ints(text: str, flag: str, minimum: int = 1) -> list[int]:
    return number_list(text, flag, int, "an integer", lambda v: v >= minimum, f"is below {minimum}")


def _floats(text: str, flag: str) -> list[float]:
    return number_list(text, flag, float, "a number", lambda v: v > 0, "must be > 0")


def parse_ratio(text: str) -> tuple[int, int] | None:
    """``"1:1"`` -> (1, 1) prefill:decode; ``"both"`` -> None (colocated nodes)."""
    if text.strip() == "both":
        return None
    p, sep, d = text.partition(":")
    try:
        ratio = (int(p), int(d))
    except ValueError:
        ratio = (-1, -1)
    if not sep or ratio[0] < 1 or ratio[1] < 1:
        raise ValueError(f"--sweep-ratios: {text!r} is not P:D (two integers >= 1) or 'both'")
    return ratio


def shape_for(ratio: tuple[int, int] | None, nodes: int) -> Shape | None:
    """``nodes`` split by ``ratio`` (None if it cannot hold one of each)."""
    if ratio is None:
        return Shape(num_both=nodes)
    p, d = ratio
    num_p = round(nodes * p / (p + d))
    num_p = min(max(num_p, 1), nodes - 1)
    if num_p < 1 or nodes - num_p < 1:
        return None
    return Shape(num_prefill=num_p, num_decode=nodes - num_p)


def _configure(p: argparse.ArgumentParser) -> None:
    _configure_trace(p.add_argument_group("trace"))
    _configure_cluster(p.add_argument_group("cluster"))
    _configure_conductor(p.add_argument_group("conductor"))
    w = p.add_argument_group("capacity plan")
    w.add_argument(
        "--sweep", action="store_true", help="find the smallest cluster meeting the SLOs"
    )
    w.add_argument("--sweep-nodes", default="2,4,6,8,12,16,24,32", help="node counts to try")
    w.add_argument("--sweep-ratios", default="1:1,1:2,2:1", help="P:D ratios, or 'both'")
    w.add_argument("--sweep-dram-gb", help="DRAM sizes per node to try, GB (default: --dram-gb)")
    w.add_argument(
        "--target", type=float, default=0.9, help="SLO attainment a cluster must reach (0..1]"
    )
    a = p.add_argument_group(
        "against a real cluster",
        "--against-cluster: the slice also replayed on loopback daemons (2 prefill + 1 decode "
        "unless --prefill/--decode say), simulated on the costs they measured, the two side by "
        "side. Its defaults: --trace-count 100, --trace-block-tokens 16, --output-scale 0.25, "
        "--time-scale 2, --slo-ttft 2, --host-cores: this machine's",
    )
    a.add_argument("--against-cluster", action="store_true", help="real vs simulated")
    add_cluster_arguments(a)
    a.add_argument("--block-size", type=int, default=16, help="the daemons' kv.block_size")
    o = p.add_argument_group("output")
    o.add_argument("--result-json", help="write the summaries and every request here")
    o.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")


def _configure_trace(t: argparse._ArgumentGroup) -> None:
    t.add_argument("--trace", required=True, metavar="FILE", help="Mooncake trace (JSON lines)")
    add_slice_arguments(t)
    # None: settled by --against-cluster (_settle_defaults).
    add_scale_arguments(t, block_tokens=None, output_scale=None, time_scale=None)
    t.add_argument("--speed", type=float, help="request rate x SPEED (= --time-scale 1/SPEED)")
    t.add_argument("--max-model-len", type=int, help="clip prompt + output as the bench does")


def _configure_cluster(c: argparse._ArgumentGroup) -> None:
    c.add_argument("--prefill", type=int, default=0, help="prefill nodes")
    c.add_argument("--decode", type=int, default=0, help="decode nodes")
    c.add_argument("--both", type=int, default=0, help="colocated (prefill + decode) nodes")
    c.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help=f"analytic cost model of a node (default: {DEFAULT_PRESET})",
    )
    c.add_argument(
        "--profile", metavar="FILE", help="a node's measured costs: GET /admin/status as JSON"
    )
    c.add_argument(
        "--decode-profile",
        metavar="FILE",
        help="decode nodes' measured costs, where they differ from --profile's",
    )
    c.add_argument("--nic-gbps", type=float, help="NIC bandwidth per node, Gbit/s, all NICs")
    c.add_argument("--dram-gb", type=float, help="KV cache DRAM per node, GB")
    c.add_argument("--ssd-gb", type=float, default=0.0, help="SSD tier per node, GB (0: none)")
    c.add_argument("--ssd-gbps", type=float, default=32.0, help="SSD read Gbit/s")
    c.add_argument("--kv-tokens", type=int, help="decode KV capacity per node, tokens")
    c.add_argument("--gossip-ms", type=float, default=200.0, help="age of an entry's view")
    c.add_argument(
        "--entries",
        type=int,
        default=0,
        help="nodes requests enter at (0: every node, as in the daemon; 1: a single entry)",
    )
    c.add_argument(
        "--host-cores",
        type=float,
        default=0.0,
        help="all nodes share one machine of this many cores, as a loopback cluster does "
        "(0: a machine each)",
    )
    c.add_argument(
        "--node-threads", type=int, default=1, help="cores a node's step keeps busy (--host-cores)"
    )
    c.add_argument(
        "--cpp",
        default="0",
        help="prefill nodes in pipelined groups of this many stages (chunked pipeline "
        "parallelism; 0: none); a comma-separated list runs each, e.g. 0,2",
    )
    c.add_argument(
        "--cpp-chunk",
        type=int,
        default=512,
        help="tokens in a pipelined prompt's first chunk (the head's [pipeline] chunk_tokens)",
    )
    memory_report.add_arguments(c)


def _configure_conductor(s: argparse._ArgumentGroup) -> None:
    defaults = ConductorParams()
    s.add_argument(
        "--policy",
        default=Policy.CONDUCTOR.value,
        help="one or more of " + ",".join(v.value for v in Policy) + " (comma-separated)",
    )
    s.add_argument(
        "--early-reject",
        default=EarlyReject.PREDICTED.value,
        help="one or more of " + ",".join(v.value for v in EarlyReject),
    )
    s.add_argument("--slo-ttft", type=float, help="TTFT SLO, seconds (0: none; default 30)")
    s.add_argument("--slo-tbt", type=float, default=100.0, help="TBT SLO, ms (0: none)")
    s.add_argument("--balancing-threshold", type=float, default=defaults.balancing_threshold)
    s.add_argument("--max-replicas", type=int, default=defaults.max_replicas)
    s.add_argument("--bind-slack", type=float, default=defaults.bind_slack)
    s.add_argument(
        "--best-effort-wait",
        type=float,
        default=defaults.best_effort_wait,
        help="a request whose own prefill misses the TTFT SLO is served if it waits no "
        "longer than this share of the SLO (0: rejected)",
    )
    s.add_argument("--max-prefill", type=int, default=defaults.max_prefill)
    # How entries spread their choices (``ranking.spread``).
    for flag, default, text in (
        (
            "--spread",
            defaults.spread,
            "candidates within this share of the best predicted TTFT are picked at random",
        ),
        ("--spread-min-ms", defaults.spread_min * 1e3, "... or within this many ms of it"),
        (
            "--decode-spread",
            defaults.decode_spread,
            "decode candidates within this share of the best predicted TBT, likewise",
        ),
    ):
        s.add_argument(flag, type=float, default=default, help=text)
    s.add_argument(
        "--late-binding",
        choices=("on", "off"),
        default="on" if defaults.late_binding else "off",
        help="a prefill node whose true queue is longer than the entry thought passes "
        "the request on to the next candidate",
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--false-rejections",
        choices=("on", "off"),
        default="on",
        help="also run without rejection (same seed and options) to count the requests "
        "each mode rejected that would have met both SLOs",
    )


def _settle_defaults(args: argparse.Namespace) -> None:
    """The defaults that depend on ``--against-cluster`` (whose real cluster
    replays a slice sized for this machine), and ``--speed`` as a time scale."""
    against = args.against_cluster
    if args.time_scale is not None and args.speed is not None:
        raise ValueError("give --time-scale or --speed, not both")
    if args.speed is not None and not args.speed > 0:
        raise ValueError(f"--speed must be > 0, got {args.speed}")
    if args.time_scale is None:
        args.time_scale = 1.0 / args.speed if args.speed is not None else (2.0 if against else 1.0)
    if args.trace_block_tokens is None:
        args.trace_block_tokens = 16 if against else 512
    if args.output_scale is None:
        args.output_scale = 0.25 if against else 1.0
    if args.slo_ttft is None:
        args.slo_ttft = 2.0 if against else 30.0
    if not against:
        return
    if args.cpp != "0":
        raise ValueError("--against-cluster starts no pipelined groups: not --cpp")
    if args.both:
        raise ValueError("--against-cluster starts prefill and decode daemons: not --both")
    if not args.prefill and not args.decode:
        args.prefill, args.decode = 2, 1
    if args.prefill < 1 or args.decode < 1:
        raise ValueError(
            f"--prefill and --decode must be >= 1, got {args.prefill} and {args.decode}"
        )
    if args.trace_count is None:
        args.trace_count = 100
    if args.host_cores == 0:
        args.host_cores = float(os.cpu_count() or 1)
    if not args.host_cores > 0:
        raise ValueError(f"--host-cores must be > 0, got {args.host_cores}")


@dataclass(slots=True)
class Inputs:
    records: list[TraceRecord]
    node: NodeSpec
    base: SimConfig
    policies: list[Policy]
    rejects: list[EarlyReject]
    # Stages of the prefill nodes' pipelined groups, one run each (0: none).
    cpps: list[int]
    # Memory nodes serving the decode nodes' attention, one run each (0: none).
    memories: list[int]


def _node(args: argparse.Namespace, profile: str | None) -> NodeSpec:
    if profile and args.preset:
        raise ValueError("give --preset or --profile, not both")
    if args.nic_gbps is not None and not args.nic_gbps > 0:
        raise ValueError(f"--nic-gbps must be > 0, got {args.nic_gbps}")
    if profile:
        node = profile_node(profile, nic_gbps=args.nic_gbps)
    else:
        node = preset_node(args.preset or DEFAULT_PRESET)
        if args.nic_gbps is not None:
            node = replace(node, nic_bps=args.nic_gbps * 1e9 / 8)
    if args.dram_gb is not None:
        if args.dram_gb < 0:
            raise ValueError(f"--dram-gb must be >= 0, got {args.dram_gb}")
        node = replace(node, dram_bytes=args.dram_gb * GB)
    if args.ssd_gb < 0 or not args.ssd_gbps > 0:
        raise ValueError(
            f"--ssd-gb must be >= 0 and --ssd-gbps > 0, got {args.ssd_gb}, {args.ssd_gbps}"
        )
    node = replace(node, ssd_bytes=args.ssd_gb * GB, ssd_bps=args.ssd_gbps * 1e9 / 8)
    if args.kv_tokens is not None:
        if args.kv_tokens < 0:
            raise ValueError(f"--kv-tokens must be >= 0, got {args.kv_tokens}")
        node = replace(node, kv_capacity_tokens=args.kv_tokens)
    return node


def _inputs(args: argparse.Namespace) -> Inputs:
    policies = _csv(Policy, args.policy, "--policy")
    rejects = _csv(EarlyReject, args.early_reject, "--early-reject")
    scale = TraceScale(
        args.trace_block_tokens, args.input_scale, args.output_scale, args.time_scale
    )
    if args.slo_ttft < 0 or args.slo_tbt < 0:
        raise ValueError(
            f"SLOs must be >= 0, got --slo-ttft {args.slo_ttft} --slo-tbt {args.slo_tbt}"
        )
    if not 0 < args.target <= 1:
        raise ValueError(f"--target must be in (0, 1], got {args.target}")
    if args.max_replicas < 1:
        raise ValueError(f"--max-replicas must be >= 1, got {args.max_replicas}")
    node = _node(args, args.profile)
    decode_node = _node(args, args.decode_profile) if args.decode_profile else None
    cpps = _ints(args.cpp, "--cpp", minimum=0)
    if args.sweep and any(cpps):
        raise ValueError("--sweep tries shapes of single prefill nodes: not --cpp")
    shape = Shape(args.prefill, args.decode, args.both) if not args.sweep else Shape(num_both=1)
    stage_model = None
    if any(cpps) and not args.profile:
        stage_model = preset_stage_model(args.preset or DEFAULT_PRESET)
    records = read_trace(args.trace, slice_from_args(args))
    base = SimConfig(
        shape=shape,
        node=node,
        decode_node=decode_node,
        params=ConductorParams(
            balancing_threshold=args.balancing_threshold,
            max_replicas=args.max_replicas,
            spread=args.spread,
            spread_min=args.spread_min_ms / 1e3,
            decode_spread=args.decode_spread,
            late_binding=args.late_binding == "on",
            bind_slack=args.bind_slack,
            best_effort_wait=args.best_effort_wait,
            max_prefill=args.max_prefill,
        ),
        slo=Slo(args.slo_ttft, args.slo_tbt / 1000.0),
        gossip_s=args.gossip_ms / 1000.0,
        scale=scale,
        max_model_len=args.max_model_len,
        seed=args.seed,
        host_cores=args.host_cores,
        node_threads=args.node_threads,
        entries=args.entries,
        stage_model=stage_model,
        cpp_chunk_tokens=args.cpp_chunk,
    )
    for cpp in cpps:
        # Refused before any run: a count that does not fit names itself.
        replace(base, shape=replace(shape, cpp=cpp))
    memories = _ints(args.memory, "--memory", minimum=0) if args.memory else [0]
    for num_memory in memories:
        replace(shape, num_memory=num_memory)
    if any(memories):
        if args.profile or args.decode_profile or args.sweep:
            raise ValueError("--memory prices a --preset's model: not --profile or --sweep")
        if args.micro_batches < 1:
            raise ValueError(f"--micro-batches must be >= 1, got {args.micro_batches}")
    return Inputs(records, node, base, policies, rejects, cpps, memories)


def _decode_node(args: argparse.Namespace, inp: Inputs, num_memory: int) -> NodeSpec | None:
    """The decode nodes' spec with ``num_memory`` memory nodes striped over them."""
    if num_memory == 0:
        return inp.base.decode_node
    return offloaded_node(
        inp.node,
        args.preset or DEFAULT_PRESET,
        MEMORY_PRESETS[args.memory_preset],
        num_memory / args.decode,
        micro_batches=args.micro_batches,
    )


def _print_costs(
    args: argparse.Namespace, env: Env, inp: Inputs, results: Sequence[SimResult]
) -> None:
    """Decode throughput per cost of each ``--memory`` run (``memory_report``)."""
    preset = PRESETS[args.preset or DEFAULT_PRESET]
    usd = memory_report.prices(args, preset.hardware.name)
    sc = inp.base.scale
    mean_context = sum(
        r.input_length * sc.effective_input_scale + r.output_length * sc.output_scale / 2
        for r in inp.records
    ) / len(inp.records)
    rows = []
    for res in results:
        node = res.config.decode_node or inp.node
        rows.append(memory_report.cost_row(res, node, usd, mean_context))
    title = (
        f"decode throughput per cost: {args.preset or DEFAULT_PRESET} decode nodes at "
        f"${usd[0]:.2f}/h, {args.memory_preset} memory nodes at ${usd[1]:.2f}/h, "
        f"TBT SLO {inp.base.slo.tbt_s * 1e3:g} ms, mean context {mean_context:.0f} tokens"
    )
    _print_table(env, memory_report.cost_table(rows, title))


def _run(cfg: SimConfig, records: Sequence[TraceRecord]) -> tuple[SimResult, SimSummary]:
    res = Simulation(cfg, trace_requests(records, cfg.scale, cfg.max_model_len)).run()
    return res, sim_summary(res)


def _fmt(v: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def print_runs(env: Env, summaries: Sequence[SimSummary], title: str) -> None:
    table = Table(title=title, title_justify="left")
    for name in (
        "cluster",
        "policy",
        "early rej.",
        "TTFT mean ms",
        "p90",
        "p99",
        "TBT mean ms",
        "p99",
        "SLO att.",
        "of admitted",
        "goodput r/s",
        "rejected",
        "false rej.",
        "late fail",
        "hit local",
        "hit global",
        "moved GB",
        "sim s",
    ):
        table.add_column(name, justify="left" if name in ("cluster", "policy") else "right")
    for s in summaries:
        table.add_row(
            s.cluster,
            s.policy,
            s.early_reject,
            _fmt(s.ttft_ms["mean"]),
            _fmt(s.ttft_ms["p90"]),
            _fmt(s.ttft_ms["p99"]),
            _fmt(s.tbt_ms["mean"], digits=1),
            _fmt(s.tbt_ms["p99"], digits=1),
            f"{100 * s.slo_attainment:.1f}%",
            f"{100 * s.admitted_slo_attainment:.1f}%",
            f"{s.goodput:.2f}",
            str(s.rejected),
            "-" if s.false_rejections is None else str(s.false_rejections),
            str(s.late_failures),
            f"{100 * s.local_hit_rate:.1f}%",
            f"{100 * s.global_hit_rate:.1f}%",
            f"{sum(s.bytes_moved.values()) / GB:.0f}",
            f"{s.sim_wall_s:.1f}",
        )
    _print_table(env, table)


def _print_table(env: Env, table: Table) -> None:
    # Wide: a pipe or file gets every column unabridged.
    tty = env.stdout_isatty
    Console(
        file=env.stdout, force_terminal=tty, no_color=not tty, width=None if tty else 200
    ).print(table)


def print_buckets(env: Env, summaries: Sequence[SimSummary]) -> None:
    """TTFT by prompt length, a column pair per run: single prefill nodes
    and pipelined groups side by side (``--cpp 0,2``)."""
    table = Table(title="TTFT by prompt length, ms", title_justify="left")
    table.add_column("prompt tokens")
    table.add_column("requests", justify="right")
    rejected = any(b["served"] < b["requests"] for s in summaries for b in s.ttft_by_prompt)
    for s in summaries:
        run = f"{s.cluster} {s.policy} {s.early_reject}"
        table.add_column(f"{run}\nmean", justify="right")
        table.add_column("p90", justify="right")
        if rejected:
            table.add_column("served", justify="right")
    for i, b in enumerate(summaries[0].ttft_by_prompt if summaries else []):
        row = [b["bucket"], str(b["requests"])]
        for s in summaries:
            mine = s.ttft_by_prompt[i]
            row += [_fmt(mine["mean_ms"]), _fmt(mine["p90_ms"])]
            if rejected:
                row.append(str(mine["served"]))
        table.add_row(*row)
    _print_table(env, table)


def _config_json(args: argparse.Namespace, node: NodeSpec) -> dict[str, Any]:
    out = {k: v for k, v in vars(args).items() if k not in ("command", "admin_token", "url")}
    out["node"] = {
        "costs": node.costs.to_json(),
        "nic_bps": node.nic_bps,
        "dram_bytes": node.dram_bytes,
        "ssd_bytes": node.ssd_bytes,
        "kv_capacity_tokens": node.kv_capacity_tokens,
    }
    return out


def _sweep(args: argparse.Namespace, env: Env, inp: Inputs) -> int:
    counts = sorted(set(_ints(args.sweep_nodes, "--sweep-nodes")))
    ratios = [parse_ratio(r) for r in args.sweep_ratios.split(",")]
    drams = (
        _floats(args.sweep_dram_gb, "--sweep-dram-gb")
        if args.sweep_dram_gb
        else [inp.node.dram_bytes / GB]
    )
    params = replace(inp.base.params, policy=inp.policies[0], early_reject=inp.rejects[0])
    summaries: list[SimSummary] = []
    plan: list[tuple[int, float, str, SimSummary]] = []
    for dram in drams:
        for ratio in ratios:
            # Node counts smallest first: the first that meets the target is this shape's answer.
            for n in counts:
                shape = shape_for(ratio, n)
                if shape is None:
                    continue
                cfg = replace(
                    inp.base,
                    shape=shape,
                    params=params,
                    node=replace(inp.node, dram_bytes=dram * GB),
                )
                _, s = _run(cfg, inp.records)
                summaries.append(s)
                if not args.json:
                    env.stdout.write(
                        f"{shape.label():>10}  dram {dram:g} GB  SLO attainment "
                        f"{100 * s.slo_attainment:.1f}%\n"
                    )
                if s.slo_attainment >= args.target:
                    plan.append((shape.num_nodes, dram, shape.label(), s))
                    break
    plan.sort(key=lambda p: (p[0], p[1]))
    best = plan[0] if plan else None
    if args.json:
        env.stdout.write(
            json.dumps(
                {
                    "runs": [s.to_json() for s in summaries],
                    "smallest": None
                    if best is None
                    else {"nodes": best[0], "dram_gb": best[1], "cluster": best[2]},
                },
                indent=1,
            )
            + "\n"
        )
    else:
        print_runs(env, summaries, "sweep")
        rate = len(inp.records) / max(
            1e-9,
            (inp.records[-1].timestamp_ms - inp.records[0].timestamp_ms)
            / 1000.0
            * inp.base.scale.time_scale,
        )
        if best is None:
            env.stdout.write(
                f"no cluster tried meets {100 * args.target:.0f}% SLO attainment at "
                f"{rate:.2f} req/s; try more nodes (--sweep-nodes)\n"
            )
        else:
            env.stdout.write(
                f"smallest cluster meeting {100 * args.target:.0f}% SLO attainment at "
                f"{rate:.2f} req/s: {best[2]} ({best[0]} nodes, {best[1]:g} GB DRAM each, "
                f"{100 * best[3].slo_attainment:.1f}%)\n"
            )
    if args.result_json:
        write_result(
            args.result_json,
            {
                "format": "mooncakectl-simulate-sweep/1",
                "config": _config_json(args, inp.node),
                "runs": [s.to_json() for s in summaries],
            },
        )
    return ExitStatus.OK if best is not None else ExitStatus.ERROR


def _runs(args: argparse.Namespace, inp: Inputs) -> tuple[list[SimResult], list[SimSummary]]:
    """One run per pipelined-group size x policy x early-rejection mode asked for."""
    results: list[SimResult] = []
    summaries: list[SimSummary] = []
    shapes = [(cpp, m) for cpp in inp.cpps for m in inp.memories]
    for cpp, num_memory in shapes:
        base = replace(
            inp.base,
            shape=replace(inp.base.shape, cpp=cpp, num_memory=num_memory),
            decode_node=_decode_node(args, inp, num_memory),
        )
        for policy in inp.policies:
            runs: dict[EarlyReject, tuple[SimResult, SimSummary]] = {}
            # Rejection off first: the reference each other mode's false
            # rejections are counted against (run even when not asked for).
            modes = [EarlyReject.OFF, *(r for r in inp.rejects if r is not EarlyReject.OFF)]
            if modes == [EarlyReject.OFF] or args.false_rejections == "off":
                modes = list(inp.rejects)
            for reject in modes:
                params = replace(base.params, policy=policy, early_reject=reject)
                runs[reject] = _run(replace(base, params=params), inp.records)
            reference = runs.get(EarlyReject.OFF)
            for reject in inp.rejects:
                res, s = runs[reject]
                if reference is not None and reject is not EarlyReject.OFF:
                    s.false_rejections = false_rejections(res, reference[0])
                results.append(res)
                summaries.append(s)
    return results, summaries


@command("simulate", "simulate a cluster on a trace with the Conductor's own code", _configure)
def simulate(args: argparse.Namespace, env: Env) -> int:
    _settle_defaults(args)
    if args.against_cluster:
        return against.command(args, env, read_trace(args.trace, slice_from_args(args)))
    inp = _inputs(args)
    if args.sweep:
        return _sweep(args, env, inp)
    results, summaries = _runs(args, inp)
    if args.json:
        env.stdout.write(json.dumps([s.to_json() for s in summaries], indent=1) + "\n")
    else:
        print_runs(
            env,
            summaries,
            f"{len(inp.records)} requests, x{inp.base.speed:g} speed, SLO TTFT "
            f"{inp.base.slo.ttft_s:g} s, TBT {inp.base.slo.tbt_s * 1e3:g} ms",
        )
        print_buckets(env, summaries)
        if args.memory:
            _print_costs(args, env, inp, results)
    if args.result_json:
        write_result(
            args.result_json, result_json(_config_json(args, inp.node), summaries, results)
        )
    if args.plot:
        from mooncakectl.simulate.plot import write_plots

        for path in write_plots(results, summaries, args.plot):
            env.stderr.write(f"wrote {path}\n")
    return ExitStatus.OK
