"""Queues and forecasts: how long a prompt waits, what a decode is expected to
still produce, and a decode node's batch ahead of now.

Pure functions over a node's work and its cost model; no I/O and no clock of
their own (callers pass ``now``).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mooncaked.cluster.costs import NodeCosts

# Forecast horizons (seconds ahead) of a decode node's batch, published in gossip.
FORECAST_HORIZONS_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


# A node's work is rebuilt every gossip round, an item per request it holds:
# plain slotted classes (a frozen one's __init__ is several times dearer).
@dataclass(slots=True)
class PrefillWork:
    """A prompt waiting or being computed: tokens left, and tokens already in KV."""

    new_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class DecodeWork:
    """A request that decodes (or will, once its KV is in): its context so far,
    its output tokens so far and the most it may still produce."""

    context_tokens: int
    output_tokens: int
    max_more_tokens: int
    # Seconds until a handoff's KV is expected in and it starts decoding (0:
    # decoding now, or nothing better known).
    starts_in_s: float = 0.0


def predicted_queue_s(costs: NodeCosts, work: Iterable[PrefillWork], decode_seqs: int = 0) -> float:
    """How long a prefill entering now waits before it starts: the prefill
    work queued ahead of it, priced by the node's step model (0 if unknown)."""
    if not costs.known:
        return 0.0
    return sum(
        costs.prefill_s(w.new_tokens, w.cached_tokens, decode_seqs=decode_seqs) for w in work
    )


class OutputLengths:
    """Output lengths of recent finished requests: what a decode is expected to
    still produce, given what it has produced so far."""

    def __init__(self, *, window: int = 512, default_tokens: int = 128) -> None:
        self._recent: deque[int] = deque(maxlen=window)
        self._default = default_tokens
        # The recent lengths sorted, and suffix sums over them; rebuilt on
        # the first question after a change (a forecast asks once per request).
        self._sorted: list[int] = []
        self._suffix: list[int] = [0]
        self._dirty = False

    def add(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._recent.append(num_tokens)
            self._dirty = True

    def _index(self) -> None:
        if self._dirty:
            self._sorted = sorted(self._recent)
            suffix = [0] * (len(self._sorted) + 1)
            for i in range(len(self._sorted) - 1, -1, -1):
                suffix[i] = suffix[i + 1] + self._sorted[i]
            self._suffix = suffix
            self._dirty = False

    def __len__(self) -> int:
        return len(self._recent)

    def mean(self) -> float:
        return sum(self._recent) / len(self._recent) if self._recent else float(self._default)

    def expected_more(self, produced: int, max_more: int) -> float:
        """E[L - produced | L > produced] over the recent lengths, capped at max_more."""
        self._index()
        i = bisect.bisect_right(self._sorted, produced)
        count = len(self._sorted) - i
        if count:
            more = (self._suffix[i] - produced * count) / count
        else:
            # Past every length seen: as long again as the mean, a guess that
            # errs towards keeping the request in the batch.
            more = self.mean()
        return max(1.0, min(float(max_more), more))


@dataclass(frozen=True, slots=True)
class DecodeForecast:
    """A decode node's expected batch and context ``FORECAST_HORIZONS_S`` ahead."""

    batch: tuple[float, ...] = ()
    context_tokens: tuple[float, ...] = ()

    def at(self, seconds: float, now_batch: int, now_ctx: int) -> tuple[float, float]:
        """Batch and context expected ``seconds`` from now (linear between horizons)."""
        if not self.batch or seconds <= 0.0:
            return float(now_batch), float(now_ctx)
        i = bisect.bisect_left(FORECAST_HORIZONS_S, seconds)
        if i >= len(self.batch):
            return self.batch[-1], self.context_tokens[-1]
        hi = FORECAST_HORIZONS_S[i]
        if i == 0:
            lo, b0, c0 = 0.0, float(now_batch), float(now_ctx)
        else:
            lo, b0, c0 = FORECAST_HORIZONS_S[i - 1], self.batch[i - 1], self.context_tokens[i - 1]
        f = (seconds - lo) / (hi - lo)
        return b0 + f * (self.batch[i] - b0), c0 + f * (self.context_tokens[i] - c0)

    def mean_over(
        self, start_s: float, length_s: float, now_batch: int, now_ctx: int, *, points: int = 5
    ) -> tuple[float, float]:
        """Batch and context averaged over ``length_s`` from ``start_s`` on: what
        a request that joins then and decodes that long shares its steps with."""
        if length_s <= 0.0 or points < 2 or not self.batch:
            return self.at(start_s, now_batch, now_ctx)
        # The sample times only grow: one walk along the horizons serves them all.
        hs, bs, cs = FORECAST_HORIZONS_S, self.batch, self.context_tokens
        last = (len(hs) if len(hs) < len(bs) else len(bs)) - 1
        j = 0
        lo, b0, c0 = 0.0, float(now_batch), float(now_ctx)
        sb = sc = 0.0
        for i in range(points):
            t = start_s + length_s * i / (points - 1)
            if t <= 0.0:
                sb += now_batch
                sc += now_ctx
                continue
            while j <= last and hs[j] < t:
                lo, b0, c0 = hs[j], bs[j], cs[j]
                j += 1
            if j > last:
                sb += bs[last]
                sc += cs[last]
            else:
                f = (t - lo) / (hs[j] - lo)
                sb += b0 + f * (bs[j] - b0)
                sc += c0 + f * (cs[j] - c0)
        return sb / points, sc / points


class DepartureRate:
    """Requests leaving a decode batch per second over a recent window, and
    the mean prompt of those that left: in a steady state, what joins it."""

    def __init__(self, *, window_s: float = 10.0) -> None:
        self._window_s = window_s
        self._times: deque[float] = deque()
        self.mean_prompt_tokens = 0.0

    def add(self, now: float, prompt_tokens: int) -> None:
        self._times.append(now)
        self.mean_prompt_tokens += 0.1 * (prompt_tokens - self.mean_prompt_tokens)
        self._trim(now)

    def rate(self, now: float) -> float:
        self._trim(now)
        return len(self._times) / self._window_s

    def _trim(self, now: float) -> None:
        while self._times and self._times[0] < now - self._window_s:
            self._times.popleft()


def forecast_decode(
    costs: NodeCosts,
    work: Sequence[DecodeWork],
    lengths: OutputLengths,
    *,
    arrival_rate: float = 0.0,
    arrival_context_tokens: float = 0.0,
) -> DecodeForecast:
    """Which of ``work`` will decode at each horizon, and their context.

    Each request starts when it is expected to (a handoff, once its KV is
    in: ``starts_in_s``) and is expected to run ``lengths.expected_more``
    more steps; the step time is the model's at the batch decoding now.
    Handoffs already placed here are every arrival known: from the last of
    them on, requests keep joining at ``arrival_rate`` a second (the node's
    recent rate, whichever entry placed them), each with
    ``arrival_context_tokens`` of context and as long a run as the mean:
    those that joined in the last ``run`` seconds are still there at
    horizon ``h``. So a burst that has stopped arriving forecasts a
    shrinking batch, a steady load a steady one, and a queue of handoffs
    waiting on slow prefills their joining one after another, not all at once.
    """
    if (not work and arrival_rate <= 0.0) or not costs.known:
        return DecodeForecast()
    now = [w for w in work if w.starts_in_s <= 0.0]
    step = max(
        1e-6,
        costs.step.decode_step_s(max(1, len(now)), sum(w.context_tokens for w in now)),
    )
    # Each request decodes at the horizons from its start to its end: a run
    # of them (bisected), added to a difference array, so the whole forecast
    # costs one pass over the work, not one per horizon.
    hs = FORECAST_HORIZONS_S
    num = len(hs)
    d_count = [0] * (num + 1)
    # Its context at horizon h: context_tokens + (h - start) / step.
    d_ctx = [0.0] * (num + 1)
    known_until = 0.0
    for w in work:
        start = w.starts_in_s
        if start > known_until:
            known_until = start
        end = start + lengths.expected_more(w.output_tokens, w.max_more_tokens) * step
        lo = bisect.bisect_left(hs, start)
        hi = bisect.bisect_right(hs, end, lo)
        # A horizon equal to the end is past it (start <= h < end).
        while hi > lo and hs[hi - 1] >= end:
            hi -= 1
        if hi > lo:
            d_count[lo] += 1
            d_count[hi] -= 1
            v = w.context_tokens - start / step
            d_ctx[lo] += v
            d_ctx[hi] -= v
    run_s = lengths.mean() * step
    out_b: list[float] = []
    out_c: list[float] = []
    count = 0
    ctx = 0.0
    for i, h in enumerate(hs):
        count += d_count[i]
        ctx += d_ctx[i]
        # Unknown arrivals, from the last known one on, still there at h.
        span = max(0.0, min(run_s, h - known_until))
        joined = arrival_rate * span
        out_b.append(float(count) + joined)
        out_c.append(
            (ctx + count * h / step if count else 0.0)
            + joined * (arrival_context_tokens + span / 2 / step)
        )
    return DecodeForecast(tuple(round(b, 2) for b in out_b), tuple(float(round(c)) for c in out_c))
