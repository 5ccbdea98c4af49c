"""One replay of a trace slice on a fresh loopback cluster, for the cluster benchmarks.

``bench policies`` runs one per policy (and per entry count, per overload
mode), ``simulate --against-cluster`` one to hold the simulator against.
A cluster of ``prefill`` + ``decode`` ``mooncaked`` daemons starts (each
once the one before it listens, so its start-up profile measures it alone),
waits until every node's profiled costs have reached every other node by
gossip, and ``mooncakectl bench trace`` replays the slice at its timestamps
against the entry nodes, while the decode nodes' KV use is sampled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from mooncakectl.bench.trace import TraceRecord, trace_lines
from mooncakectl.local.cluster import LocalCluster
from mooncakectl.local.config import Sections
from mooncakectl.local.plan import plan_cluster, pool_cpus
from mooncakectl.local.process import NodeProcess, daemon_env
from mooncaked.cluster.placement import EarlyReject, Policy

# The daemon's own names: a flag here is a value of [conductor] there.
POLICIES = tuple(p.value for p in Policy)
# What a daemon's [conductor] early_reject takes: the paper's baseline (TBT
# judged at the decode node after the prefill) is the simulator's alone.
EARLY_REJECT = tuple(e.value for e in EarlyReject if e is not EarlyReject.BASELINE)
SAMPLE_S = 0.5
_COSTS_TIMEOUT_S = 180.0
_START_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class ReplaySpec:
    """The cluster, the slice and how the bench replays it: the same for every
    run of one command."""

    prefill: int
    decode: int
    model: str
    cpu_threads: int
    kv_blocks: int
    max_batched_tokens: int
    dram_mb: int
    # The selected trace records, as trace lines (``trace.trace_lines``).
    trace_lines: tuple[str, ...]
    trace_block_tokens: int
    input_scale: float | None
    output_scale: float
    slo_ttft_ms: float
    slo_tbt_ms: float
    warmups: int = 0
    pin: bool = False


def add_cluster_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The daemons of a replay (``replay.ReplaySpec``), as ``bench policies``
    and ``simulate --against-cluster`` start them."""
    p.add_argument("--model", default="builtin:tiny", help="model.path of every daemon")
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads per daemon")
    p.add_argument("--kv-blocks", type=int, default=4096, help="device KV blocks per daemon")
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    p.add_argument("--dram-mb", type=int, default=256, help="DRAM tier per daemon, MiB")


def replay_spec(
    args: argparse.Namespace,
    records: Sequence[TraceRecord],
    slo_ms: tuple[float, float],
    warmups: int = 0,
    pin: bool = False,
) -> ReplaySpec:
    """The replays of a command with ``add_cluster_arguments``, ``--prefill``,
    ``--decode`` and the trace's scale options, of the selected ``records``;
    ``slo_ms``: the TTFT and TBT targets the bench judges goodput by."""
    return ReplaySpec(
        prefill=args.prefill,
        decode=args.decode,
        model=args.model,
        cpu_threads=args.cpu_threads,
        kv_blocks=args.kv_blocks,
        max_batched_tokens=args.max_batched_tokens,
        dram_mb=args.dram_mb,
        trace_lines=tuple(trace_lines(records)),
        trace_block_tokens=args.trace_block_tokens,
        input_scale=args.input_scale,
        output_scale=args.output_scale,
        slo_ttft_ms=slo_ms[0],
        slo_tbt_ms=slo_ms[1],
        warmups=warmups,
        pin=pin,
    )


def daemon_sections(spec: ReplaySpec) -> dict[str, dict[str, Any]]:
    """What every daemon of a replay runs with, under its node's own settings."""
    return {
        "server": {"drain_timeout_s": 5.0},
        "model": {"cpu_threads": spec.cpu_threads, "path": spec.model},
        "kv": {"num_blocks": spec.kv_blocks},
        "scheduler": {"max_num_batched_tokens": spec.max_batched_tokens},
        "store": {"dram_bytes": spec.dram_mb << 20},
        "log": {"level": "warning"},
        "cluster": {"gossip_interval_s": 0.1},
    }


def entry_nodes(daemons: Sequence[Any], n: int) -> list[Any]:
    """The ``n`` nodes requests enter at: the last started (a decode node,
    the one entry of a run with one) and the ones started before it, so the
    entries of a run with more include the one of a run with one."""
    if not 1 <= n <= len(daemons):
        raise ValueError(f"{n} entry nodes asked of a cluster of {len(daemons)}")
    return list(reversed(daemons))[:n]


def _cluster(spec: ReplaySpec, run_dir: Path, label: str, sections: Sections) -> LocalCluster:
    """``spec``'s nodes, named after the run's ``label``, with ``sections`` each."""
    members = [(f"{label}-p{i}", "prefill") for i in range(spec.prefill)]
    members += [(f"{label}-d{i}", "decode") for i in range(spec.decode)]
    cpus = (
        pool_cpus(spec.prefill, spec.decode, sorted(os.sched_getaffinity(0))) if spec.pin else None
    )
    return LocalCluster(
        plan_cluster(members, fixed_ports=False),
        run_dir,
        base=daemon_sections(spec),
        sections=lambda _plan: sections,
        cpus=cpus,
        sequential=True,
        start_timeout_s=_START_TIMEOUT_S,
    )


async def run_policy(
    spec: ReplaySpec,
    workdir: Path,
    label: str,
    conductor: dict[str, Any],
    slo: dict[str, Any],
    time_scale: float,
    entries: int = 1,
    *,
    progress: TextIO,
) -> dict[str, Any]:
    """One run on a fresh cluster: ``mooncakectl bench trace`` replays the
    slice, each request entering at one of ``entry_nodes(daemons, entries)``.
    Returns every request as the bench recorded it, each node's status before
    the replay and its cost model after, and the decode nodes' samples."""
    sections = {"conductor": conductor, "slo": slo}
    async with _cluster(spec, workdir / label, label, sections) as cluster:
        daemons = cluster.nodes
        result: dict[str, Any] = {"requests": [], "status_before": {}}
        async with aiohttp.ClientSession() as session:
            for d in daemons:
                await _costs_everywhere(session, d.url, len(daemons))
            # Each node as profiled at start-up, before the replay refits it.
            for d in daemons:
                result["status_before"][d.node_id] = await _status(session, d.url)
        # One client replaying the slice at its timestamps; with several
        # entries, the bench draws each request's entry from its seed, the
        # same draws in every run.
        entered = entry_nodes(daemons, entries)
        result["entry_nodes"] = {d.url: d.node_id for d in entered}
        # The decode nodes' KV and batch while the replay runs: what admission
        # filled them with (a full KV cache makes handoffs wait for room).
        try:
            async with asyncio.TaskGroup() as tg:
                sampler = tg.create_task(_sample_decode(daemons[spec.prefill :], result, progress))
                try:
                    doc = await _replay(spec, workdir, label, [d.url for d in entered], time_scale)
                finally:
                    sampler.cancel()
        except* Exception as failed:
            # The replay's own failure (the sampler reports its own and ends).
            raise failed.exceptions[0] from None
        result["requests"] = doc["requests"]
        result["max_model_len"] = (doc.get("config") or {}).get("max_model_len")
        # The nodes' own view of their costs after the run.
        async with aiohttp.ClientSession() as session:
            result["node_costs"] = {
                d.node_id: (await _status(session, d.url)).get("conductor") for d in daemons
            }
        return result


async def _replay(
    spec: ReplaySpec, workdir: Path, label: str, entries: Sequence[str], time_scale: float
) -> dict[str, Any]:
    """``mooncakectl bench trace`` on the slice, in a process of its own (its
    client's work then competes with no sampling here); its result JSON."""
    trace = workdir / f"{label}.jsonl"
    trace.write_text("".join(spec.trace_lines))
    out = workdir / f"{label}.json"
    scale = [] if spec.input_scale is None else ["--input-scale", str(spec.input_scale)]
    cmd = [
        sys.executable, "-m", "mooncakectl", "bench", "trace", str(trace),
        "--entries", ",".join(entries),
        "--trace-block-tokens", str(spec.trace_block_tokens),
        *scale,
        "--output-scale", str(spec.output_scale),
        "--time-scale", str(time_scale),
        "--goodput", f"ttft:{spec.slo_ttft_ms}", f"tbt:{spec.slo_tbt_ms}",
        "--num-warmups", str(spec.warmups),
        "--result-json", str(out),
        "--label", label,
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=daemon_env(),
    )
    _stdout, stderr = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench for {label} failed ({proc.returncode}):\n{stderr.decode()[-2000:]}"
        )
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


async def _status(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/admin/status") as resp:
        doc: dict[str, Any] = await resp.json()
        return doc


async def _costs_everywhere(session: aiohttp.ClientSession, url: str, n: int) -> None:
    """Until the view of the node at ``url`` holds ``n`` nodes, each with a
    measured cost model. Gossip sends no event here: ask until it is so."""
    deadline = time.monotonic() + _COSTS_TIMEOUT_S
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
            raise RuntimeError(
                f"{url}: the cluster's costs did not all arrive within {_COSTS_TIMEOUT_S:g} s"
            )
        await asyncio.sleep(0.5)


async def _sample_decode(
    daemons: Sequence[NodeProcess], result: dict[str, Any], progress: TextIO
) -> None:
    """Every SAMPLE_S until cancelled: each decode node's KV usage, running and
    waiting requests, into ``result["decode_samples"]``. The samples are a side
    figure: a failure to take them is reported, and the replay goes on."""
    samples: list[dict[str, Any]] = []
    result["decode_samples"] = samples
    t0 = time.monotonic()
    try:
        async with aiohttp.ClientSession() as session:
            while True:
                for d in daemons:
                    try:
                        st = await _status(session, d.url)
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
    except Exception as exc:
        progress.write(f"decode KV sampling stopped early: {exc!r}\n")


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
