"""``bench disagg``'s figures: the rows it measured, the ratios against the
baselines it ran beside them and their goals, and the printed report."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

EXPOSED_GOAL = 0.2
INTERFERENCE_GOAL = 0.5
# The command line's own options, not the benchmark's: left out of the figures.
_NOT_FIGURES = ("command", "workload", "url", "admin_token", "timeout")


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
    # Of the exposed time, what the steps waited for after their head and sampling.
    blocked_ms: float = 0.0


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
            "args": {k: v for k, v in vars(args).items() if k not in _NOT_FIGURES},
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


def print_report(res: Results, args: argparse.Namespace, out: TextIO) -> None:
    out.write(
        f"\nbench disagg: {args.model}, {args.cpu_threads} torch thread(s) per daemon, "
        f"max_num_batched_tokens {args.max_batched_tokens}, medians of {args.reps}\n"
    )
    _print_handoff(res, args, out)
    _print_ttft(res, args, out)
    if res.interference:
        _print_interference(res, args, out)


def _print_handoff(res: Results, args: argparse.Namespace, out: TextIO) -> None:
    out.write("\n(a) KV handoff, prefill node -> decode node (loopback)\n")
    out.write(
        f"{'prompt':>7} {'mode':<11} {'KV MiB':>8} {'TTFT ms':>9} {'window ms':>10} "
        f"{'exposed ms':>11} {'blocked ms':>11} {'GB/s':>7} {'ok':>4}\n"
    )
    for r in res.handoff:
        # Only the baseline's exposed time is the raw transfer time.
        rate = (
            f"{r.kv_bytes / (r.exposed_ms / 1e3) / 1e9:>7.3f}"
            if not r.layerwise and r.exposed_ms > 0
            else f"{'-':>7}"
        )
        out.write(
            f"{r.prompt_tokens:>7} {'layer-wise' if r.layerwise else 'after-step':<11} "
            f"{r.kv_bytes / 2**20:>8.2f} {r.ttft_ms:>9.1f} {r.send_window_ms:>10.2f} "
            f"{r.exposed_ms:>11.3f} {r.blocked_ms:>11.3f} {rate} "
            f"{r.handoffs_ok:>4}\n"
        )
    out.write(
        "  window: first layer done -> KV complete; exposed: last layer done -> KV complete;\n"
        "  blocked: of that, what the step waited for after its head and sampling;\n"
        "  raw transfer = the after-step exposed time (nothing overlaps it); GB/s = KV / raw\n"
    )
    for n in args.prompt_lens:
        goal = _goal(res.exposed_ratio(n), EXPOSED_GOAL)
        out.write(f"  exposed / raw, {n:>5} tokens, layer-wise: {goal}\n")
    for n in args.prompt_lens:
        over = res.exposed_ratio(n, floor_of=args.hop_prompt)
        out.write(
            f"  (exposed - floor) / (raw - floor), {n:>5} tokens, floor = the "
            f"{args.hop_prompt}-token row: {'n/a' if over is None else f'{over:.3f}'}\n"
        )


def _print_ttft(res: Results, args: argparse.Namespace, out: TextIO) -> None:
    out.write("\nTTFT, disaggregated (1P+1D, layer-wise) vs colocated (one both daemon)\n")
    out.write(f"{'prompt':>7} {'disagg ms':>10} {'colocated ms':>13} {'ratio':>7}\n")
    for n in sorted(res.ttft_disagg):
        d, c = res.ttft_disagg[n], res.ttft_colocated.get(n)
        ratio = f"{d / c:>7.2f}" if c else f"{'n/a':>7}"
        out.write(f"{n:>7} {d:>10.1f} {c if c is not None else float('nan'):>13.1f} {ratio}\n")
    hop = res.hop_ms(args.hop_prompt)
    if hop is not None:
        out.write(
            f"  fixed cost of the extra hop (TTFT difference, {args.hop_prompt}-token prompt): "
            f"{hop:.1f} ms\n"
        )


def _print_interference(res: Results, args: argparse.Namespace, out: TextIO) -> None:
    out.write(
        f"\n(b) interference: {args.streams} decode streams ({args.stream_prompt} in, "
        f"{args.stream_tokens} out) + a {args.long_prompt}-token prompt every "
        f"{args.long_every_s} s for {args.window_s} s\n"
    )
    out.write(
        f"{'setup':<9} {'gaps':>6} {'p50 ms':>8} {'p99 ms':>8} {'long':>5} {'long TTFT ms':>13}\n"
    )
    for r in res.interference:
        out.write(
            f"{r.setup:<9} {r.gaps:>6} {r.p50_ms:>8.1f} {r.p99_ms:>8.1f} "
            f"{r.long_prompts:>5} {r.long_ttft_ms:>13.1f}\n"
        )
    goal = _goal(res.interference_ratio(), INTERFERENCE_GOAL)
    out.write(f"  p99 between tokens, 1P+1D / 2x both: {goal}\n")
