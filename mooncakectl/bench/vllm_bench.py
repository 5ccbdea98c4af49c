"""The inputs and the report of the side-by-side benchmark against vLLM
(``tools/bench_vllm.py``): the workloads, the ``mooncakectl bench random``
command line each one becomes, the vLLM server's command line, where the
anchor (``tools/vllm_anchor.sh``) put vLLM, and the ratio table. Pure but for
reading the anchor's file."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mooncakectl.bench.anchors import AnchorError, anchor_env

OURS, THEIRS = "mooncaked", "vllm"
SERVERS = (OURS, THEIRS)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """One load, sent the same way to each server by ``mooncakectl bench random``."""

    name: str
    num_prompts: int
    input_len: int
    output_len: int
    max_concurrency: int
    # Lengths drawn uniformly in [len * (1 - ratio), len * (1 + ratio)].
    range_ratio: float = 0.0
    # Tokens every prompt starts with, ahead of its input_len own ones.
    prefix_len: int = 0

    def describe(self) -> str:
        spread = f"±{self.range_ratio:.0%}" if self.range_ratio else ""
        prefix = f"{self.prefix_len:,}-token shared prefix + " if self.prefix_len else ""
        return (
            f"{self.num_prompts} requests, {self.max_concurrency} at a time, "
            f"{prefix}{self.input_len}{spread} in, {self.output_len}{spread} out"
        )

    def bench_argv(
        self, url: str, *, vocab_size: int, max_model_len: int, seed: int, num_warmups: int
    ) -> list[str]:
        """``mooncakectl`` arguments that send this load to ``url`` and print a JSON summary."""
        return [
            "--url",
            url,
            "bench",
            "random",
            "--json",
            "--prompt-format",
            "ids",
            # Neither server says its vocabulary in /v1/models: given, so the
            # prompts (drawn from --seed) are the same token ids on both.
            "--vocab-size",
            str(vocab_size),
            "--max-model-len",
            str(max_model_len),
            "--seed",
            str(seed),
            "--num-warmups",
            str(num_warmups),
            "--num-prompts",
            str(self.num_prompts),
            "--max-concurrency",
            str(self.max_concurrency),
            "--random-input-len",
            str(self.input_len),
            "--random-output-len",
            str(self.output_len),
            "--random-range-ratio",
            str(self.range_ratio),
            "--random-prefix-len",
            str(self.prefix_len),
        ]


WORKLOADS = {
    w.name: w
    for w in (
        WorkloadSpec("single", num_prompts=4, input_len=128, output_len=128, max_concurrency=1),
        WorkloadSpec(
            "batch",
            num_prompts=64,
            input_len=256,
            output_len=128,
            max_concurrency=16,
            range_ratio=0.5,
        ),
        WorkloadSpec(
            "prefix",
            num_prompts=16,
            input_len=64,
            output_len=64,
            max_concurrency=4,
            prefix_len=1024,
        ),
    )
}


def pick_workloads(names: str, num_prompts: int | None = None) -> list[WorkloadSpec]:
    """``names`` (comma-separated keys of WORKLOADS), each with ``num_prompts``
    requests when given (a smoke run), never fewer than it sends at a time."""
    out: list[WorkloadSpec] = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
        w = WORKLOADS[name]
        if num_prompts is not None:
            if num_prompts < 1:
                raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
            w = replace(
                w, num_prompts=num_prompts, max_concurrency=min(w.max_concurrency, num_prompts)
            )
        out.append(w)
    if not out:
        raise ValueError("no workload given")
    return out


def vllm_argv(
    python: str, model_dir: Path, port: int, *, dtype: str, max_model_len: int
) -> list[str]:
    """vLLM's OpenAI server with its defaults but for the model, dtype and context.

    Its ``vllm`` console script fails on the CPU build; the module runs."""
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        model_dir.name,
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def vllm_env(kv_cache_gib: float) -> dict[str, str]:
    """Environment for vLLM's CPU build. Its KV cache is a fixed size on the
    CPU (its GPU-style default share of memory fails on a machine whose memory
    is in use); telemetry off, as nothing outside this machine is reached."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


@dataclass(frozen=True, slots=True)
class VllmAnchor:
    """Where tools/vllm_anchor.sh installed vLLM."""

    python: Path
    version: str
    torch_version: str


def read_anchor(spec: str, script: Path | None = None) -> VllmAnchor:
    """``auto``: ask the anchor ``script`` where it installed vLLM; else the
    path of the anchor.env it wrote."""
    env = anchor_env(spec, script, flag="--anchor", missing="vLLM is not installed")
    if not env.get("VLLM_ANCHOR_PYTHON"):
        raise AnchorError(f"--anchor {spec}: the anchor file has no VLLM_ANCHOR_PYTHON")
    return VllmAnchor(
        python=Path(env["VLLM_ANCHOR_PYTHON"]),
        version=env.get("VLLM_VERSION", "unknown"),
        torch_version=env.get("VLLM_TORCH_VERSION", "unknown"),
    )


@dataclass(frozen=True, slots=True)
class Figures:
    """What one run of one workload on one server measured."""

    output_tok_s: float
    ttft_ms: float
    tpot_ms: float
    completed: int
    num_requests: int

    @classmethod
    def from_summary(cls, summary: Mapping[str, Any]) -> Figures:
        """From ``mooncakectl bench random --json``'s summary (vLLM's flat names)."""

        def ms(key: str) -> float:
            value = summary.get(key)
            return float(value) if isinstance(value, int | float) else float("nan")

        return cls(
            output_tok_s=float(summary["output_throughput"]),
            ttft_ms=ms("mean_ttft_ms"),
            tpot_ms=ms("mean_tpot_ms"),
            completed=int(summary["completed"]),
            num_requests=int(summary["num_requests"]),
        )


# (label, Figures attribute, whether higher is better)
METRICS = (
    ("output tok/s", "output_tok_s", True),
    ("mean TTFT ms", "ttft_ms", False),
    ("mean TPOT ms", "tpot_ms", False),
)


def _cell(values: Sequence[float]) -> str:
    """The median of the rounds, with their range when there are several."""
    if not values:
        return "-"
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:.1f}"
    return f"{mid:.1f} [{min(values):.1f}-{max(values):.1f}]"


def _completed(figures: Sequence[Figures]) -> str:
    if not figures:
        return "-"
    return f"{sum(f.completed for f in figures)}/{sum(f.num_requests for f in figures)}"


def ratio(ours: Sequence[float], theirs: Sequence[float]) -> float | None:
    """mooncaked / vLLM of the medians; None when either is missing or vLLM's is 0."""
    if not ours or not theirs:
        return None
    base = statistics.median(theirs)
    return statistics.median(ours) / base if base else None


def ratio_table(
    workloads: Sequence[WorkloadSpec], runs: Mapping[str, Mapping[str, Sequence[Figures]]]
) -> str:
    """Per workload and metric: each server's median over rounds [range] and
    mooncaked / vLLM. ``runs``: workload name -> server -> one Figures a round."""
    rows = [("workload", "metric", OURS, THEIRS, f"{OURS} / {THEIRS}")]
    for w in workloads:
        by_server = runs.get(w.name, {})
        for label, attr, higher in METRICS:
            ours = [getattr(f, attr) for f in by_server.get(OURS, ())]
            theirs = [getattr(f, attr) for f in by_server.get(THEIRS, ())]
            r = ratio(ours, theirs)
            better = "higher is better" if higher else "lower is better"
            rows.append(
                (
                    w.name,
                    label,
                    _cell(ours),
                    _cell(theirs),
                    "-" if r is None else f"{r:.2f}x ({better})",
                )
            )
        ours_done, theirs_done = (_completed(by_server.get(s, ())) for s in SERVERS)
        rows.append((w.name, "completed", ours_done, theirs_done, ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[j]) for j, c in enumerate(r)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class GreedyCheck:
    """Both servers' greedy completions of the same prompts."""

    prompts: tuple[str, ...]
    texts: Mapping[str, tuple[str, ...]]

    def report(self) -> str:
        ours, theirs = self.texts.get(OURS, ()), self.texts.get(THEIRS, ())
        same = sum(a == b for a, b in zip(ours, theirs, strict=False))
        lines = [f"greedy text: {same}/{len(self.prompts)} prompts identical"]
        for p, a, b in zip(self.prompts, ours, theirs, strict=False):
            if a != b:
                k = next(
                    (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                    min(len(a), len(b)),
                )
                lines.append(f"  {p!r}: the same for {k} chars; then")
                lines.append(f"    {OURS}: {a[k : k + 60]!r}")
                lines.append(f"    {THEIRS}: {b[k : k + 60]!r}")
        return "\n".join(lines)


GREEDY_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
)
