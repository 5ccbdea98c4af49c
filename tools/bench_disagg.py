"""Benchmark of prefill/decode disaggregation, against colocated serving, on loopback.

    python tools/bench_disagg.py                     # default sizes
    python tools/bench_disagg.py --reps 3 --window-s 10
    python tools/bench_disagg.py --json out.json     # also write the figures

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
import math
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO_ROOT = Path(__file__).resolve().parent.parent
SECRET = "bench-disagg-secret-of-at-least-32-bytes"
PREFILL_NODE_HEADER = "x-mooncaked-prefill-node"
_START_TIMEOUT_S = 120.0
# The builtin model's byte tokens; ids below 32 hold its special tokens.
_TOKEN_LO, _TOKEN_HI = 32, 256
EXPOSED_GOAL = 0.2
INTERFERENCE_GOAL = 0.5


# ----------------------------------------------------------------- daemons


def free_port() -> int:
    """A port free for both TCP and UDP (gossip uses both)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind(("127.0.0.1", 0))
            port = tcp.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    raise RuntimeError("no port free for both TCP and UDP on 127.0.0.1")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ValueError(f"cannot write {v!r} as TOML")


def render_toml(sections: dict[str, dict[str, Any]]) -> str:
    return "".join(
        f"[{name}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in table.items())
        for name, table in sections.items()
    )


@dataclass(slots=True)
class Daemon:
    node_id: str
    proc: asyncio.subprocess.Process
    url: str
    log_path: Path

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 30.0)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


class Cluster:
    """Daemons started in order and stopped in reverse, also when a start fails."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self._args = args
        self._workdir = workdir
        self.daemons: list[Daemon] = []

    def sections(
        self, node_id: str, role: str, *, layerwise: bool = True
    ) -> dict[str, dict[str, Any]]:
        a = self._args
        return {
            "node": {"id": node_id, "role": role, "cluster_secret": SECRET},
            "server": {"host": "127.0.0.1", "port": 0, "drain_timeout_s": 5.0},
            "model": {"cpu_threads": a.cpu_threads, "path": a.model},
            "kv": {"num_blocks": a.kv_blocks},
            "scheduler": {"max_num_batched_tokens": a.max_batched_tokens},
            "disagg": {"layerwise": layerwise},
            "log": {"level": "warning", "format": "json"},
        }

    async def start(self, node_id: str, sections: dict[str, dict[str, Any]]) -> Daemon:
        cfg = self._workdir / f"{node_id}.toml"
        cfg.write_text(render_toml(sections))
        log_path = self._workdir / f"{node_id}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        with log_path.open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "mooncaked",
                "--config",
                str(cfg),
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                env=env,
                cwd=self._workdir,
            )
        if proc.stdout is None:
            raise RuntimeError("the daemon's stdout is not a pipe")
        prefix = "mooncaked listening on "
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), _START_TIMEOUT_S)).decode()
        except TimeoutError:
            line = ""
        if not line.startswith(prefix):
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            raise RuntimeError(
                f"daemon {node_id} did not start (exit {proc.returncode}); log:\n"
                + log_path.read_text(errors="replace")[-3000:]
            )
        daemon = Daemon(node_id, proc, line[len(prefix) :].strip(), log_path)
        self.daemons.append(daemon)
        return daemon

    async def stop(self) -> None:
        for d in reversed(self.daemons):
            await d.stop()
        self.daemons.clear()


@contextlib.asynccontextmanager
async def disagg_pair(
    args: argparse.Namespace, workdir: Path, session: aiohttp.ClientSession, *, layerwise: bool
) -> AsyncIterator[tuple[Daemon, Daemon]]:
    """A prefill node and a decode node in one cluster; yields (prefill, decode)."""
    cluster = Cluster(args, workdir)
    tag = "lw" if layerwise else "as"
    try:
        gossip = free_port()
        p_sections = cluster.sections(f"p-{tag}", "prefill", layerwise=layerwise)
        p_sections["cluster"] = {"gossip_port": gossip, **_FAST_GOSSIP}
        prefill = await cluster.start(f"p-{tag}", p_sections)
        d_sections = cluster.sections(f"d-{tag}", "decode", layerwise=layerwise)
        d_sections["cluster"] = {"seeds": [f"127.0.0.1:{gossip}"], **_FAST_GOSSIP}
        decode = await cluster.start(f"d-{tag}", d_sections)
        await wait_disagg(session, decode.url, prefill.node_id)
        yield prefill, decode
    finally:
        await cluster.stop()


@contextlib.asynccontextmanager
async def colocated_pair(
    args: argparse.Namespace, workdir: Path
) -> AsyncIterator[tuple[Daemon, Daemon]]:
    """Two ``both`` daemons, each a cluster of one."""
    cluster = Cluster(args, workdir)
    try:
        a = await cluster.start("both-0", cluster.sections("both-0", "both"))
        b = await cluster.start("both-1", cluster.sections("both-1", "both"))
        yield a, b
    finally:
        await cluster.stop()


# Gossip spreads the prefill node to the decode node sooner.
_FAST_GOSSIP: dict[str, Any] = {"gossip_interval_s": 0.1}


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


@dataclass(slots=True)
class HandoffRow:
    prompt_tokens: int
    layerwise: bool
    kv_bytes: float
    ttft_ms: float
    send_window_ms: float
    exposed_ms: float
    handoffs_ok: int
    reps: int


@dataclass(slots=True)
class _Samples:
    kv: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    window: list[float] = field(default_factory=list)
    exposed: list[float] = field(default_factory=list)
    ok: int = 0


async def handoff_sample(
    session: aiohttp.ClientSession,
    prefill: Daemon,
    decode: Daemon,
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
    into.ok += ok1 - ok0


async def measure_prompt_len(
    session: aiohttp.ClientSession,
    pairs: dict[bool, tuple[Daemon, Daemon]],
    colocated: Daemon,
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
        )
        for layerwise, s in samples.items()
    ]
    return rows, statistics.median(colocated_ttft)


# ---------------------------------------------------------- (b) interference


@dataclass(slots=True)
class InterferenceRow:
    setup: str
    gaps: int
    p50_ms: float
    p99_ms: float
    long_prompts: int
    long_ttft_ms: float


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; q in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100.0 * len(ordered))))
    return ordered[rank - 1]


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


# ------------------------------------------------------------------- report


@dataclass(slots=True)
class Results:
    handoff: list[HandoffRow] = field(default_factory=list)
    # Prompt length -> median TTFT (ms).
    ttft_disagg: dict[int, float] = field(default_factory=dict)
    ttft_colocated: dict[int, float] = field(default_factory=dict)
    interference: list[InterferenceRow] = field(default_factory=list)
    # The layer-wise prefill node's /metrics and status figures after (a).
    prefill_metrics: dict[str, float] = field(default_factory=dict)

    def exposed_ratio(self, prompt_tokens: int, floor_of: int | None = None) -> float | None:
        """Layer-wise exposed / raw transfer time (the after-the-step exposed time).

        With ``floor_of``, both less the exposed time of that (tiny) prompt in
        the same mode: the fixed latency of a batch of writes, which no overlap
        can hide, taken out to show what the overlap did to the byte-bound part.
        """
        by = {(r.prompt_tokens, r.layerwise): r for r in self.handoff}
        lw, raw = by.get((prompt_tokens, True)), by.get((prompt_tokens, False))
        if lw is None or raw is None:
            return None
        lw_ms, raw_ms = lw.exposed_ms, raw.exposed_ms
        if floor_of is not None:
            lw_floor, raw_floor = by.get((floor_of, True)), by.get((floor_of, False))
            if lw_floor is None or raw_floor is None:
                return None
            lw_ms, raw_ms = lw_ms - lw_floor.exposed_ms, raw_ms - raw_floor.exposed_ms
        if raw_ms <= 0:
            return None
        return max(lw_ms, 0.0) / raw_ms

    def to_dict(self, args: argparse.Namespace) -> dict[str, Any]:
        return {
            "args": vars(args),
            "handoff": [asdict(r) for r in self.handoff],
            "exposed_ratio": {n: self.exposed_ratio(n) for n in args.prompt_lens},
            "exposed_ratio_over_floor": {
                n: self.exposed_ratio(n, floor_of=args.hop_prompt) for n in args.prompt_lens
            },
            "ttft_disagg_ms": self.ttft_disagg,
            "ttft_colocated_ms": self.ttft_colocated,
            "hop_ms": self.hop_ms(args.hop_prompt),
            "interference": [asdict(r) for r in self.interference],
            "interference_ratio": self.interference_ratio(),
            "prefill_metrics": self.prefill_metrics,
        }

    def hop_ms(self, hop_prompt: int) -> float | None:
        if hop_prompt in self.ttft_disagg and hop_prompt in self.ttft_colocated:
            return self.ttft_disagg[hop_prompt] - self.ttft_colocated[hop_prompt]
        return None

    def interference_ratio(self) -> float | None:
        by = {r.setup: r for r in self.interference}
        if "1P+1D" not in by or "2x both" not in by or by["2x both"].p99_ms <= 0:
            return None
        return by["1P+1D"].p99_ms / by["2x both"].p99_ms


def _goal(value: float | None, goal: float) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f} (goal <= {goal}: {'met' if value <= goal else 'NOT met'})"


def print_report(res: Results, args: argparse.Namespace) -> None:
    out = sys.stdout
    print(
        f"\nbench_disagg: {args.model}, {args.cpu_threads} torch thread(s) per daemon, "
        f"max_num_batched_tokens {args.max_batched_tokens}, medians of {args.reps}",
        file=out,
    )
    print("\n(a) KV handoff, prefill node -> decode node (loopback)", file=out)
    print(
        f"{'prompt':>7} {'mode':<11} {'KV MiB':>8} {'TTFT ms':>9} {'window ms':>10} "
        f"{'exposed ms':>11} {'GB/s':>7} {'ok':>4}",
        file=out,
    )
    for r in res.handoff:
        # Only the baseline's exposed time is the raw transfer time.
        rate = (
            f"{r.kv_bytes / (r.exposed_ms / 1e3) / 1e9:>7.3f}"
            if not r.layerwise and r.exposed_ms > 0
            else f"{'-':>7}"
        )
        print(
            f"{r.prompt_tokens:>7} {'layer-wise' if r.layerwise else 'after-step':<11} "
            f"{r.kv_bytes / 2**20:>8.2f} {r.ttft_ms:>9.1f} {r.send_window_ms:>10.2f} "
            f"{r.exposed_ms:>11.3f} {rate} "
            f"{r.handoffs_ok:>4}",
            file=out,
        )
    print(
        "  window: first layer done -> KV complete; exposed: last layer done -> KV complete;\n"
        "  raw transfer = the after-step exposed time (nothing overlaps it); GB/s = KV / raw",
        file=out,
    )
    for n in args.prompt_lens:
        print(
            f"  exposed / raw, {n:>5} tokens, layer-wise: {_goal(res.exposed_ratio(n), EXPOSED_GOAL)}",
            file=out,
        )
    for n in args.prompt_lens:
        over = res.exposed_ratio(n, floor_of=args.hop_prompt)
        print(
            f"  (exposed - floor) / (raw - floor), {n:>5} tokens, floor = the "
            f"{args.hop_prompt}-token row: {'n/a' if over is None else f'{over:.3f}'}",
            file=out,
        )
    print("\nTTFT, disaggregated (1P+1D, layer-wise) vs colocated (one both daemon)", file=out)
    print(f"{'prompt':>7} {'disagg ms':>10} {'colocated ms':>13} {'ratio':>7}", file=out)
    for n in sorted(res.ttft_disagg):
        d, c = res.ttft_disagg[n], res.ttft_colocated.get(n)
        ratio = f"{d / c:>7.2f}" if c else f"{'n/a':>7}"
        print(f"{n:>7} {d:>10.1f} {c if c is not None else float('nan'):>13.1f} {ratio}", file=out)
    hop = res.hop_ms(args.hop_prompt)
    if hop is not None:
        print(
            f"  fixed cost of the extra hop (TTFT difference, {args.hop_prompt}-token prompt): "
            f"{hop:.1f} ms",
            file=out,
        )
    if res.interference:
        print(
            f"\n(b) interference: {args.streams} decode streams ({args.stream_prompt} in, "
            f"{args.stream_tokens} out) + a {args.long_prompt}-token prompt every "
            f"{args.long_every_s} s for {args.window_s} s",
            file=out,
        )
        print(
            f"{'setup':<9} {'gaps':>6} {'p50 ms':>8} {'p99 ms':>8} {'long':>5} "
            f"{'long TTFT ms':>13}",
            file=out,
        )
        for r in res.interference:
            print(
                f"{r.setup:<9} {r.gaps:>6} {r.p50_ms:>8.1f} {r.p99_ms:>8.1f} "
                f"{r.long_prompts:>5} {r.long_ttft_ms:>13.1f}",
                file=out,
            )
        print(
            f"  p99 between tokens, 1P+1D / 2x both: "
            f"{_goal(res.interference_ratio(), INTERFERENCE_GOAL)}",
            file=out,
        )


# --------------------------------------------------------------------- main


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
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
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
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
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("long_every_s", "window_s"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    return args


async def run(args: argparse.Namespace, workdir: Path) -> Results:
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
                print(f"  handoff and TTFT, {n} tokens: done", file=sys.stderr)
            res.prefill_metrics = await prefill_metrics(session, pairs[True][0].url)
            if not args.skip_interference:
                decode = pairs[True][1]
                res.interference.append(
                    await measure_interference(session, "1P+1D", [decode.url], args, rng)
                )
                print("  interference 1P+1D: done", file=sys.stderr)
                res.interference.append(
                    await measure_interference(session, "2x both", [d.url for d in both], args, rng)
                )
                print("  interference 2x both: done", file=sys.stderr)
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-disagg-") as tmp:
        res = asyncio.run(run(args, Path(tmp)))
    print_report(res, args)
    if args.json is not None:
        args.json.write_text(json.dumps(res.to_dict(args), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
