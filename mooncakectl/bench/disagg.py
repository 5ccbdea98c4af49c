"""``mooncakectl bench disagg``: prefill/decode disaggregation against colocated serving, on loopback.

    mooncakectl bench disagg                             # default sizes
    mooncakectl bench disagg --reps 3 --window-s 10
    mooncakectl bench disagg --result-json out.json      # also write the figures

Every daemon is a ``python -m mooncaked`` subprocess on the builtin model with
``--cpu-threads`` torch threads, so a 1 prefill + 1 decode pair and two
colocated (``both``) daemons get the same CPU. Three setups run side by side
(an idle daemon costs next to no CPU):

1. 1P+1D, ``[disagg] layerwise = true`` (each layer's KV leaves as soon as its
   forward ends), the entry being the decode node;
2. 1P+1D, ``layerwise = false`` (all of a step's KV leaves after the step: the
   baseline);
3. two colocated daemons, each a cluster of one, behind a round-robin client.

(a) Handoff. For each ``--prompt-lens`` length, ``--reps`` fresh random
prompts (no cache hit anywhere), one at a time, ``max_tokens = 1``, the
setups taking turns request by request so that a change in the load of a
shared machine hits them alike. Read off
the prefill node's /admin/status "handoff" section before and after each:

- KV bytes: the bytes its sender wrote into the decode node;
- exposed: the sum over the request's steps of the time from the step's last
  layer finishing to its KV writes being complete on the decode node;
- raw transfer: the exposed time of the same prompt length with
  ``layerwise = false``, where nothing overlaps the writes, so the whole time
  to move those bytes is exposed;
- blocked: of the exposed time, what the steps waited for once their head
  and sampling were done (what the handoff added to the TTFT);
- exposed / raw: the goal is at most 0.2 for layer-wise streaming (the
  baseline is 1 by definition).

TTFT (client side, streamed) of the same prompts on setup 1 vs one colocated
daemon of setup 3; the fixed cost of the extra hop is the TTFT difference of
a ``--hop-prompt``-token prompt, where compute and KV bytes are negligible.

(b) Interference. ``--streams`` decode streams (``--stream-prompt`` tokens in,
``--stream-tokens`` out, one request after another) run for ``--window-s``
while a ``--long-prompt``-token prompt arrives every ``--long-every-s``. The
p99 time between tokens of the streams on setup 1 (everything enters at the
decode node) vs setup 3 (streams and long prompts alternate between the
daemons): same offered load; the goal is a ratio of at most 0.5.

Figures are medians over the repetitions. The machine may be shared and
small: compare ratios from one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from mooncakectl.bench.disagg_report import (
    HandoffRow,
    InterferenceRow,
    Results,
    percentile,
    print_report,
)
from mooncakectl.local.cluster import LocalCluster
from mooncakectl.local.plan import NodePlan, plan_cluster
from mooncakectl.local.process import NodeProcess
from mooncakectl.registry import Env, ExitStatus
from mooncaked.wire.headers import PREFILL_NODE_HEADER

_START_TIMEOUT_S = 120.0
# The builtin model's byte tokens; ids below 32 hold its special tokens.
_TOKEN_LO, _TOKEN_HI = 32, 256
# Gossip spreads the prefill node to the decode node sooner.
_FAST_GOSSIP: dict[str, Any] = {"gossip_interval_s": 0.1}


# ----------------------------------------------------------------- daemons


def daemon_sections(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """What every daemon of the benchmark runs with, under its node's own settings."""
    return {
        "server": {"drain_timeout_s": 5.0},
        "model": {"cpu_threads": args.cpu_threads, "path": args.model},
        "kv": {"num_blocks": args.kv_blocks},
        "scheduler": {"max_num_batched_tokens": args.max_batched_tokens},
        "disagg": {"layerwise": True},
        "log": {"level": "warning"},
    }


@contextlib.asynccontextmanager
async def disagg_pair(
    args: argparse.Namespace, workdir: Path, session: aiohttp.ClientSession, *, layerwise: bool
) -> AsyncIterator[tuple[NodeProcess, NodeProcess]]:
    """A prefill node and a decode node in one cluster; yields (prefill, decode)."""
    tag = "lw" if layerwise else "as"
    plans = plan_cluster([(f"p-{tag}", "prefill"), (f"d-{tag}", "decode")], fixed_ports=False)
    cluster = LocalCluster(
        plans,
        workdir / tag,
        base=daemon_sections(args),
        sections=lambda _plan: {"disagg": {"layerwise": layerwise}, "cluster": _FAST_GOSSIP},
        sequential=True,
        start_timeout_s=_START_TIMEOUT_S,
    )
    async with cluster:
        prefill, decode = cluster.nodes
        await wait_disagg(session, decode.url, prefill.node_id)
        yield prefill, decode


@contextlib.asynccontextmanager
async def colocated_pair(
    args: argparse.Namespace, workdir: Path
) -> AsyncIterator[tuple[NodeProcess, NodeProcess]]:
    """Two ``both`` daemons, each a cluster of one."""
    async with contextlib.AsyncExitStack() as stack:
        nodes = []
        for name in ("both-0", "both-1"):
            cluster = LocalCluster(
                [NodePlan(name, "both", 0, 0)],
                workdir / name,
                base=daemon_sections(args),
                start_timeout_s=_START_TIMEOUT_S,
            )
            nodes.append((await stack.enter_async_context(cluster)).nodes[0])
        yield nodes[0], nodes[1]


async def wait_disagg(session: aiohttp.ClientSession, entry: str, prefill_id: str) -> None:
    """Until the entry node hands prompts to ``prefill_id`` (gossip has met)."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    rng = random.Random(0)
    while True:
        r = await complete(session, entry, random_prompt(rng, 16), 1)
        if r.prefill_node == prefill_id:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{entry} still prefills on {r.prefill_node!r}, not {prefill_id!r}, "
                f"after {_START_TIMEOUT_S} s"
            )
        await asyncio.sleep(0.2)


# ------------------------------------------------------------------ client


@dataclass(slots=True)
class Completion:
    ttft_s: float
    # Arrival times of the token events after the first.
    token_times: list[float] = field(default_factory=list)
    prefill_node: str | None = None


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(_TOKEN_LO, _TOKEN_HI) for _ in range(n)]


async def complete(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> Completion:
    """One streamed completion; the time of each token event."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {(await resp.text())[:300]}")
        out = Completion(ttft_s=-1.0, prefill_node=resp.headers.get(PREFILL_NODE_HEADER))
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            if out.ttft_s < 0:
                out.ttft_s = now - t0
            else:
                out.token_times.append(now)
    if out.ttft_s < 0:
        raise RuntimeError(f"{url} streamed no token")
    return out


async def handoff_status(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/admin/status") as resp:
        resp.raise_for_status()
        st = await resp.json()
    handoff = st.get("handoff")
    if handoff is None:
        raise RuntimeError(f"{url}/admin/status has no 'handoff' section")
    return handoff


def metric_value(text: str, name: str) -> float:
    """The value of the unlabelled sample ``name`` in a Prometheus text page."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return float(value)
    raise RuntimeError(f"{name} is not in /metrics")


async def prefill_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The handoff's figures as /metrics and /admin/status give them (they must agree)."""
    async with session.get(url + "/metrics") as resp:
        resp.raise_for_status()
        text = await resp.text()
    sent = (await handoff_status(session, url))["sent"]
    return {
        "metrics_sent_bytes": metric_value(text, "mooncaked_handoff_sent_bytes_total"),
        "metrics_steps": metric_value(text, "mooncaked_handoff_steps_total"),
        "metrics_step_histogram_count": metric_value(
            text, "mooncaked_handoff_step_exposed_seconds_count"
        ),
        "metrics_step_bytes_sum": metric_value(text, "mooncaked_handoff_step_bytes_sum"),
        "status_sent_bytes": sent["bytes"],
        "status_steps": sent["steps"],
    }


# --------------------------------------------------------------- (a) handoff


# --------------------------------------------------------------- (a) handoff


@dataclass(slots=True)
class _Samples:
    kv: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    window: list[float] = field(default_factory=list)
    exposed: list[float] = field(default_factory=list)
    blocked: list[float] = field(default_factory=list)
    ok: int = 0


async def handoff_sample(
    session: aiohttp.ClientSession,
    prefill: NodeProcess,
    decode: NodeProcess,
    prompt: list[int],
    into: _Samples,
) -> None:
    """One request entering at ``decode``, the prefill node's counters around it."""
    before = (await handoff_status(session, prefill.url))["sent"]
    ok0 = (await handoff_status(session, decode.url))["handoffs"]["ok"]
    r = await complete(session, decode.url, prompt, 1)
    after = (await handoff_status(session, prefill.url))["sent"]
    ok1 = (await handoff_status(session, decode.url))["handoffs"]["ok"]
    if r.prefill_node != prefill.node_id:
        raise RuntimeError(f"prefilled on {r.prefill_node!r}, not {prefill.node_id!r}")
    into.kv.append(after["bytes"] - before["bytes"])
    into.ttft.append(r.ttft_s * 1e3)
    into.window.append((after["send_seconds"] - before["send_seconds"]) * 1e3)
    into.exposed.append((after["exposed_seconds"] - before["exposed_seconds"]) * 1e3)
    into.blocked.append((after["blocked_seconds"] - before["blocked_seconds"]) * 1e3)
    into.ok += ok1 - ok0


async def measure_prompt_len(
    session: aiohttp.ClientSession,
    pairs: dict[bool, tuple[NodeProcess, NodeProcess]],
    colocated: NodeProcess,
    prompt_tokens: int,
    reps: int,
    rng: random.Random,
) -> tuple[list[HandoffRow], float]:
    """Handoff rows (layer-wise, after-step) and the colocated TTFT of one prompt
    length. The setups take turns, one request each, so a change in the
    machine's load (it may be shared) hits them alike."""
    urls = [d.url for _, d in pairs.values()] + [colocated.url]
    # A warm-up of this length first: the first run of a shape is slow.
    for url in urls:
        await complete(session, url, random_prompt(rng, prompt_tokens), 1)
    samples = {layerwise: _Samples() for layerwise in pairs}
    colocated_ttft: list[float] = []
    for _ in range(reps):
        for layerwise, (p, d) in pairs.items():
            prompt = random_prompt(rng, prompt_tokens)
            await handoff_sample(session, p, d, prompt, samples[layerwise])
        r = await complete(session, colocated.url, random_prompt(rng, prompt_tokens), 1)
        colocated_ttft.append(r.ttft_s * 1e3)
    rows = [
        HandoffRow(
            prompt_tokens=prompt_tokens,
            layerwise=layerwise,
            kv_bytes=statistics.median(s.kv),
            ttft_ms=statistics.median(s.ttft),
            send_window_ms=statistics.median(s.window),
            exposed_ms=statistics.median(s.exposed),
            handoffs_ok=s.ok,
            reps=reps,
            blocked_ms=statistics.median(s.blocked),
        )
        for layerwise, s in samples.items()
    ]
    return rows, statistics.median(colocated_ttft)


# ---------------------------------------------------------- (b) interference


# ---------------------------------------------------------- (b) interference


async def measure_interference(
    session: aiohttp.ClientSession,
    setup: str,
    urls: Sequence[str],
    args: argparse.Namespace,
    rng: random.Random,
) -> InterferenceRow:
    """Streams i go to ``urls[i % n]``, long prompt k to ``urls[k % n]``."""
    # Warm-ups of both shapes on every target.
    for url in urls:
        await complete(session, url, random_prompt(rng, args.long_prompt), 1)
        await complete(session, url, random_prompt(rng, args.stream_prompt), 4)
    gaps: list[float] = []
    long_ttfts: list[float] = []
    end = time.monotonic() + args.window_s

    async def stream(url: str) -> None:
        while time.monotonic() < end:
            r = await complete(
                session, url, random_prompt(rng, args.stream_prompt), args.stream_tokens
            )
            gaps.extend(b - a for a, b in zip(r.token_times, r.token_times[1:], strict=False))

    async def long_prompt(url: str, delay: float) -> None:
        await asyncio.sleep(delay)
        long_ttfts.append(
            (await complete(session, url, random_prompt(rng, args.long_prompt), 1)).ttft_s
        )

    num_long = max(1, int(args.window_s / args.long_every_s))
    async with asyncio.TaskGroup() as tg:
        for i in range(args.streams):
            tg.create_task(stream(urls[i % len(urls)]))
        for k in range(num_long):
            # The first arrives once the streams are decoding.
            tg.create_task(long_prompt(urls[k % len(urls)], (k + 0.5) * args.long_every_s))
    if not gaps:
        raise RuntimeError(f"{setup}: the decode streams produced no inter-token gaps")
    return InterferenceRow(
        setup=setup,
        gaps=len(gaps),
        p50_ms=percentile(gaps, 50) * 1e3,
        p99_ms=percentile(gaps, 99) * 1e3,
        long_prompts=len(long_ttfts),
        long_ttft_ms=statistics.median(long_ttfts) * 1e3,
    )


# --------------------------------------------------------------------- command


def _lengths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def configure(p: argparse.ArgumentParser) -> None:
    """``bench disagg``'s options."""
    # The builtin model holds 4,096 positions: a 4,095-token prompt leaves one to generate.
    p.add_argument("--prompt-lens", type=_lengths, default=[1024, 4095])
    p.add_argument("--hop-prompt", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads per daemon")
    p.add_argument("--kv-blocks", type=int, default=2048, help="device KV blocks per daemon")
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-prompt", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--long-prompt", type=int, default=2048)
    p.add_argument("--long-every-s", type=float, default=2.0)
    p.add_argument("--window-s", type=float, default=20.0)
    p.add_argument("--skip-interference", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--model",
        default="builtin:tiny",
        help="model.path of every daemon (e.g. a .gguf file: a model of many layers "
        "shows what layer-wise streaming hides; the builtin one has 4)",
    )
    p.add_argument("--result-json", type=Path, default=None, help="also write the figures here")


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the option whose value cannot be measured with."""
    for name in (
        "hop_prompt",
        "reps",
        "cpu_threads",
        "kv_blocks",
        "max_batched_tokens",
        "streams",
        "stream_prompt",
        "stream_tokens",
        "long_prompt",
    ):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("long_every_s", "window_s"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")


async def run(args: argparse.Namespace, workdir: Path, progress: TextIO) -> Results:
    res = Results()
    rng = random.Random(args.seed)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # All six daemons at once; an idle one costs next to no CPU.
        async with contextlib.AsyncExitStack() as stack:
            pairs = {
                layerwise: await stack.enter_async_context(
                    disagg_pair(args, workdir, session, layerwise=layerwise)
                )
                for layerwise in (True, False)
            }
            both = await stack.enter_async_context(colocated_pair(args, workdir))
            for n in [*args.prompt_lens, args.hop_prompt]:
                rows, colocated = await measure_prompt_len(
                    session, pairs, both[0], n, args.reps, rng
                )
                res.handoff.extend(rows)
                res.ttft_disagg[n] = rows[0].ttft_ms
                res.ttft_colocated[n] = colocated
                progress.write(f"  handoff and TTFT, {n} tokens: done\n")
            res.prefill_metrics = await prefill_metrics(session, pairs[True][0].url)
            if not args.skip_interference:
                decode = pairs[True][1]
                res.interference.append(
                    await measure_interference(session, "1P+1D", [decode.url], args, rng)
                )
                progress.write("  interference 1P+1D: done\n")
                res.interference.append(
                    await measure_interference(session, "2x both", [d.url for d in both], args, rng)
                )
                progress.write("  interference 2x both: done\n")
    return res


def command(args: argparse.Namespace, env: Env) -> int:
    """``mooncakectl bench disagg``: the figures printed (to stderr with
    ``--json``, which prints them as JSON instead), and with ``--result-json``
    written there."""
    check_args(args)
    with tempfile.TemporaryDirectory(prefix="bench-disagg-") as tmp:
        res = asyncio.run(run(args, Path(tmp), env.stderr))
    figures = res.to_dict(args)
    print_report(res, args, env.stderr if args.json else env.stdout)
    if args.json:
        env.stdout.write(json.dumps(figures, indent=1, default=str) + "\n")
    if args.result_json is not None:
        args.result_json.write_text(json.dumps(figures, indent=2, default=str))
    return ExitStatus.OK
