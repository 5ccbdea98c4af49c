"""``bench cpp``'s figures: what each arrangement measured, the speedups of
the pipelined groups over one prefill node, the checks (same greedy text,
cached prefixes reported, the group's head prefilling) and the report."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

# The arrangement every other is compared with: one prefill node.
BASELINE_STAGES = 1


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as the client saw it. ``prompt_tokens`` is its row (the
    fresh prompt's length; a ``reuse`` request resends that prompt with a
    new suffix)."""

    prompt_tokens: int
    rep: int
    reuse: bool
    ttft_ms: float
    text: str
    cached_tokens: int | None
    prefill_node: str | None


@dataclass(frozen=True, slots=True)
class NodeRow:
    """A node of an arrangement: its cores (empty: not pinned) and, for a
    stage, its group and layers as gossip has them."""

    node_id: str
    role: str
    cpus: str = ""
    stage: str = ""


@dataclass(slots=True)
class Arrangement:
    """One cluster's run: ``num_stages`` 1 is the single prefill node;
    ``head`` is the node every prefill should run on (the group's head)."""

    num_stages: int
    head: str
    nodes: list[NodeRow] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "1P+1D" if self.num_stages == BASELINE_STAGES else f"CPP {self.num_stages}"

    def mean_ttft(self, prompt_tokens: int, reuse: bool) -> float | None:
        ms = [
            s.ttft_ms for s in self.samples if s.prompt_tokens == prompt_tokens and s.reuse == reuse
        ]
        return statistics.fmean(ms) if ms else None

    def mean_cached(self) -> float | None:
        cached = [s.cached_tokens or 0 for s in self.samples if s.reuse]
        return statistics.fmean(cached) if cached else None


def speedup(baseline_ms: float | None, group_ms: float | None) -> float | None:
    """Baseline TTFT / the group's: above 1, the group answers sooner."""
    if baseline_ms is None or group_ms is None or group_ms <= 0:
        return None
    return baseline_ms / group_ms


def text_mismatches(baseline: Arrangement, other: Arrangement) -> list[tuple[int, int, bool]]:
    """(prompt tokens, rep, reuse) of each of ``other``'s requests whose text
    is not the baseline's for the same prompt (or that the baseline lacks)."""
    want = {(s.prompt_tokens, s.rep, s.reuse): s.text for s in baseline.samples}
    return [
        (s.prompt_tokens, s.rep, s.reuse)
        for s in other.samples
        if want.get((s.prompt_tokens, s.rep, s.reuse)) != s.text
    ]


def misplaced(arr: Arrangement) -> list[Sample]:
    """The requests prefilled on another node than the arrangement's head."""
    return [s for s in arr.samples if s.prefill_node != arr.head]


def uncached(arr: Arrangement) -> list[Sample]:
    """The second-pass requests that reported no cached prompt tokens."""
    return [s for s in arr.samples if s.reuse and not s.cached_tokens]


def not_fresh(arr: Arrangement) -> list[Sample]:
    """The first-pass requests that reported cached prompt tokens: their
    TTFT is not a whole prompt's."""
    return [s for s in arr.samples if not s.reuse and s.cached_tokens]


def failures(arrs: Sequence[Arrangement]) -> list[str]:
    """What the checks found wrong, one line each; empty when all passed."""
    out: list[str] = []
    base = arrs[0]
    for arr in arrs:
        if arr is not base and (bad := text_mismatches(base, arr)):
            out.append(
                f"{arr.name}: {len(bad)} text(s) differ from {base.name}'s: "
                + ", ".join(_key(*k) for k in bad)
            )
        if bad_nodes := misplaced(arr):
            nodes = sorted({str(s.prefill_node) for s in bad_nodes})
            out.append(
                f"{arr.name}: {len(bad_nodes)} of {len(arr.samples)} requests prefilled on "
                f"{', '.join(nodes)}, not on {arr.head}: the Conductor placed them elsewhere"
            )
        if bad_cache := uncached(arr):
            out.append(
                f"{arr.name}: {len(bad_cache)} prefix-reuse request(s) reported no cached "
                "tokens: " + ", ".join(_key(s.prompt_tokens, s.rep, s.reuse) for s in bad_cache)
            )
        if hits := not_fresh(arr):
            out.append(
                f"{arr.name}: {len(hits)} fresh prompt(s) reported cached tokens: "
                + ", ".join(
                    f"{_key(s.prompt_tokens, s.rep, s.reuse)} ({s.cached_tokens})" for s in hits
                )
            )
    return out


def _key(prompt_tokens: int, rep: int, reuse: bool) -> str:
    return f"{prompt_tokens} tokens rep {rep}{' + suffix' if reuse else ''}"


def ttft_table(arrs: Sequence[Arrangement], prompt_lens: Iterable[int], reuse: bool) -> list[str]:
    """Lines: per prompt length the mean TTFT of every arrangement, and after
    each group's the speedup over the first arrangement's."""
    base = arrs[0]
    head = f"{'prompt':>7} {base.name + ' ms':>11}"
    for arr in arrs[1:]:
        head += f" {arr.name + ' ms':>11} {'speedup':>8}"
    lines = [head]
    for n in prompt_lens:
        base_ms = base.mean_ttft(n, reuse)
        line = f"{n:>7} {_ms(base_ms):>11}"
        for arr in arrs[1:]:
            ms = arr.mean_ttft(n, reuse)
            ratio = speedup(base_ms, ms)
            line += f" {_ms(ms):>11} {'-' if ratio is None else f'{ratio:.2f}x':>8}"
        lines.append(line)
    return lines


def _ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.1f}"


def _identity_line(base: Arrangement, arr: Arrangement) -> str:
    bad = set(text_mismatches(base, arr))
    parts = []
    for reuse, what in ((False, "fresh"), (True, "prefix cached")):
        keys = [(s.prompt_tokens, s.rep, s.reuse) for s in arr.samples if s.reuse == reuse]
        same = sum(k not in bad for k in keys)
        parts.append(f"{what} {same}/{len(keys)} same")
    return f"  {arr.name} vs {base.name}: {', '.join(parts)}\n"


def print_report(
    arrs: Sequence[Arrangement], prompt_lens: Sequence[int], title: str, out: TextIO
) -> None:
    """The nodes of each arrangement, the two TTFT tables, the checks."""
    out.write(f"{title}\n")
    for arr in arrs:
        nodes = "; ".join(
            f"{n.node_id}{f' cpu {n.cpus}' if n.cpus else ''}{f' ({n.stage})' if n.stage else ''}"
            for n in arr.nodes
        )
        out.write(f"  {arr.name}: {nodes}\n")
    out.write("\nTTFT, fresh prompts (client side, mean ms; speedup = 1P+1D / CPP)\n")
    out.writelines(line + "\n" for line in ttft_table(arrs, prompt_lens, reuse=False))
    out.write("\nTTFT, each prompt again with a new suffix (its prefix cached)\n")
    out.writelines(line + "\n" for line in ttft_table(arrs, prompt_lens, reuse=True))
    out.write("\ngreedy text (temperature 0, ignore_eos), the same prompts in every arrangement:\n")
    for arr in arrs[1:]:
        out.write(_identity_line(arrs[0], arr))
    cached = ", ".join(f"{a.name} {_ms(a.mean_cached())}" for a in arrs)
    out.write(f"cached prompt tokens per prefix-reuse request (mean): {cached}\n")
    bad = failures(arrs)
    out.write("checks: " + ("ok\n" if not bad else "FAILED\n" + "".join(f"  {b}\n" for b in bad)))


def figures(
    arrs: Sequence[Arrangement], prompt_lens: Sequence[int], run: dict[str, Any]
) -> dict[str, Any]:
    """What ``--json`` writes: the run's settings, each arrangement with its
    nodes and requests, the mean TTFTs and speedups per length, the checks."""
    base = arrs[0]
    means: dict[str, Any] = {}
    for arr in arrs:
        means[arr.name] = {
            pass_name: {str(n): arr.mean_ttft(n, reuse) for n in prompt_lens}
            for pass_name, reuse in (("fresh", False), ("reuse", True))
        }
    speedups = {
        arr.name: {
            pass_name: {
                str(n): speedup(base.mean_ttft(n, reuse), arr.mean_ttft(n, reuse))
                for n in prompt_lens
            }
            for pass_name, reuse in (("fresh", False), ("reuse", True))
        }
        for arr in arrs[1:]
    }
    return {
        "run": run,
        "arrangements": [
            {
                "name": a.name,
                "num_stages": a.num_stages,
                "head": a.head,
                "nodes": [asdict(n) for n in a.nodes],
                "samples": [asdict(s) for s in a.samples],
            }
            for a in arrs
        ],
        "mean_ttft_ms": means,
        "speedup": speedups,
        "failures": failures(arrs),
    }
