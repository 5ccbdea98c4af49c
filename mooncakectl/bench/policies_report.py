"""``bench policies``' figures: each run's summary row, the forecasts' accuracy, and the tables.

A run's row is the bench's own summary (``metrics.summarize``, with TBT and
"meets the SLOs" as ``mooncaked.cluster.slo`` defines them) of the requests
the replay recorded, as its JSON names the figures, and the decode nodes'
KV pressure over the run.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from mooncakectl.bench.metrics import RequestRecord, run_duration_s, summarize
from mooncakectl.bench.replay import decode_pressure
from mooncaked.cluster.slo import MIN_TBT_GAPS

Row = dict[str, Any]


def records_of(result: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_json(r) for r in result.get("requests", [])]


def run_row(result: dict[str, Any], slo_ttft_ms: float, slo_tbt_ms: float) -> Row:
    """The summary of a run's timed requests (``Summary.to_json``'s names) and
    its decode pressure (``replay.decode_pressure``)."""
    records = records_of(result)
    summary = summarize(
        records,
        run_duration_s(records),
        goodput_slo_ms={"ttft": slo_ttft_ms, "tbt": slo_tbt_ms},
        percentiles=(90.0,),
        metrics=("ttft", "tbt"),
    )
    return summary.to_json() | decode_pressure(result)


def rejections(result: dict[str, Any]) -> dict[str, int]:
    """The timed run's rejections by the code of each 429 (``ttft_slo``, ``tbt_slo``...)."""
    out: dict[str, int] = {}
    for r in records_of(result):
        if r.warmup or r.error_kind != "rejected":
            continue
        why = r.error_code or "other"
        out[why] = out.get(why, 0) + 1
    return out


def accuracy(result: dict[str, Any], prefix: str = "predicted") -> dict[str, Any]:
    """Median |predicted - measured| / measured of TTFT and TBT over a run:
    of what the entry promised (``predicted``, calibrated by what it measured
    before), or of the cost model's own figures (``model``)."""
    ttft: list[tuple[float, float]] = []
    tbt: list[tuple[float, float]] = []
    for r in records_of(result):
        if r.warmup or r.error_kind is not None:
            continue
        t, p = r.ttft, getattr(r, f"{prefix}_ttft_ms")
        if t and p:
            ttft.append((p, t * 1e3))
        # Only a TBT over as many gaps as the entry calibrates on: over fewer
        # it is one step's time, not the batch's the forecast is of.
        g, q = r.tbt, getattr(r, f"{prefix}_tbt_ms")
        if g and q and len(r.itls) >= MIN_TBT_GAPS:
            tbt.append((q, g * 1e3))

    def med(pairs: list[tuple[float, float]], f: Callable[[float, float], float]) -> float | None:
        return statistics.median(f(p, m) for p, m in pairs) if pairs else None

    return {
        "ttft_samples": len(ttft),
        "ttft_median_rel_error": med(ttft, lambda p, m: abs(p - m) / m),
        # Predicted / measured: below 1, the model is optimistic.
        "ttft_median_ratio": med(ttft, lambda p, m: p / m),
        "tbt_samples": len(tbt),
        "tbt_median_rel_error": med(tbt, lambda p, m: abs(p - m) / m),
        "tbt_median_ratio": med(tbt, lambda p, m: p / m),
        "pairs_ms": {"ttft": ttft, "tbt": tbt},
    }


def fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def split(counts: dict[str, int]) -> str:
    """``{"conductor-1e-t1-d0": 30, ...}`` -> ``"d0 30, d1 10"``: the node's
    name within its run, and its requests."""
    return ", ".join(f"{node.rsplit('-', 1)[-1]} {n}" for node, n in counts.items()) or "-"


def _print_columns(lines: Sequence[Sequence[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in lines) for i in range(len(lines[0]))]
    for r in lines:
        out.write("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() + "\n")


def print_accuracy(acc: dict[str, Any], what: str, out: TextIO) -> None:
    out.write(
        f"{what}: TTFT median |error| "
        f"{fmt(acc['ttft_median_rel_error'], '.1%')} over {acc['ttft_samples']}, "
        f"TBT median |error| {fmt(acc['tbt_median_rel_error'], '.1%')} "
        f"over {acc['tbt_samples']} (median predicted/measured: TTFT "
        f"{fmt(acc['ttft_median_ratio'], '.2f')}, TBT {fmt(acc['tbt_median_ratio'], '.2f')})\n"
    )


def _ratio(s: Row, b: Row, key: str) -> str:
    r = s[key] / b[key] if b.get(key) and s.get(key) is not None else None
    return fmt(r, ".2f") + ("x" if r is not None else "")


def print_table(rows: dict[str, Row], base: str, out: TextIO) -> None:
    """One row per policy, with goodput and mean TTFT against ``base``'s."""
    b = rows.get(base, {})
    lines = [
        (
            "policy",
            "sent",
            "done",
            "rejected",
            "mean TTFT ms",
            "p90 TTFT ms",
            "SLO attain.",
            "goodput r/s",
            "goodput vs " + base,
            "mean TTFT vs " + base,
        )
    ]
    for name, s in rows.items():
        lines.append(
            (
                name,
                str(s["num_requests"]),
                str(s["completed"]),
                str(s["rejected"]),
                fmt(s["mean_ttft_ms"], ".1f"),
                fmt(s["p90_ttft_ms"], ".1f"),
                fmt(s["slo_attainment"], ".1%"),
                fmt(s["request_goodput"], ".3f"),
                _ratio(s, b, "request_goodput"),
                _ratio(s, b, "mean_ttft_ms"),
            )
        )
    _print_columns(lines, out)


def print_entries_table(trials: Sequence[dict[str, Row]], out: TextIO) -> None:
    lines = [
        (
            "run",
            "trial",
            "mean TTFT ms",
            "p90 TTFT ms",
            "goodput r/s",
            "SLO attain.",
            "rejected",
            "decode split",
        )
    ]
    for trial, runs in enumerate(trials, start=1):
        for name, s in runs.items():
            lines.append(
                (
                    name,
                    str(trial),
                    fmt(s["mean_ttft_ms"], ".1f"),
                    fmt(s["p90_ttft_ms"], ".1f"),
                    fmt(s["request_goodput"], ".3f"),
                    fmt(s["slo_attainment"], ".1%"),
                    str(s["rejected"]),
                    split(s["nodes"].get("decode") or {}),
                )
            )
    _print_columns(lines, out)


def print_overload(over: dict[str, Row], out: TextIO) -> None:
    out.write(
        "early rejection  sent  rejected  admitted meeting SLOs  goodput r/s  "
        "decode KV peak / time >= 95%  rejected for\n"
    )
    for mode, s in over.items():
        why = ", ".join(f"{k} {v}" for k, v in sorted(s["rejections"].items())) or "-"
        kv = f"{fmt(s.get('peak_kv_usage'), '.0%')} / {fmt(s.get('full_share'), '.0%')}"
        out.write(
            f"{mode:<16} {s['num_requests']:<5} {s['rejected']:<9} "
            f"{fmt(s['admitted_slo_attainment'], '.1%'):<22} "
            f"{fmt(s['request_goodput'], '.3f'):<12} {kv:<29} {why}\n"
        )


def print_overload_trials(trials: Sequence[dict[str, Row]], out: TextIO) -> None:
    """Predicted against current load over every trial: the two goals of
    early rejection, counted per trial (one run is one draw of a noisy
    machine's timing, and admission feeds back on it)."""
    pairs = [t for t in trials if "current" in t and "predicted" in t]
    if not pairs:
        return
    fewer = sum(1 for t in pairs if t["predicted"]["rejected"] < t["current"]["rejected"])
    met = sum(1 for t in pairs if (t["predicted"]["admitted_slo_attainment"] or 0.0) >= 0.95)
    cur = sum(t["current"]["rejected"] for t in pairs)
    pred = sum(t["predicted"]["rejected"] for t in pairs)
    out.write(
        f"\noverload over {len(pairs)} trials, prediction-based vs current-load early rejection:\n"
    )
    out.write(
        f"  rejected: {pred} vs {cur} in all ({pred / cur:.2f}x); fewer in {fewer} of "
        f"{len(pairs)} trials\n"
        if cur
        else f"  rejected: {pred} vs {cur}\n"
    )
    out.write(
        f"  admitted meeting both SLOs >= 95% with prediction: {met} of {len(pairs)} trials\n"
    )
