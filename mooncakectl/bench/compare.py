"""Several runs side by side, each with its ratio to the first (the baseline)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from rich.table import Table

from mooncakectl.bench.report import console

# (label, key in the summary, scale to print, unit); latency rows follow from the data.
_ROWS = (
    ("Completed", "completed", 1.0, ""),
    ("Rejected (429)", "rejected", 1.0, ""),
    ("Failed", "failed", 1.0, ""),
    ("Duration (s)", "duration_s", 1.0, ""),
    ("Request throughput (req/s)", "request_throughput", 1.0, ""),
    ("Output throughput (tok/s)", "output_throughput", 1.0, ""),
    ("Total token throughput (tok/s)", "total_token_throughput", 1.0, ""),
    ("Request goodput (req/s)", "request_goodput", 1.0, ""),
    ("SLO attainment (%)", "slo_attainment", 100.0, ""),
    ("Cached prompt share (%)", "cached_share", 100.0, ""),
)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def compare_rows(summaries: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[float | None]]]:
    rows: list[tuple[str, list[float | None]]] = []
    for label, key, scale, _unit in _ROWS:
        values = [_num(s.get(key)) for s in summaries]
        if all(v is None for v in values):
            continue
        rows.append((label, [None if v is None else v * scale for v in values]))
    # Latency statistics in the order of the first run; a stat a run lacks shows "-".
    first = summaries[0].get("latency_ms") or {}
    for metric, stats in first.items():
        for stat in stats:
            values = [
                _num(((s.get("latency_ms") or {}).get(metric) or {}).get(stat)) for s in summaries
            ]
            rows.append((f"{stat.capitalize()} {metric.upper()} (ms)", values))
    return rows


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v.is_integer() else f"{v:.2f}"


def _ratio(v: float | None, base: float | None) -> str:
    if v is None or base is None:
        return "-"
    if base == 0:
        return "=" if v == 0 else "-"
    return f"x{v / base:.2f}"


def print_compare(
    out: TextIO, results: Sequence[Mapping[str, Any]], labels: Sequence[str], tty: bool
) -> None:
    table = Table(title="Benchmark comparison (ratios against the first run)", title_justify="left")
    table.add_column("Metric", style="bold")
    for i, label in enumerate(labels):
        table.add_column(label, justify="right")
        if i:
            table.add_column("ratio", justify="right")
    summaries = [r["summary"] for r in results]
    for name, values in compare_rows(summaries):
        cells = [name, _fmt(values[0])]
        for v in values[1:]:
            cells += [_fmt(v), _ratio(v, values[0])]
        table.add_row(*cells)
    console(out, tty).print(table)


def run_labels(paths: Sequence[str], results: Sequence[Mapping[str, Any]]) -> list[str]:
    """A run's --label when it had one, else its file name (made unique)."""
    labels = []
    for p, r in zip(paths, results, strict=True):
        label = (r.get("config") or {}).get("label") or Path(p).stem
        while label in labels:
            label += "'"
        labels.append(str(label))
    return labels
