"""What a run prints and saves: the progress bar, the summary table, the result JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mooncakectl.bench.metrics import METRIC_NAMES, RequestRecord, Summary

RESULT_FORMAT = "mooncakectl-bench/1"


def console(stream: TextIO, tty: bool) -> Console:
    # Plain text into pipes and files: no colour codes, a fixed width.
    return Console(file=stream, force_terminal=tty, no_color=not tty, width=None if tty else 100)


def progress_bar(stream: TextIO, tty: bool) -> Progress:
    """A live bar on a terminal; nothing at all into a pipe."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console(stream, tty),
        disable=not tty,
        transient=False,
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _rate(v: float | None, unit: str) -> str:
    return "-" if v is None else f"{v:.2f} {unit}"


def summary_rows(s: Summary) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = [
        ("Requests sent", str(s.num_requests)),
        ("Completed", str(s.completed)),
        ("Rejected (429)", str(s.rejected)),
        ("Failed", str(s.failed)),
    ]
    for kind, n in s.errors.items():
        rows.append((f"  {kind}", str(n)))
    if s.not_sent:
        rows.append(("Not sent (time limit)", str(s.not_sent)))
    if s.clipped:
        rows.append(("Clipped to the context", str(s.clipped)))
    rows += [
        ("Duration", f"{s.duration_s:.2f} s"),
        ("Total input tokens", str(s.total_input_tokens)),
        ("Total output tokens", str(s.total_output_tokens)),
        ("Request throughput", _rate(s.request_throughput, "req/s")),
        ("Output token throughput", _rate(s.output_throughput, "tok/s")),
        ("Total token throughput", _rate(s.total_token_throughput, "tok/s")),
    ]
    if s.goodput_slo_ms:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in s.goodput_slo_ms.items())
        rows.append(("SLO", slo))
        rows.append(("Request goodput", _rate(s.request_goodput, "req/s")))
        att = s.slo_attainment
        rows.append(("SLO attainment", "-" if att is None else f"{100 * att:.1f}%"))
        rows.append(("Late failures (admitted, missed or failed)", str(s.late_failures)))
    if s.cached_tokens is not None:
        share = "-" if s.cached_share is None else f"{100 * s.cached_share:.1f}%"
        rows.append(("Cached prompt tokens", f"{s.cached_tokens} ({share})"))
    for phase, counts in s.nodes.items():
        rows.append(
            (f"{phase.capitalize()} nodes", ", ".join(f"{n}: {c}" for n, c in counts.items()))
        )
    for metric, stats in s.latency_ms.items():
        rows.append((f"[{METRIC_NAMES[metric]}]", ""))
        for stat, v in stats.items():
            rows.append((f"  {stat.capitalize()} {metric.upper()} (ms)", _ms(v)))
    return rows


def print_summary(out: TextIO, s: Summary, title: str, tty: bool) -> None:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    for k, v in summary_rows(s):
        table.add_row(k, v)
    console(out, tty).print(table)


def result_json(
    config: Mapping[str, Any], summary: Summary, records: Sequence[RequestRecord]
) -> dict[str, Any]:
    return {
        "format": RESULT_FORMAT,
        "config": dict(config),
        "summary": summary.to_json(),
        "requests": [r.to_json() for r in records],
    }


def write_result(path: str | Path, data: Mapping[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def read_result(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc.strerror}") from None
    except ValueError as exc:
        raise ValueError(f"{str(path)!r} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != RESULT_FORMAT:
        raise ValueError(f"{str(path)!r} is not a result of `mooncakectl bench --result-json`")
    return data
