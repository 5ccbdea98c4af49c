"""The Conductor's policies side by side on a loopback cluster replaying a trace.

    python tools/bench_conductor.py --trace ../shared/data/traces/conversation_trace.jsonl
    python tools/bench_conductor.py --trace T --until-s 600 --conversations 4/10 \
        --count 1000 --block-tokens 128 --time-scale 0.1 --overload 3 --warmups 16
    python tools/bench_conductor.py --trace T --entries-compare 2 --repeats 3

Which records: ``--start``/``--count`` of those in ``--from-s``..``--until-s``
and, with ``--conversations [R/]K``, only one conversation in K, every turn
of it. Consecutive records of the conversation trace share almost no prefix
(a follow-up turn comes minutes later), so a policy comparison on a small
machine thins the trace by conversation instead, which keeps its reuse.

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
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import itertools

from bench_disagg import SECRET, Cluster, free_port

from mooncakectl.bench.trace import TraceSlice, read_trace
from mooncaked.cluster.placement import EarlyReject, Policy
from mooncaked.cluster.slo import MIN_TBT_GAPS, Slo, tbt_s

REPO_ROOT = Path(__file__).resolve().parent.parent
# The daemon's own names: a flag here is a value of [conductor] there.
POLICIES = tuple(p.value for p in Policy)
# What a daemon's [conductor] early_reject takes: the paper's baseline (TBT
# judged at the decode node after the prefill) is the simulator's alone.
EARLY_REJECT = tuple(e.value for e in EarlyReject if e is not EarlyReject.BASELINE)


def pool_cpus(prefill: int, decode: int, cpus: Sequence[int]) -> list[str]:
    """``node.cpus`` of each daemon (prefill ones first) for ``--pin``.

    The prefill and decode pools get disjoint cores, split by their sizes
    (at least one each), so neither pool's work slows the other's steps, as
    on machines of their own; within a pool, daemons take its cores in turn.
    """
    cpus = sorted(cpus)
    if len(cpus) < 2:
        raise ValueError(f"--pin needs two CPUs or more, this process may use {len(cpus)}")
    n_pre = min(len(cpus) - 1, max(1, round(len(cpus) * prefill / (prefill + decode))))
    pools = (cpus[:n_pre], cpus[n_pre:])
    out = []
    for pool, count in zip(pools, (prefill, decode), strict=True):
        per = max(1, len(pool) // count)
        for i in range(count):
            start = (i * per) % len(pool)
            out.append(",".join(str(c) for c in pool[start : start + per]))
    return out


def _sections(
    args: argparse.Namespace, node_id: str, role: str, cpus: str = ""
) -> dict[str, dict[str, Any]]:
    return {
        "node": {"id": node_id, "role": role, "cluster_secret": SECRET, "cpus": cpus},
        "server": {"host": "127.0.0.1", "port": 0, "drain_timeout_s": 5.0},
        "model": {"cpu_threads": args.cpu_threads, "path": args.model},
        "kv": {"num_blocks": args.kv_blocks},
        "scheduler": {"max_num_batched_tokens": args.max_batched_tokens},
        "store": {"dram_bytes": args.dram_mb << 20},
        "log": {"level": "warning", "format": "json"},
    }


async def _costs_everywhere(session: aiohttp.ClientSession, url: str, n: int) -> None:
    """Until the entry's view holds ``n`` nodes, each with a measured cost model."""
    deadline = time.monotonic() + 180.0
    while True:
        try:
            async with session.get(f"{url}/admin/cluster") as resp:
                doc = await resp.json()
            known = [
                node
                for node in doc.get("nodes", [])
                if node.get("status") == "alive"
                and ((node.get("state") or {}).get("costs") or {}).get("step", {}).get("base_s", 0)
                > 0
            ]
            if len(known) >= n:
                return
        except (aiohttp.ClientError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: the cluster's costs did not all arrive within 180 s")
        await asyncio.sleep(0.5)


async def run_policy(
    args: argparse.Namespace,
    workdir: Path,
    label: str,
    conductor: dict[str, Any],
    slo: dict[str, Any],
    time_scale: float,
    entries: int = 1,
) -> dict[str, Any]:
    """One run on a fresh cluster: ``mooncakectl bench trace`` replays the
    slice, each request entering at one of ``entry_nodes(daemons, entries)``."""
    ns = argparse.Namespace(**vars(args))
    cluster = Cluster(ns, workdir)
    try:
        gossip = free_port()
        daemons = []
        cpus = (
            pool_cpus(args.prefill, args.decode, sorted(os.sched_getaffinity(0)))
            if args.pin
            else [""] * (args.prefill + args.decode)
        )
        for i in range(args.prefill):
            s = _sections(args, f"{label}-p{i}", "prefill", cpus[i])
            s["conductor"] = conductor
            s["slo"] = slo
            s["cluster"] = (
                {"gossip_port": gossip, "gossip_interval_s": 0.1}
                if i == 0
                else {"seeds": [f"127.0.0.1:{gossip}"], "gossip_interval_s": 0.1}
            )
            daemons.append(await cluster.start(f"{label}-p{i}", s))
        for i in range(args.decode):
            s = _sections(args, f"{label}-d{i}", "decode", cpus[args.prefill + i])
            s["conductor"] = conductor
            s["slo"] = slo
            s["cluster"] = {"seeds": [f"127.0.0.1:{gossip}"], "gossip_interval_s": 0.1}
            daemons.append(await cluster.start(f"{label}-d{i}", s))
        result: dict[str, Any] = {"requests": [], "status_before": {}}
        async with aiohttp.ClientSession() as session:
            for d in daemons:
                await _costs_everywhere(session, d.url, len(daemons))
            # Each node as profiled at start-up, before the replay refits it.
            for d in daemons:
                async with session.get(f"{d.url}/admin/status") as resp:
                    result["status_before"][d.node_id] = await resp.json()
        # One client replaying the slice at its timestamps; with several
        # entries, the bench draws each request's entry from its seed, the
        # same draws in every run.
        entered = entry_nodes(daemons, entries)
        result["entry_nodes"] = {d.url: d.node_id for d in entered}
        trace = workdir / f"{label}.jsonl"
        trace.write_text("".join(args.lines))
        out = workdir / f"{label}.json"
        cmd = [
            sys.executable,
            "-m",
            "mooncakectl",
            "bench",
            "trace",
            str(trace),
            "--entries",
            ",".join(d.url for d in entered),
            "--trace-block-tokens",
            str(args.block_tokens),
            "--output-scale",
            str(args.output_scale),
            "--time-scale",
            str(time_scale),
            "--goodput",
            f"ttft:{args.slo_ttft_ms}",
            f"tbt:{args.slo_tbt_ms}",
            "--num-warmups",
            str(args.warmups),
            "--result-json",
            str(out),
            "--label",
            label,
        ]
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=REPO_ROOT,
        )
        # The decode nodes' KV and batch while the replay runs: what admission
        # filled them with (a full KV cache makes handoffs wait for room).
        sampler = asyncio.create_task(_sample_decode(daemons[args.prefill :], result))
        try:
            _stdout, stderr = await proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(
                    f"bench for {label} failed ({proc.returncode}):\n{stderr.decode()[-2000:]}"
                )
            doc = json.loads(out.read_text())
            result["requests"] = doc["requests"]
            result["max_model_len"] = (doc.get("config") or {}).get("max_model_len")
        finally:
            sampler.cancel()
            (outcome,) = await asyncio.gather(sampler, return_exceptions=True)
        if not isinstance(outcome, asyncio.CancelledError):
            # The sampler only ends by cancellation: anything else broke it.
            print(f"decode KV sampling stopped early: {outcome!r}", file=sys.stderr)
        # The nodes' own view of their costs after the run.
        async with aiohttp.ClientSession() as session:
            result["node_costs"] = {}
            for d in daemons:
                async with session.get(f"{d.url}/admin/status") as resp:
                    result["node_costs"][d.node_id] = (await resp.json()).get("conductor")
        return result
    finally:
        await cluster.stop()


def entry_nodes(daemons: Sequence[Any], n: int) -> list[Any]:
    """The ``n`` nodes requests enter at: the last started (a decode node,
    the one entry of a run with one) and the ones started before it, so the
    entries of a run with more include the one of a run with one."""
    if not 1 <= n <= len(daemons):
        raise ValueError(f"{n} entry nodes asked of a cluster of {len(daemons)}")
    return list(reversed(daemons))[:n]


SAMPLE_S = 0.5


async def _sample_decode(daemons: Sequence[Any], result: dict[str, Any]) -> None:
    """Every SAMPLE_S until cancelled: each decode node's KV usage, running and
    waiting requests, into ``result["decode_samples"]``."""
    samples: list[dict[str, Any]] = []
    result["decode_samples"] = samples
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as session:
        while True:
            for d in daemons:
                try:
                    async with session.get(f"{d.url}/admin/status") as resp:
                        st = await resp.json()
                except aiohttp.ClientError:
                    continue
                samples.append(
                    {
                        "t_s": round(time.monotonic() - t0, 2),
                        "node": d.node_id,
                        "kv_usage": (st.get("kv") or {}).get("usage"),
                        "running": (st.get("load") or {}).get("running"),
                        "waiting": (st.get("load") or {}).get("waiting"),
                    }
                )
            await asyncio.sleep(SAMPLE_S)


def decode_pressure(result: dict[str, Any]) -> dict[str, Any]:
    """Peak decode KV usage and batch over the run, and the share of samples
    with the KV cache at least 95% full."""
    samples = [x for x in result.get("decode_samples", []) if x["kv_usage"] is not None]
    if not samples:
        return {
            "peak_kv_usage": None,
            "full_share": None,
            "peak_running": None,
            "peak_waiting": None,
        }
    return {
        "peak_kv_usage": max(x["kv_usage"] for x in samples),
        "full_share": sum(1 for x in samples if x["kv_usage"] >= 0.95) / len(samples),
        "peak_running": max(x["running"] or 0 for x in samples),
        "peak_waiting": max(x["waiting"] or 0 for x in samples),
    }


def _ttft_ms(rec: dict[str, Any]) -> float | None:
    chunks = rec.get("chunk_s") or []
    if rec.get("error_kind") is not None or not chunks:
        return None
    return (chunks[0] - rec["start_s"]) * 1e3


def _gaps(rec: dict[str, Any]) -> list[float]:
    """Seconds between consecutive chunks: one token each, as the bench counts them."""
    if rec.get("error_kind") is not None:
        return []
    return [b - a for a, b in itertools.pairwise(rec.get("chunk_s") or [])]


def _tbt_ms(rec: dict[str, Any]) -> float | None:
    """The request's TBT as ``slo.tbt_s`` defines it (None without a gap)."""
    tbt = tbt_s(_gaps(rec))
    return None if tbt is None else tbt * 1e3


def meets_slo(rec: dict[str, Any], slo: Slo) -> bool:
    """Whether a completed request meets both SLOs, as ``Slo.met`` judges it."""
    t, g = _ttft_ms(rec), _tbt_ms(rec)
    return slo.met(None if t is None else t / 1e3, None if g is None else g / 1e3)


def summarize(result: dict[str, Any], slo_ttft_ms: float, slo_tbt_ms: float) -> dict[str, Any]:
    recs = [r for r in result.get("requests", []) if not r.get("warmup")]
    ttfts = sorted(t for r in recs if (t := _ttft_ms(r)) is not None)
    rejected = sum(1 for r in recs if r.get("error_kind") == "rejected")
    errors = sum(1 for r in recs if r.get("error_kind") not in (None, "rejected"))
    admitted = [r for r in recs if r.get("error_kind") is None]

    slo = Slo(slo_ttft_ms / 1e3, slo_tbt_ms / 1e3)
    num_good = sum(1 for r in admitted if meets_slo(r, slo))
    decode_split: dict[str, int] = {}
    for r in recs:
        if (node := r.get("decode_node")) is not None:
            decode_split[node] = decode_split.get(node, 0) + 1
    ends = [r["end_s"] for r in recs if r.get("end_s") is not None]
    duration = max(ends) if ends else 0.0
    return {
        "sent": len(recs),
        "completed": len(admitted),
        "rejected": rejected,
        "errors": errors,
        "mean_ttft_ms": statistics.fmean(ttfts) if ttfts else None,
        "p90_ttft_ms": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
        "slo_attainment": num_good / len(recs) if recs else None,
        "admitted_meeting_slo": num_good / len(admitted) if admitted else None,
        "goodput_rps": num_good / duration if duration else None,
        "cached_tokens": sum(r.get("cached_tokens") or 0 for r in admitted),
        # Requests per decode node, as the responses named it.
        "decode_split": dict(sorted(decode_split.items())),
    } | decode_pressure(result)


def _rejections(result: dict[str, Any]) -> dict[str, int]:
    """The timed run's rejections by the code of each 429 (``ttft_slo``, ``tbt_slo``...)."""
    out: dict[str, int] = {}
    for r in result.get("requests", []):
        if r.get("warmup") or r.get("error_kind") != "rejected":
            continue
        why = r.get("error_code") or "other"
        out[why] = out.get(why, 0) + 1
    return out


def accuracy(result: dict[str, Any], prefix: str = "predicted") -> dict[str, Any]:
    """Median |predicted - measured| / measured of TTFT and TBT over a run:
    of what the entry promised (``predicted``, calibrated by what it measured
    before), or of the cost model's own figures (``model``)."""
    ttft: list[tuple[float, float]] = []
    tbt: list[tuple[float, float]] = []
    for r in result.get("requests", []):
        if r.get("warmup"):
            continue
        t, p = _ttft_ms(r), r.get(f"{prefix}_ttft_ms")
        if t and p:
            ttft.append((p, t))
        # Only a TBT over as many gaps as the entry calibrates on: over fewer
        # it is one step's time, not the batch's the forecast is of.
        g, q = _tbt_ms(r), r.get(f"{prefix}_tbt_ms")
        if g and q and len(_gaps(r)) >= MIN_TBT_GAPS:
            tbt.append((q, g))

    def med(pairs: list[tuple[float, float]], f: Any) -> float | None:
        return statistics.median(f(p, m) for p, m in pairs) if pairs else None

    return {
        "ttft_samples": len(ttft),
        "ttft_median_rel_error": med(ttft, lambda p, m: abs(p - m) / m),
        # Predicted / measured: below 1, the model is optimistic.
        "ttft_median_ratio": med(ttft, lambda p, m: p / m),
        "tbt_samples": len(tbt),
        "tbt_median_rel_error": med(tbt, lambda p, m: abs(p - m) / m),
        "tbt_median_ratio": med(tbt, lambda p, m: p / m),
        "pairs_ms": {"ttft": ttft, "tbt": tbt},
    }


def print_accuracy(acc: dict[str, Any], what: str) -> None:
    print(
        f"{what}: TTFT median |error| "
        f"{_fmt(acc['ttft_median_rel_error'], '.1%')} over {acc['ttft_samples']}, "
        f"TBT median |error| {_fmt(acc['tbt_median_rel_error'], '.1%')} "
        f"over {acc['tbt_samples']} (median predicted/measured: TTFT "
        f"{_fmt(acc['ttft_median_ratio'], '.2f')}, TBT {_fmt(acc['tbt_median_ratio'], '.2f')})"
    )


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: dict[str, dict[str, Any]], base: str) -> None:
    cols = (
        "policy",
        "sent",
        "done",
        "rejected",
        "mean TTFT ms",
        "p90 TTFT ms",
        "SLO attain.",
        "goodput r/s",
        "goodput vs " + base,
        "mean TTFT vs " + base,
    )
    b = rows.get(base, {})
    lines = [cols]
    for name, s in rows.items():
        gp = (
            s["goodput_rps"] / b["goodput_rps"]
            if b.get("goodput_rps") and s.get("goodput_rps") is not None
            else None
        )
        tt = (
            s["mean_ttft_ms"] / b["mean_ttft_ms"]
            if b.get("mean_ttft_ms") and s.get("mean_ttft_ms") is not None
            else None
        )
        lines.append(
            (
                name,
                str(s["sent"]),
                str(s["completed"]),
                str(s["rejected"]),
                _fmt(s["mean_ttft_ms"], ".1f"),
                _fmt(s["p90_ttft_ms"], ".1f"),
                _fmt(s["slo_attainment"], ".1%"),
                _fmt(s["goodput_rps"], ".3f"),
                _fmt(gp, ".2f") + ("x" if gp is not None else ""),
                _fmt(tt, ".2f") + ("x" if tt is not None else ""),
            )
        )
    widths = [max(len(r[i]) for r in lines) for i in range(len(cols))]
    for r in lines:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "lines", "records")}
    }
    slo = {"ttft_s": args.slo_ttft_ms / 1e3, "tbt_s": args.slo_tbt_ms / 1e3}
    with tempfile.TemporaryDirectory(prefix="bench-conductor-") as tmp:
        workdir = Path(tmp)
        results: dict[str, dict[str, Any]] = {}
        summaries: dict[str, dict[str, Any]] = {}
        for policy in args.policies:
            # Admission off by default: every policy serves every request,
            # so the comparison is of placement alone.
            conductor = {"policy": policy, "early_reject": args.early_reject}
            started = time.monotonic()
            results[policy] = await run_policy(
                args, workdir, policy, conductor, slo, args.time_scale, args.entries
            )
            summaries[policy] = summarize(results[policy], args.slo_ttft_ms, args.slo_tbt_ms)
            print(
                f"  {policy}: {time.monotonic() - started:.0f} s, "
                f"mean TTFT {_fmt(summaries[policy]['mean_ttft_ms'], '.1f')} ms",
                file=sys.stderr,
            )
        print(
            f"\n{args.prefill}P+{args.decode}D, {args.entries} entry node(s), "
            f"{args.count} trace records ({args.selection}), {args.block_tokens} tokens per "
            f"hash id, time scale {args.time_scale}, SLO TTFT {args.slo_ttft_ms} ms "
            f"TBT {args.slo_tbt_ms} ms"
        )
        if summaries:
            base = "load_balance" if "load_balance" in summaries else next(iter(summaries))
            print_table(summaries, base)
        out["policies"] = summaries
        # Every request as the bench recorded it, to study offline.
        out["requests"] = {name: res["requests"] for name, res in results.items()}
        if "conductor" in results:
            acc = accuracy(results["conductor"])
            out["prediction"] = acc
            out["model_prediction"] = model = accuracy(results["conductor"], "model")
            out["node_costs"] = results["conductor"].get("node_costs")
            print()
            print_accuracy(acc, "prediction (conductor run, as promised)")
            print_accuracy(model, "prediction (conductor run, cost model before calibration)")
        if args.entries_compare:
            out["entries_compare"] = await compare_entries(args, workdir, slo, out)
        if args.overload:
            trials: list[dict[str, dict[str, Any]]] = []
            for trial in range(args.overload_repeats):
                over: dict[str, dict[str, Any]] = {}
                for mode in args.overload_modes:
                    label = f"overload-{mode}"
                    res = await run_policy(
                        args,
                        workdir,
                        label,
                        {"policy": "conductor", "early_reject": mode},
                        slo,
                        args.time_scale / args.overload,
                        args.entries,
                    )
                    over[mode] = summarize(res, args.slo_ttft_ms, args.slo_tbt_ms)
                    over[mode]["rejections"] = _rejections(res)
                    out.setdefault("overload_requests", []).append(
                        {"trial": trial, "mode": mode, "requests": res["requests"]}
                    )
                trials.append(over)
                print(
                    f"\noverload: the same slice {args.overload:g}x faster, SLOs enforced"
                    + (f" (trial {trial + 1} of {args.overload_repeats})" if trial else "")
                )
                print_overload(over)
            out["overload"] = trials
            if len(trials) > 1:
                print_overload_trials(trials)
    return out


def entries_runs(n: int) -> list[tuple[str, str, int]]:
    """(label, policy, entry nodes) of each run of ``--entries-compare n``:
    the Conductor entered at one node, then at ``n`` (each entry deciding on
    its own gossip view), and load_balance at ``n``, the baseline."""
    return [
        ("conductor-1e", "conductor", 1),
        (f"conductor-{n}e", "conductor", n),
        (f"load_balance-{n}e", "load_balance", n),
    ]


async def compare_entries(
    args: argparse.Namespace, workdir: Path, slo: dict[str, Any], out: dict[str, Any]
) -> list[dict[str, dict[str, Any]]]:
    """``--repeats`` trials of ``entries_runs``, each run on a fresh cluster
    replaying the same slice; prints their table and returns the summaries
    (every request goes into ``out["entries_requests"]``)."""
    trials: list[dict[str, dict[str, Any]]] = []
    for trial in range(args.repeats):
        runs: dict[str, dict[str, Any]] = {}
        for name, policy, entries in entries_runs(args.entries_compare):
            started = time.monotonic()
            res = await run_policy(
                args,
                workdir,
                f"{name}-t{trial + 1}",
                {"policy": policy, "early_reject": args.early_reject},
                slo,
                args.time_scale,
                entries,
            )
            runs[name] = summarize(res, args.slo_ttft_ms, args.slo_tbt_ms)
            out.setdefault("entries_requests", []).append(
                {
                    "trial": trial,
                    "run": name,
                    "entry_nodes": res["entry_nodes"],
                    "requests": res["requests"],
                }
            )
            print(
                f"  {name} (trial {trial + 1}): {time.monotonic() - started:.0f} s, "
                f"mean TTFT {_fmt(runs[name]['mean_ttft_ms'], '.1f')} ms",
                file=sys.stderr,
            )
        trials.append(runs)
    print(
        f"\nentry nodes: the Conductor entered at one node vs at "
        f"{args.entries_compare}, load_balance at {args.entries_compare} "
        f"({args.prefill}P+{args.decode}D, {args.repeats} trial(s))"
    )
    print_entries_table(trials)
    return trials


def _split(counts: dict[str, int]) -> str:
    """``{"conductor-1e-t1-d0": 30, ...}`` -> ``"d0 30, d1 10"``: the node's
    name within its run, and its requests."""
    return ", ".join(f"{node.rsplit('-', 1)[-1]} {n}" for node, n in counts.items()) or "-"


def print_entries_table(trials: Sequence[dict[str, dict[str, Any]]]) -> None:
    cols = (
        "run",
        "trial",
        "mean TTFT ms",
        "p90 TTFT ms",
        "goodput r/s",
        "SLO attain.",
        "rejected",
        "decode split",
    )
    lines = [cols]
    for trial, runs in enumerate(trials, start=1):
        for name, s in runs.items():
            lines.append(
                (
                    name,
                    str(trial),
                    _fmt(s["mean_ttft_ms"], ".1f"),
                    _fmt(s["p90_ttft_ms"], ".1f"),
                    _fmt(s["goodput_rps"], ".3f"),
                    _fmt(s["slo_attainment"], ".1%"),
                    str(s["rejected"]),
                    _split(s.get("decode_split") or {}),
                )
            )
    widths = [max(len(r[i]) for r in lines) for i in range(len(cols))]
    for r in lines:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


def print_overload(over: dict[str, dict[str, Any]]) -> None:
    print(
        "early rejection  sent  rejected  admitted meeting SLOs  goodput r/s  "
        "decode KV peak / time >= 95%  rejected for"
    )
    for mode, s in over.items():
        why = ", ".join(f"{k} {v}" for k, v in sorted(s["rejections"].items())) or "-"
        kv = f"{_fmt(s.get('peak_kv_usage'), '.0%')} / {_fmt(s.get('full_share'), '.0%')}"
        print(
            f"{mode:<16} {s['sent']:<5} {s['rejected']:<9} "
            f"{_fmt(s['admitted_meeting_slo'], '.1%'):<22} "
            f"{_fmt(s['goodput_rps'], '.3f'):<12} {kv:<29} {why}"
        )


def print_overload_trials(trials: Sequence[dict[str, dict[str, Any]]]) -> None:
    """Predicted against current load over every trial: the two goals of
    early rejection, counted per trial (one run is one draw of a noisy
    machine's timing, and admission feeds back on it)."""
    pairs = [t for t in trials if "current" in t and "predicted" in t]
    if not pairs:
        return
    fewer = sum(1 for t in pairs if t["predicted"]["rejected"] < t["current"]["rejected"])
    met = sum(1 for t in pairs if (t["predicted"]["admitted_meeting_slo"] or 0.0) >= 0.95)
    cur = sum(t["current"]["rejected"] for t in pairs)
    pred = sum(t["predicted"]["rejected"] for t in pairs)
    print(f"\noverload over {len(pairs)} trials, prediction-based vs current-load early rejection:")
    print(
        f"  rejected: {pred} vs {cur} in all ({pred / cur:.2f}x); fewer in {fewer} of "
        f"{len(pairs)} trials"
        if cur
        else f"  rejected: {pred} vs {cur}"
    )
    print(f"  admitted meeting both SLOs >= 95% with prediction: {met} of {len(pairs)} trials")


def add_trace_args(
    p: argparse.ArgumentParser,
    *,
    count: int,
    block_tokens: int,
    output_scale: float,
    time_scale: float,
) -> None:
    """The options that pick and scale a trace's records (``select_records``)."""
    p.add_argument("--trace", required=True, help="a Mooncake trace (JSONL)")
    p.add_argument("--start", type=int, default=0, help="trace records to skip")
    p.add_argument("--count", type=int, default=count, help="trace records to replay at most")
    p.add_argument("--from-s", type=float, help="first trace timestamp to replay, seconds")
    p.add_argument("--until-s", type=float, help="replay trace timestamps below this, seconds")
    p.add_argument(
        "--conversations",
        metavar="[R/]K",
        help="replay one conversation in K, every turn of it (R: which of the K parts)",
    )
    p.add_argument(
        "--block-tokens", type=int, default=block_tokens, help="tokens per trace hash id"
    )
    p.add_argument("--output-scale", type=float, default=output_scale)
    p.add_argument(
        "--time-scale", type=float, default=time_scale, help="stretches the arrival gaps"
    )


def select_records(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The trace records the options select, as ``args.records``, their lines
    as ``args.lines`` (what the bench replays) and a description."""
    try:
        sl = TraceSlice.from_options(
            args.start,
            args.count,
            None if args.from_s is None else args.from_s * 1e3,
            None if args.until_s is None else args.until_s * 1e3,
            args.conversations,
            "--conversations",
        )
        records = read_trace(args.trace, sl)
    except ValueError as exc:
        p.error(str(exc))
    # What the bench replays: the selected records, written back as trace lines.
    args.lines = [
        json.dumps(
            {
                "timestamp": r.timestamp_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
        )
        + "\n"
        for r in records
    ]
    args.records = records
    args.count = len(records)
    args.selection = ", ".join(
        x
        for x in (
            f"from {args.from_s:g} s" if args.from_s is not None else "",
            f"until {args.until_s:g} s" if args.until_s is not None else "",
            f"conversations {sl.conversations_part}/{sl.conversations_every}"
            if sl.conversations_every > 1
            else "",
            f"skipping {args.start}" if args.start else "",
            f"lines {records[0].line}..{records[-1].line}",
        )
        if x
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_trace_args(p, count=120, block_tokens=32, output_scale=0.1, time_scale=1.0)
    p.add_argument(
        "--policies",
        type=lambda s: [x for x in s.split(",") if x],
        default=None,
        help="the policies to compare ('': none, the overload runs only; "
        "default: every one, none with --entries-compare)",
    )
    p.add_argument(
        "--prefill", type=int, default=None, help="prefill daemons (2; 1 with --entries-compare)"
    )
    p.add_argument(
        "--decode", type=int, default=None, help="decode daemons (1; 2 with --entries-compare)"
    )
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--kv-blocks", type=int, default=4096)
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    p.add_argument("--dram-mb", type=int, default=256)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tbt-ms", type=float, default=100.0)
    p.add_argument(
        "--early-reject",
        choices=EARLY_REJECT,
        default="off",
        help="admission in the policy and entry comparisons (off: every request is served)",
    )
    p.add_argument(
        "--warmups",
        type=int,
        default=0,
        help="requests of random tokens each run sends first, all at once, unmeasured "
        "(the entry then starts with measured requests to calibrate by)",
    )
    p.add_argument("--overload", type=float, default=0.0, help="also run F times faster")
    p.add_argument(
        "--overload-modes",
        type=lambda s: s.split(","),
        default=list(EARLY_REJECT),
        help="the early-rejection modes of the overload runs",
    )
    p.add_argument(
        "--overload-repeats",
        type=int,
        default=1,
        help="overload trials, each a run of every mode",
    )
    p.add_argument(
        "--entries",
        type=int,
        default=1,
        help="nodes the requests enter at (1: the last decode node; n: it and the n - 1 "
        "started before it, each request at one drawn from the bench's seed), "
        "to compare decisions on different views",
    )
    p.add_argument(
        "--entries-compare",
        type=int,
        default=0,
        metavar="N",
        help="compare entering at one node and at N: conductor with 1 entry, conductor "
        "with N, load_balance with N, on a 1P+2D cluster unless --prefill/--decode say",
    )
    p.add_argument(
        "--repeats", type=int, default=2, help="trials of every run of --entries-compare"
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="give the prefill and the decode daemons cores of their own (node.cpus), "
        "so that nodes sharing this machine compute as on machines of their own",
    )
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args()
    # --entries-compare's own shape: one decode node of two is where the
    # Conductor was seen to herd requests when it entered at one node.
    if args.prefill is None:
        args.prefill = 1 if args.entries_compare else 2
    if args.decode is None:
        args.decode = 2 if args.entries_compare else 1
    if args.policies is None:
        args.policies = [] if args.entries_compare else list(POLICIES)
    if args.prefill < 1 or args.decode < 1:
        p.error(f"--prefill and --decode must be >= 1, got {args.prefill} and {args.decode}")
    nodes = args.prefill + args.decode
    if not 1 <= args.entries <= nodes:
        p.error(f"--entries: {args.entries} is not between 1 and the cluster's {nodes} nodes")
    if args.entries_compare and not 2 <= args.entries_compare <= nodes:
        p.error(
            f"--entries-compare: {args.entries_compare} is not between 2 and the "
            f"cluster's {nodes} nodes"
        )
    if args.repeats < 1:
        p.error(f"--repeats: {args.repeats} is not a positive count")
    bad = [x for x in args.policies if x not in POLICIES]
    if bad:
        p.error(f"--policies: unknown {bad}; known {list(POLICIES)}")
    bad = [x for x in args.overload_modes if x not in EARLY_REJECT]
    if bad:
        p.error(f"--overload-modes: unknown {bad}; known {list(EARLY_REJECT)}")
    if args.overload_repeats < 1:
        p.error(f"--overload-repeats: {args.overload_repeats} is not a positive count")
    if not Path(args.trace).is_file():
        p.error(f"--trace: no file {args.trace!r}")
    select_records(p, args)
    out = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
