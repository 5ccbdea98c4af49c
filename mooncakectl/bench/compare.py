"""Several runs side by side, each with its ratio to the first (the baseline).

Where the runs replayed one workload (equal request indices), each run
after the first also gets its false rejections against the first: the
requests it rejected that the first run, without early rejection, served
within that run's SLOs. The other rows compare the runs' summaries alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from rich.table import Table

from mooncakectl.bench.metrics import REJECTED, RequestRecord, meets_slo
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
    ("Late failures (admitted)", "late_failures", 1.0, ""),
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


def _timed(result: Mapping[str, Any]) -> list[RequestRecord]:
    return [
        rec for r in result.get("requests") or [] if not (rec := RequestRecord.from_json(r)).warmup
    ]


def _same_request(a: RequestRecord, b: RequestRecord) -> bool:
    # Equal indices of two different workloads are different requests.
    return (a.group, a.prompt_len, a.output_len) == (b.group, b.prompt_len, b.output_len)


def false_rejections(base: Mapping[str, Any], run: Mapping[str, Any]) -> int | None:
    """The requests ``run`` rejected (429) that completed in ``base`` and met
    every SLO of ``run``'s ``--goodput`` there: rejections that a server
    without early rejection (``base``) shows were not needed. None where it
    cannot be measured: ``run`` has no SLOs, or the runs share no request
    (same index, group and lengths)."""
    slo = (run.get("summary") or {}).get("goodput_slo_ms") or {}
    if not slo:
        return None
    served = {r.index: r for r in _timed(base)}
    matched = false = 0
    for r in _timed(run):
        b = served.get(r.index)
        if b is None or not _same_request(b, r):
            continue
        matched += 1
        if r.error_kind == REJECTED and meets_slo(b, slo):
            false += 1
    return false if matched else None


def compare_table(
    results: Sequence[Mapping[str, Any]], labels: Sequence[str]
) -> list[tuple[str, list[float | None]]]:
    """``compare_rows`` of the summaries, with each later run's false
    rejections against the first after the rejections."""
    rows = compare_rows([r["summary"] for r in results])
    if len(results) < 2:
        return rows
    false = [None, *(false_rejections(results[0], r) for r in results[1:])]
    at = next((i + 1 for i, (name, _) in enumerate(rows) if name == "Rejected (429)"), len(rows))
    rows.insert(
        at, (f"False rejections vs {labels[0]}", [None if v is None else float(v) for v in false])
    )
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
    for name, values in compare_table(results, labels):
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
