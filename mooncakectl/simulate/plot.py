"""PNGs from simulation runs (matplotlib, the ``plot`` extra).

- ``latency_cdf.png``: CDFs of TTFT and TBT, one line per run;
- ``throughput.png``: output tokens/s and requests in flight over time, per run;
- ``nodes.png``: each node's busy share, per run.

The series come from ``series_*`` so they are tested without matplotlib.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mooncakectl.bench.plot import PlotDir
from mooncakectl.simulate.cluster import SimResult
from mooncakectl.simulate.results import SimSummary

_NUM_BINS = 80


def series_output_rate(result: SimResult, width: float) -> tuple[np.ndarray, np.ndarray]:
    """(bin starts, output tokens/s), each request's tokens spread evenly
    from its first token to its last."""
    reqs = [r for r in result.requests if r.done_s is not None and r.first_token_s is not None]
    end = max((r.done_s or 0.0 for r in reqs), default=0.0)
    n = max(1, math.ceil(end / width))
    tokens = np.zeros(n + 1)
    for r in reqs:
        a, b = r.first_token_s or 0.0, r.done_s or 0.0
        ia, ib = int(a / width), int(b / width)
        if ib <= ia:
            tokens[ia] += r.num_output_tokens
        else:
            # Spread over the bins the decode spans, pro rata.
            tokens[ia : ib + 1] += r.num_output_tokens / (ib - ia + 1)
    return np.arange(n + 1) * width, tokens / width


def series_in_flight(result: SimResult) -> tuple[np.ndarray, np.ndarray]:
    events: list[tuple[float, int]] = []
    for r in result.requests:
        if r.done_s is None:
            continue
        events.append((r.arrival_s, 1))
        events.append((r.done_s, -1))
    events.sort()
    times, level = [0.0], [0]
    for t, d in events:
        times.append(t)
        level.append(level[-1] + d)
    return np.asarray(times), np.asarray(level)


def write_plots(
    results: Sequence[SimResult], summaries: Sequence[SimSummary], out_dir: str | Path
) -> list[Path]:
    plots = PlotDir(out_dir)
    plt = plots.plt
    labels = [f"{s.cluster} {s.policy} er={s.early_reject} x{s.speed:g}" for s in summaries]

    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for res, label in zip(results, labels, strict=True):
        done = [r for r in res.requests if r.done_s is not None]
        for ax, values in (
            (axes[0], [r.ttft_s for r in done if r.ttft_s is not None]),
            (axes[1], [r.tbt_s for r in done if r.tbt_s is not None]),
        ):
            if values:
                x = np.sort(np.asarray(values) * 1000.0)
                ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=label)
    for ax, name in zip(axes, ("TTFT", "TBT (mean of slowest 10% gaps)"), strict=True):
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_xscale("log")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    plots.save(fig, "latency_cdf.png")

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    for res, s, label in zip(results, summaries, labels, strict=True):
        width = max(1.0, s.duration_s / _NUM_BINS)
        t, rate = series_output_rate(res, width)
        ax1.plot(t, rate, label=label)
        t, level = series_in_flight(res)
        ax2.step(t, level, where="post", label=label)
    ax1.set_ylabel("output tokens/s")
    ax2.set_ylabel("requests in flight")
    ax2.set_xlabel("simulated seconds")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    plots.save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(12, 4))
    width = 0.8 / max(1, len(results))
    for i, (res, s, label) in enumerate(zip(results, summaries, labels, strict=True)):
        busy = [n.busy_s / max(s.duration_s, 1e-9) * 100.0 for n in res.nodes]
        x = np.arange(len(busy)) + i * width
        ax.bar(x, busy, width=width, label=label)
    if results:
        ax.set_xticks(np.arange(len(results[0].nodes)) + 0.4 - width / 2)
        ax.set_xticklabels([n.node_id for n in results[0].nodes])
    ax.set_ylabel("busy (%)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper right")
    plots.save(fig, "nodes.png")
    return plots.written
