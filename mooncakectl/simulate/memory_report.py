"""``simulate --memory``: the runs' decode throughput per cost, side by side.

For each run: the decode side's price (decode nodes, and memory nodes where
attention is offloaded), the output tokens per second of the requests that
met both SLOs, and that per dollar an hour; beside it, what bounds a decode
node's batch at the trace's mean context (``memory.capacity``): its KV
memory, the TBT SLO, or the scheduler's cap.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from rich.table import Table

from mooncakectl.simulate.cluster import SimResult
from mooncakectl.simulate.costs import NodeSpec
from mooncakectl.simulate.memory import (
    MEMORY_PRESETS,
    Capacity,
    capacity,
    cluster_price,
    hourly_usd,
)
from mooncakectl.simulate.results import meets_slo


def add_arguments(c: argparse._ArgumentGroup) -> None:
    c.add_argument(
        "--memory",
        help="memory nodes serving the decode nodes' attention (0: attention local); "
        "a comma-separated list runs each, e.g. 0,2; given, a table of decode throughput "
        "per cost follows",
    )
    c.add_argument(
        "--memory-preset",
        choices=sorted(MEMORY_PRESETS),
        default="8xh20",
        help="a memory node's devices (published specs)",
    )
    c.add_argument("--micro-batches", type=int, default=2, help="staggered pipelining's parts")
    c.add_argument("--compute-price", type=float, help="$/h of a decode node (default: preset's)")
    c.add_argument("--memory-price", type=float, help="$/h of a memory node (default: preset's)")


def prices(args: argparse.Namespace, hardware: str) -> tuple[float, float]:
    """$/h of a decode node and of a memory node: the flags, else the presets'."""
    compute = args.compute_price if args.compute_price is not None else hourly_usd(hardware)
    memory = args.memory_price if args.memory_price is not None else hourly_usd(args.memory_preset)
    if compute is None:
        raise ValueError(f"no price known for {hardware!r} nodes: give --compute-price ($/h)")
    if memory is None:
        raise ValueError(f"no price known for {args.memory_preset!r}: give --memory-price ($/h)")
    if not compute > 0 or not memory > 0:
        raise ValueError(f"prices must be > 0 $/h, got {compute} and {memory}")
    return compute, memory


@dataclass(frozen=True, slots=True)
class CostRow:
    cluster: str
    num_decode: int
    num_memory: int
    usd_per_h: float
    tokens_per_s: float
    mean_batch: float
    tbt_p99_ms: float
    slo_attainment: float
    capacity: Capacity

    @property
    def per_cost(self) -> float:
        return self.tokens_per_s / self.usd_per_h if self.usd_per_h > 0 else 0.0


def cost_row(
    res: SimResult,
    node: NodeSpec,
    usd: tuple[float, float],
    mean_context: float,
) -> CostRow:
    """A run's decode throughput per cost: output tokens of the requests that
    met both SLOs over the run (first arrival to last token), and the mean
    batch a decode node held (Little's law over the decode times)."""
    cfg = res.config
    num_decode, num_memory = cfg.shape.num_decode, cfg.shape.num_memory
    reqs = res.requests
    ends = [r.done_s for r in reqs if r.done_s is not None]
    span = max(ends) - min(r.arrival_s for r in reqs) if ends else 0.0
    good = sum(r.num_output_tokens for r in reqs if meets_slo(r, cfg.slo))
    decoding = sum(
        r.done_s - r.first_token_s
        for r in reqs
        if r.done_s is not None and r.first_token_s is not None
    )
    tbts = sorted(r.tbt_s for r in reqs if r.tbt_s is not None)
    p99 = tbts[min(len(tbts) - 1, int(0.99 * len(tbts)))] * 1e3 if tbts else 0.0
    met = sum(1 for r in reqs if meets_slo(r, cfg.slo))
    return CostRow(
        cfg.shape.label(),
        num_decode,
        num_memory,
        cluster_price(usd[0], usd[1], num_decode, num_memory),
        good / span if span > 0 else 0.0,
        decoding / span / max(1, num_decode) if span > 0 else 0.0,
        p99,
        met / len(reqs) if reqs else 0.0,
        capacity(node, mean_context, cfg.slo.tbt_s),
    )


def cost_table(rows: Sequence[CostRow], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for name in (
        "cluster",
        "decode $/h",
        "goodput tok/s",
        "tok/s per $/h",
        "vs no memory",
        "mean batch",
        "TBT p99 ms",
        "SLO att.",
        "batch cap",
        "bound by",
        "cap tok/s per $/h",
    ):
        table.add_column(name, justify="left" if name in ("cluster", "bound by") else "right")
    base = next((r.per_cost for r in rows if r.num_memory == 0), 0.0)
    for r in rows:
        cap = r.capacity
        per_node_usd = r.usd_per_h / max(1, r.num_decode)
        table.add_row(
            r.cluster,
            f"{r.usd_per_h:.2f}",
            f"{r.tokens_per_s:.0f}",
            f"{r.per_cost:.1f}",
            f"{r.per_cost / base:.2f}x" if base > 0 else "-",
            f"{r.mean_batch:.0f}",
            f"{r.tbt_p99_ms:.1f}",
            f"{100 * r.slo_attainment:.1f}%",
            str(cap.batch),
            cap.bound,
            f"{cap.tokens_per_s / per_node_usd:.1f}",
        )
    return table
