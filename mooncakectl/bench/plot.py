"""PNGs from a run's records (matplotlib: ``pip install 'mooncaked[plot]'``).

- ``latency_cdf.png``: CDFs of TTFT, TPOT, ITL and E2EL;
- ``throughput.png``: output tokens per second and requests in flight over time;
- ``cached_share.png``: the share of prompt tokens served from the server's
  cache, per interval of completion time.

The series are computed here from the records alone (``series_*``), so they
are tested without matplotlib.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mooncakectl.bench.metrics import METRIC_NAMES, RequestRecord

# About this many time bins over a run, never narrower than this.
_NUM_BINS = 60
_MIN_BIN_S = 0.05


def bin_width(duration_s: float) -> float:
    return max(_MIN_BIN_S, duration_s / _NUM_BINS)


def series_output_rate(
    records: Sequence[RequestRecord], duration_s: float, width: float
) -> tuple[np.ndarray, np.ndarray]:
    """(bin starts, output tokens/s): each request's tokens spread over its chunks."""
    n = max(1, math.ceil(duration_s / width))
    tokens = np.zeros(n)
    for r in records:
        if r.warmup or not r.ok or not r.chunk_s:
            continue
        per_chunk = r.num_output_tokens / len(r.chunk_s)
        for t in r.chunk_s:
            tokens[min(n - 1, max(0, int(t / width)))] += per_chunk
    return np.arange(n) * width, tokens / width


def series_in_flight(
    records: Sequence[RequestRecord], duration_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """(times, requests sent and not yet answered) as a step function."""
    events: list[tuple[float, int]] = []
    for r in records:
        if r.warmup:
            continue
        events.append((r.start_s, 1))
        events.append((r.end_s if r.end_s is not None else duration_s, -1))
    events.sort()
    times = [0.0]
    level = [0]
    for t, d in events:
        times.append(t)
        level.append(level[-1] + d)
    return np.asarray(times), np.asarray(level)


def series_cached_share(
    records: Sequence[RequestRecord], duration_s: float, width: float
) -> tuple[np.ndarray, np.ndarray]:
    """(bin starts, cached/prompt tokens of requests completed in the bin; NaN if none)."""
    n = max(1, math.ceil(duration_s / width))
    cached = np.zeros(n)
    prompt = np.zeros(n)
    for r in records:
        if r.warmup or not r.ok or r.cached_tokens is None or r.end_s is None:
            continue
        i = min(n - 1, max(0, int(r.end_s / width)))
        cached[i] += r.cached_tokens
        prompt[i] += r.num_prompt_tokens
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(prompt > 0, cached / np.maximum(prompt, 1), np.nan)
    return np.arange(n) * width, share


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend; ValueError naming the
    extra to install when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib: pip install 'mooncaked[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class PlotDir:
    """A folder of PNGs: each figure laid out, saved and closed in one call."""

    def __init__(self, out_dir: str | Path) -> None:
        # Any: matplotlib is an optional extra, its types are not imported here.
        self.plt: Any = pyplot()
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.written: list[Path] = []

    def save(self, fig: Any, name: str) -> None:
        fig.tight_layout()
        path = self.out / name
        fig.savefig(path, dpi=100)
        self.plt.close(fig)
        self.written.append(path)


def write_plots(
    records: Sequence[RequestRecord], duration_s: float, out_dir: str | Path, title: str
) -> list[Path]:
    """Writes the PNGs into ``out_dir``; returns their paths."""
    plots = PlotDir(out_dir)
    plt = plots.plt
    done = [r for r in records if not r.warmup and r.ok]

    samples = {
        "ttft": [v for r in done if (v := r.ttft) is not None],
        "tpot": [v for r in done if (v := r.tpot) is not None],
        "itl": [v for r in done for v in r.itls],
        "e2el": [v for r in done if (v := r.e2el) is not None],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (metric, values) in zip(axes.flat, samples.items(), strict=True):
        ax.set_title(f"{METRIC_NAMES[metric]} ({metric.upper()})")
        ax.set_xlabel("ms")
        ax.set_ylabel("share of samples")
        ax.grid(alpha=0.3)
        if values:
            x = np.sort(np.asarray(values) * 1000.0)
            ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post")
            for p in (50, 90, 99):
                ax.axhline(p / 100, color="grey", lw=0.5, ls=":")
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", transform=ax.transAxes)
    fig.suptitle(f"{title}: latency CDFs")
    plots.save(fig, "latency_cdf.png")

    width = bin_width(duration_s)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    t, rate = series_output_rate(records, duration_s, width)
    ax1.bar(t, rate, width=width, align="edge", alpha=0.8)
    ax1.set_ylabel("output tokens/s")
    ax1.grid(alpha=0.3)
    t, level = series_in_flight(records, duration_s)
    ax2.step(t, level, where="post")
    ax2.set_ylabel("requests in flight")
    ax2.set_xlabel("seconds since start")
    ax2.grid(alpha=0.3)
    fig.suptitle(f"{title}: throughput and queue")
    plots.save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(10, 4))
    t, share = series_cached_share(records, duration_s, width)
    ax.bar(t, np.nan_to_num(share) * 100.0, width=width, align="edge", alpha=0.8)
    ax.set_ylim(0, 100)
    ax.set_ylabel("prompt tokens from cache (%)")
    ax.set_xlabel("seconds since start (by completion)")
    ax.grid(alpha=0.3)
    ax.set_title(f"{title}: cached share of prompt tokens")
    plots.save(fig, "cached_share.png")
    return plots.written
