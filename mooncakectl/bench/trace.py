"""Mooncake request traces: one JSON object a line.

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` is the arrival in milliseconds, ``hash_ids`` are chained ids of
the prompt's prefix blocks (512 tokens each in the released traces): equal
ids at equal positions mean a shared prefix. This module only reads and
slices records; turning them into tokens is ``workloads``' job, so the
simulator can replay the same records without any HTTP.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Tokens per hash id in the traces Mooncake released.
TRACE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that cannot be used; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    # 1-based line number in the file, for messages and for the result JSON.
    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _field_int(obj: dict[str, Any], key: str, where: str, minimum: int) -> int:
    if key not in obj:
        raise TraceError(f"{where}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise TraceError(f"{where}: {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def parse_line(text: str, line: int, source: str = "<trace>") -> TraceRecord:
    where = f"{source}:{line}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "timestamp" not in obj:
        raise TraceError(f"{where}: missing field 'timestamp'")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: 'timestamp' must be a number of ms >= 0, got {ts!r}")
    input_length = _field_int(obj, "input_length", where, 1)
    output_length = _field_int(obj, "output_length", where, 0)
    if "hash_ids" not in obj:
        raise TraceError(f"{where}: missing field 'hash_ids'")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers, got {ids!r}")
    return TraceRecord(line, float(ts), input_length, output_length, tuple(ids))


def iter_trace(lines: Iterable[str], source: str = "<trace>") -> Iterator[TraceRecord]:
    """Records in file order; blank lines are skipped, a bad line raises TraceError."""
    for n, text in enumerate(lines, start=1):
        if text.strip():
            yield parse_line(text, n, source)


def conversation_key(rec: TraceRecord) -> tuple[int, ...]:
    """The conversation a record belongs to: its prompt's first two blocks.

    In Mooncake's conversation trace every prompt begins with the same block
    (a shared system prompt) and a follow-up turn's prompt begins with the
    whole prompt of the turn before it, so the turns of one conversation,
    and only they, share their second block."""
    return rec.hash_ids[:2]


def _spread(key: tuple[int, ...]) -> int:
    # Hash ids are handed out in order: mixed, so that one conversation in K
    # is a uniform sample rather than one stretch of ids.
    h = 0x811C9DC5
    for v in key:
        h = ((h ^ (v & 0xFFFFFFFFFFFF)) * 0x01000193) & 0xFFFFFFFF
    return h ^ (h >> 16)


@dataclass(frozen=True, slots=True)
class TraceSlice:
    """Which records to replay: only those whose timestamp falls in
    ``[window_start_ms, window_end_ms)`` and, with ``conversations_every`` K
    > 1, those of one conversation in K (``conversation_key``; the
    ``conversations_part``-th of the K parts), all of its turns, so a thinned
    trace keeps its prefix reuse; of those, skip ``start`` and keep at most
    ``count``."""

    start: int = 0
    count: int | None = None
    window_start_ms: float | None = None
    window_end_ms: float | None = None
    conversations_every: int = 1
    conversations_part: int = 0

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"--trace-start must be >= 0, got {self.start}")
        if self.count is not None and self.count < 1:
            raise ValueError(f"--trace-count must be >= 1, got {self.count}")
        lo, hi = self.window_start_ms, self.window_end_ms
        if lo is not None and hi is not None and hi <= lo:
            raise ValueError(f"the trace time window [{lo}, {hi}) ms is empty")
        k, r = self.conversations_every, self.conversations_part
        if k < 1 or not 0 <= r < k:
            raise ValueError(f"--trace-conversations: part {r} of {k} does not exist")

    @classmethod
    def from_options(
        cls,
        start: int = 0,
        count: int | None = None,
        window_start_ms: float | None = None,
        window_end_ms: float | None = None,
        conversations: str | None = None,
        flag: str = "--trace-conversations",
    ) -> TraceSlice:
        """The slice a command line asks for; ``conversations`` as ``parse_conversations`` reads it."""
        every, part = parse_conversations(conversations, flag) if conversations else (1, 0)
        return cls(start, count, window_start_ms, window_end_ms, every, part)

    def in_window(self, rec: TraceRecord) -> bool:
        if self.window_start_ms is not None and rec.timestamp_ms < self.window_start_ms:
            return False
        return self.window_end_ms is None or rec.timestamp_ms < self.window_end_ms

    def selects(self, rec: TraceRecord) -> bool:
        if not self.in_window(rec):
            return False
        k = self.conversations_every
        return k == 1 or _spread(conversation_key(rec)) % k == self.conversations_part


def parse_conversations(text: str, flag: str = "--trace-conversations") -> tuple[int, int]:
    """``K`` (one conversation in K, the first part) or ``R/K`` (the R-th of
    K parts, from 0) -> (K, R); errors name ``flag``."""
    part, _, every = text.rpartition("/")
    try:
        k, r = int(every), int(part) if part else 0
    except ValueError:
        raise ValueError(f"{flag}: expected K or R/K, got {text!r}") from None
    if k < 1 or not 0 <= r < k:
        raise ValueError(f"{flag}: part {r} of {k} does not exist ({text!r})")
    return k, r


def add_slice_arguments(group: argparse._ArgumentGroup) -> None:
    """The ``--trace-*`` options that pick records (``slice_from_args`` reads them)."""
    group.add_argument("--trace-start", type=int, default=0, help="records to skip")
    group.add_argument("--trace-count", type=int, help="records to replay at most")
    group.add_argument("--trace-from-ms", type=float, help="first timestamp to replay")
    group.add_argument("--trace-until-ms", type=float, help="replay timestamps below this")
    group.add_argument(
        "--trace-conversations",
        metavar="[R/]K",
        help="one conversation in K, every turn of it (R: which of the K parts)",
    )


def add_scale_arguments(
    group: argparse._ArgumentGroup,
    *,
    block_tokens: int | None = TRACE_BLOCK_TOKENS,
    output_scale: float | None = 1.0,
    time_scale: float | None = 1.0,
) -> None:
    """The options that size and time the records (``workloads.TraceScale``),
    with each command's defaults (None: the command settles it)."""
    group.add_argument(
        "--trace-block-tokens", type=int, default=block_tokens, help="tokens per hash id"
    )
    group.add_argument("--input-scale", type=float, help="default: block tokens / 512")
    group.add_argument("--output-scale", type=float, default=output_scale)
    group.add_argument(
        "--time-scale", type=float, default=time_scale, help="multiplies gaps in time"
    )


def slice_from_args(args: argparse.Namespace) -> TraceSlice:
    return TraceSlice.from_options(
        args.trace_start,
        args.trace_count,
        args.trace_from_ms,
        args.trace_until_ms,
        args.trace_conversations,
    )


def trace_lines(records: Iterable[TraceRecord]) -> list[str]:
    """``records`` written back as trace lines: what a replay of a slice sends."""
    return [
        json.dumps(
            {
                "timestamp": r.timestamp_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
        )
        + "\n"
        for r in records
    ]


def describe_slice(sl: TraceSlice, records: list[TraceRecord]) -> str:
    """What ``sl`` picked, in words, for a report's title (``records``: what it picked)."""
    return ", ".join(
        x
        for x in (
            f"from {sl.window_start_ms:g} ms" if sl.window_start_ms is not None else "",
            f"until {sl.window_end_ms:g} ms" if sl.window_end_ms is not None else "",
            f"conversations {sl.conversations_part}/{sl.conversations_every}"
            if sl.conversations_every > 1
            else "",
            f"skipping {sl.start}" if sl.start else "",
            f"lines {records[0].line}..{records[-1].line}",
        )
        if x
    )


def read_trace(path: str | Path, sl: TraceSlice | None = None) -> list[TraceRecord]:
    """The records of ``path`` selected by ``sl``. Only the lines up to the
    last one kept are parsed (and validated): a slice of a huge trace is cheap."""
    sl = sl or TraceSlice()
    path = Path(path)
    out: list[TraceRecord] = []
    skipped = 0
    try:
        f = path.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {str(path)!r}: {exc.strerror}") from None
    with f:
        for rec in iter_trace(f, str(path)):
            if not sl.selects(rec):
                continue
            if skipped < sl.start:
                skipped += 1
                continue
            out.append(rec)
            if sl.count is not None and len(out) >= sl.count:
                break
    if not out:
        raise TraceError(f"trace {str(path)!r}: no records in the selected slice")
    return out
