"""``mooncakectl bench policies``: the Conductor's policies side by side on a
loopback cluster replaying a trace.

    mooncakectl bench policies --trace ../shared/data/traces/conversation_trace.jsonl
    mooncakectl bench policies --trace T --trace-until-ms 600000 --trace-conversations 4/10 \\
        --trace-count 1000 --trace-block-tokens 128 --time-scale 0.1 --overload 3 --warmups 16
    mooncakectl bench policies --trace T --entries-compare 2 --repeats 3

Which records: the trace options of ``mooncakectl bench trace``
(``--trace-start``/``--trace-count`` of those in
``--trace-from-ms``..``--trace-until-ms`` and, with ``--trace-conversations
[R/]K``, only one conversation in K, every turn of it). Consecutive records
of the conversation trace share almost no prefix (a follow-up turn comes
minutes later), so a policy comparison on a small machine thins the trace
by conversation instead, which keeps its reuse.

For each policy (``--policies``, default random, load_balance, local_cache,
conductor) a fresh cluster of ``--prefill`` prefill + ``--decode`` decode
``python -m mooncaked`` daemons starts with ``[conductor] policy`` set, waits
until every node's profiled costs have reached the entry node by gossip, and
``mooncakectl bench trace`` replays the same slice of the trace at its
timestamps (``--time-scale`` stretches them to fit the machine) against the
entry (the last decode node; with ``--entries N``, each request at one of
the last N nodes started, drawn by the bench from its seed, the same draws
in every run). Printed per policy: mean and p90 TTFT, SLO attainment
(requests meeting ``--slo-ttft-ms`` and ``--slo-tbt-ms`` over all sent, TBT
and "meeting" as ``mooncaked.cluster.slo`` defines them), goodput
(requests/s meeting both), rejections; and ratios against ``load_balance``.

Prediction accuracy: every response carries the Conductor's forecasts of TTFT
and TBT (headers: as promised, corrected by the entry's calibration, and the
cost model's own); over the requests of the ``conductor`` run, the median of
|forecast - measured| / measured for each. ``--warmups N`` sends N requests
of random tokens first in every run, unmeasured, so the entry starts
calibrated as it would after running a while.

``--entries-compare N`` compares entry nodes instead (``--policies`` to run
the policy comparison too): the conductor policy entered at one node, at N
(each entry placing on its own gossip view), and load_balance at N, each
on a fresh cluster (1 prefill + 2 decode unless ``--prefill``/``--decode``
say: the shape where one entry was seen to herd requests onto one decode
node), ``--repeats`` trials of the three; per run: mean and p90 TTFT,
goodput, SLO attainment, rejections and the requests each decode node got.

``--overload F`` adds an overload comparison: the same slice F times faster
with ``[slo]`` set, early rejection on the current decode load vs on the
load forecast for when the prefill ends: rejected requests, and the share of
admitted ones meeting both SLOs.

The machine may be shared and small: compare the ratios of one run, not
absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from mooncakectl.bench.policies_report import (
    Row,
    accuracy,
    fmt,
    print_accuracy,
    print_entries_table,
    print_overload,
    print_overload_trials,
    print_table,
    rejections,
    run_row,
)
from mooncakectl.bench.replay import (
    EARLY_REJECT,
    POLICIES,
    ReplaySpec,
    add_cluster_arguments,
    replay_spec,
    run_policy,
)
from mooncakectl.bench.trace import (
    add_scale_arguments,
    add_slice_arguments,
    describe_slice,
    read_trace,
    slice_from_args,
)
from mooncakectl.registry import Env, ExitStatus

# The command line's own options, not the benchmark's: left out of the figures.
_NOT_FIGURES = ("command", "workload", "url", "admin_token", "timeout", "json", "result_json")


def configure(p: argparse.ArgumentParser) -> None:
    """``bench policies``' options."""
    t = p.add_argument_group("trace")
    t.add_argument("--trace", required=True, metavar="FILE", help="a Mooncake trace (JSONL)")
    add_slice_arguments(t)
    t.set_defaults(trace_count=120)
    add_scale_arguments(t, block_tokens=32, output_scale=0.1, time_scale=1.0)
    c = p.add_argument_group("cluster")
    c.add_argument(
        "--prefill", type=int, default=None, help="prefill daemons (2; 1 with --entries-compare)"
    )
    c.add_argument(
        "--decode", type=int, default=None, help="decode daemons (1; 2 with --entries-compare)"
    )
    add_cluster_arguments(c)
    c.add_argument(
        "--pin",
        action="store_true",
        help="give the prefill and the decode daemons cores of their own (node.cpus), "
        "so that nodes sharing this machine compute as on machines of their own",
    )
    _configure_runs(p.add_argument_group("runs"))
    p.add_argument("--result-json", help="write every figure and request here")


def _configure_runs(r: argparse._ArgumentGroup) -> None:
    r.add_argument(
        "--policies",
        type=lambda s: [x for x in s.split(",") if x],
        default=None,
        help="the policies to compare ('': none, the overload runs only; "
        "default: every one, none with --entries-compare)",
    )
    r.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    r.add_argument("--slo-tbt-ms", type=float, default=100.0)
    r.add_argument(
        "--early-reject",
        choices=EARLY_REJECT,
        default="off",
        help="admission in the policy and entry comparisons (off: every request is served)",
    )
    r.add_argument(
        "--warmups",
        type=int,
        default=0,
        help="requests of random tokens each run sends first, all at once, unmeasured "
        "(the entry then starts with measured requests to calibrate by)",
    )
    r.add_argument("--overload", type=float, default=0.0, help="also run F times faster")
    r.add_argument(
        "--overload-modes",
        type=lambda s: s.split(","),
        default=list(EARLY_REJECT),
        help="the early-rejection modes of the overload runs",
    )
    r.add_argument(
        "--overload-repeats", type=int, default=1, help="overload trials, each a run of every mode"
    )
    r.add_argument(
        "--entries",
        type=int,
        default=1,
        help="nodes the requests enter at (1: the last decode node; n: it and the n - 1 "
        "started before it, each request at one drawn from the bench's seed), "
        "to compare decisions on different views",
    )
    r.add_argument(
        "--entries-compare",
        type=int,
        default=0,
        metavar="N",
        help="compare entering at one node and at N: conductor with 1 entry, conductor "
        "with N, load_balance with N, on a 1P+2D cluster unless --prefill/--decode say",
    )
    r.add_argument(
        "--repeats", type=int, default=2, help="trials of every run of --entries-compare"
    )


def settle_args(args: argparse.Namespace) -> None:
    """The defaults that depend on others, then ValueError naming the option
    whose value cannot be run (before any daemon starts)."""
    # --entries-compare's own shape: one decode node of two is where the
    # Conductor was seen to herd requests when it entered at one node.
    if args.prefill is None:
        args.prefill = 1 if args.entries_compare else 2
    if args.decode is None:
        args.decode = 2 if args.entries_compare else 1
    if args.policies is None:
        args.policies = [] if args.entries_compare else list(POLICIES)
    if args.prefill < 1 or args.decode < 1:
        raise ValueError(
            f"--prefill and --decode must be >= 1, got {args.prefill} and {args.decode}"
        )
    nodes = args.prefill + args.decode
    if not 1 <= args.entries <= nodes:
        raise ValueError(
            f"--entries: {args.entries} is not between 1 and the cluster's {nodes} nodes"
        )
    if args.entries_compare and not 2 <= args.entries_compare <= nodes:
        raise ValueError(
            f"--entries-compare: {args.entries_compare} is not between 2 and the "
            f"cluster's {nodes} nodes"
        )
    for name in ("repeats", "overload_repeats"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag}: {getattr(args, name)} is not a positive count")
    bad = [x for x in args.policies if x not in POLICIES]
    if bad:
        raise ValueError(f"--policies: unknown {bad}; known {list(POLICIES)}")
    bad = [x for x in args.overload_modes if x not in EARLY_REJECT]
    if bad:
        raise ValueError(f"--overload-modes: unknown {bad}; known {list(EARLY_REJECT)}")
    if not Path(args.trace).is_file():
        raise ValueError(f"--trace: no file {args.trace!r}")


def entries_runs(n: int) -> list[tuple[str, str, int]]:
    """(label, policy, entry nodes) of each run of ``--entries-compare n``:
    the Conductor entered at one node, then at ``n`` (each entry deciding on
    its own gossip view), and load_balance at ``n``, the baseline."""
    return [
        ("conductor-1e", "conductor", 1),
        (f"conductor-{n}e", "conductor", n),
        (f"load_balance-{n}e", "load_balance", n),
    ]


@dataclass(slots=True)
class _Bench:
    """One ``bench policies`` command: what every run shares, and the figures so far."""

    args: argparse.Namespace
    spec: ReplaySpec
    workdir: Path
    report: TextIO
    progress: TextIO
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def slo(self) -> dict[str, float]:
        return {"ttft_s": self.args.slo_ttft_ms / 1e3, "tbt_s": self.args.slo_tbt_ms / 1e3}

    async def run(
        self, label: str, policy: str, early_reject: str, time_scale: float, entries: int
    ) -> tuple[dict[str, Any], Row]:
        """One run on a fresh cluster and its summary row."""
        started = time.monotonic()
        conductor = {"policy": policy, "early_reject": early_reject}
        res = await run_policy(
            self.spec,
            self.workdir,
            label,
            conductor,
            self.slo,
            time_scale,
            entries,
            progress=self.progress,
        )
        row = run_row(res, self.args.slo_ttft_ms, self.args.slo_tbt_ms)
        self.progress.write(
            f"  {label}: {time.monotonic() - started:.0f} s, "
            f"mean TTFT {fmt(row['mean_ttft_ms'], '.1f')} ms\n"
        )
        return res, row


async def compare_policies(b: _Bench, selection: str, count: int) -> None:
    """Every ``--policies`` policy on a fresh cluster; their table, and the
    conductor run's forecasts against what was measured."""
    args = b.args
    results: dict[str, dict[str, Any]] = {}
    rows: dict[str, Row] = {}
    for policy in args.policies:
        # Admission off by default: every policy serves every request,
        # so the comparison is of placement alone.
        results[policy], rows[policy] = await b.run(
            policy, policy, args.early_reject, args.time_scale, args.entries
        )
    b.report.write(
        f"\n{args.prefill}P+{args.decode}D, {args.entries} entry node(s), "
        f"{count} trace records ({selection}), {args.trace_block_tokens} tokens per "
        f"hash id, time scale {args.time_scale}, SLO TTFT {args.slo_ttft_ms} ms "
        f"TBT {args.slo_tbt_ms} ms\n"
    )
    if rows:
        base = "load_balance" if "load_balance" in rows else next(iter(rows))
        print_table(rows, base, b.report)
    b.figures["policies"] = rows
    # Every request as the bench recorded it, to study offline.
    b.figures["requests"] = {name: res["requests"] for name, res in results.items()}
    if "conductor" in results:
        acc = accuracy(results["conductor"])
        model = accuracy(results["conductor"], "model")
        b.figures["prediction"] = acc
        b.figures["model_prediction"] = model
        b.figures["node_costs"] = results["conductor"].get("node_costs")
        b.report.write("\n")
        print_accuracy(acc, "prediction (conductor run, as promised)", b.report)
        print_accuracy(model, "prediction (conductor run, cost model before calibration)", b.report)


async def compare_entries(b: _Bench) -> None:
    """``--repeats`` trials of ``entries_runs``, each run on a fresh cluster
    replaying the same slice; their table, every request in the figures."""
    args = b.args
    trials: list[dict[str, Row]] = []
    for trial in range(args.repeats):
        runs: dict[str, Row] = {}
        for name, policy, entries in entries_runs(args.entries_compare):
            label = f"{name}-t{trial + 1}"
            res, runs[name] = await b.run(
                label, policy, args.early_reject, args.time_scale, entries
            )
            b.figures.setdefault("entries_requests", []).append(
                {
                    "trial": trial,
                    "run": name,
                    "entry_nodes": res["entry_nodes"],
                    "requests": res["requests"],
                }
            )
        trials.append(runs)
    b.report.write(
        f"\nentry nodes: the Conductor entered at one node vs at "
        f"{args.entries_compare}, load_balance at {args.entries_compare} "
        f"({args.prefill}P+{args.decode}D, {args.repeats} trial(s))\n"
    )
    print_entries_table(trials, b.report)
    b.figures["entries_compare"] = trials


async def compare_overload(b: _Bench) -> None:
    """``--overload-repeats`` trials of every ``--overload-modes`` mode, the
    slice ``--overload`` times faster with the SLOs enforced."""
    args = b.args
    trials: list[dict[str, Row]] = []
    for trial in range(args.overload_repeats):
        over: dict[str, Row] = {}
        for mode in args.overload_modes:
            scale = args.time_scale / args.overload
            res, over[mode] = await b.run(
                f"overload-{mode}", "conductor", mode, scale, args.entries
            )
            over[mode]["rejections"] = rejections(res)
            b.figures.setdefault("overload_requests", []).append(
                {"trial": trial, "mode": mode, "requests": res["requests"]}
            )
        trials.append(over)
        b.report.write(
            f"\noverload: the same slice {args.overload:g}x faster, SLOs enforced"
            + (f" (trial {trial + 1} of {args.overload_repeats})" if trial else "")
            + "\n"
        )
        print_overload(over, b.report)
    b.figures["overload"] = trials
    if len(trials) > 1:
        print_overload_trials(trials, b.report)


def command(args: argparse.Namespace, env: Env) -> int:
    """``mooncakectl bench policies``: the tables printed (to stderr with
    ``--json``, which prints the figures as JSON instead), and with
    ``--result-json`` every figure and request written there."""
    settle_args(args)
    sl = slice_from_args(args)
    records = read_trace(args.trace, sl)
    slo_ms = (args.slo_ttft_ms, args.slo_tbt_ms)
    spec = replay_spec(args, records, slo_ms, args.warmups, args.pin)
    report = env.stderr if args.json else env.stdout
    with tempfile.TemporaryDirectory(prefix="bench-policies-") as tmp:
        b = _Bench(args, spec, Path(tmp), report, env.stderr)
        b.figures["args"] = {k: v for k, v in vars(args).items() if k not in _NOT_FIGURES}
        asyncio.run(_run_all(b, describe_slice(sl, records), len(records)))
    if args.json:
        env.stdout.write(json.dumps(b.figures, indent=1) + "\n")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(b.figures, indent=2))
    return ExitStatus.OK


async def _run_all(b: _Bench, selection: str, count: int) -> None:
    await compare_policies(b, selection, count)
    if b.args.entries_compare:
        await compare_entries(b)
    if b.args.overload:
        await compare_overload(b)
