"""Cost models: pure functions over numbers a node measures and gossips.

Kept free of I/O and clocks so the Conductor and a simulator can call them
with any view, live or simulated.

One linear model prices an engine step, whatever it mixes (chunked prefill
and decode share steps)::

    step_s = base + token * prefill_tokens + attn * prefill_pairs
                  + seq * decode_seqs + ctx * decode_context_tokens

``prefill_pairs`` counts the (query, key) pairs of the step's prefill
chunks: a chunk of ``k`` tokens after ``p`` already-computed ones attends to
``k * p + k * (k + 1) / 2`` keys, so a long cached prefix makes the rest of a
prompt dearer to compute, and a prompt's cost grows with its square. A
node fits the five coefficients to its own steps (profiled at start-up,
refined online) and publishes them with its KV bytes per token and the
bandwidth it measured pulling KV from each peer (``NodeCosts``). From them:
the time of a prefill (summed over its chunks), of a decode step at a
batch size and context, and of moving a prefix between two nodes.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# Links kept per node in gossip: a datagram must stay under the MTU.
MAX_LINKS = 8
# Forecast horizons (seconds ahead) of a decode node's batch, published in gossip.
FORECAST_HORIZONS_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)

# Gaps between tokens a stream needs before its mean gap calibrates the TBT
# forecast (a shorter one says more about one step than about the batch).
MIN_TBT_GAPS = 2

# While an entry has neither admitted nor measured a request for this long,
# a request that only the admission margins reject is admitted anyway: the
# margins come from measured requests, and rejecting everything measures
# nothing, so a margin blown up by a burst would otherwise reject every
# request from then on. While requests it placed still report, the margins
# move with them: admitting past them then only admits misses (simulated,
# ten entries at 3x load on 8 prefill + 2 decode nodes: with a probe after
# a second of no admission, 89-90% of the admitted met both SLOs; with
# this rule 92-95%).
PROBE_AFTER_S = 1.0


def prefill_pairs(num_tokens: int, start_pos: int) -> int:
    """(query, key) pairs of a prefill chunk of ``num_tokens`` starting at ``start_pos``."""
    return num_tokens * start_pos + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """What an engine step computed: the inputs of the step-time model."""

    prefill_tokens: int = 0
    prefill_pairs: int = 0
    decode_seqs: int = 0
    decode_ctx: int = 0

    def vector(self) -> tuple[float, float, float, float, float]:
        return (
            1.0,
            float(self.prefill_tokens),
            float(self.prefill_pairs),
            float(self.decode_seqs),
            float(self.decode_ctx),
        )


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds per engine step as a linear function of ``StepFeatures``."""

    base_s: float = 0.0
    token_s: float = 0.0
    pair_s: float = 0.0
    seq_s: float = 0.0
    ctx_s: float = 0.0

    @property
    def known(self) -> bool:
        return self.base_s > 0.0 or self.token_s > 0.0 or self.seq_s > 0.0

    def coefficients(self) -> tuple[float, float, float, float, float]:
        return (self.base_s, self.token_s, self.pair_s, self.seq_s, self.ctx_s)

    def step_s(self, f: StepFeatures) -> float:
        return sum(c * x for c, x in zip(self.coefficients(), f.vector(), strict=True))

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` sequences holding ``context_tokens`` in all."""
        if batch <= 0:
            return 0.0
        return self.base_s + self.seq_s * batch + self.ctx_s * context_tokens

    def prefill_s(
        self,
        new_tokens: int,
        cached_tokens: int = 0,
        *,
        chunk_tokens: int = 0,
        decode_seqs: int = 0,
        decode_ctx: int = 0,
    ) -> float:
        """Compute ``new_tokens`` of a prompt after ``cached_tokens`` already in KV.

        Chunked as the scheduler does (``chunk_tokens`` a step, 0: one step),
        each step also carrying ``decode_seqs`` decodes of a colocated engine.
        """
        if new_tokens <= 0:
            return 0.0
        chunk = chunk_tokens - decode_seqs if chunk_tokens > 0 else new_tokens
        chunk = max(1, chunk)
        total = 0.0
        pos, left = cached_tokens, new_tokens
        while left > 0:
            k = min(chunk, left)
            total += self.step_s(StepFeatures(k, prefill_pairs(k, pos), decode_seqs, decode_ctx))
            pos += k
            left -= k
        return total


@dataclass(frozen=True, slots=True)
class NodeCosts:
    """A node's cost model as gossip spreads it (``to_list`` / ``from_list``)."""

    step: StepCost = field(default_factory=StepCost)
    # Bytes of KV (all layers, K and V) one token holds.
    kv_bytes_per_token: int = 0
    # Prompt tokens one step computes at most (the scheduler's token budget).
    chunk_tokens: int = 0
    # Sequences a step runs at most.
    max_batch: int = 0
    # Measured bytes/s pulling KV from a peer: (peer node id, bytes/s), best known first.
    links: tuple[tuple[str, float], ...] = ()

    @property
    def known(self) -> bool:
        return self.step.known

    def prefill_s(
        self, new_tokens: int, cached_tokens: int = 0, *, decode_seqs: int = 0, decode_ctx: int = 0
    ) -> float:
        return self.step.prefill_s(
            new_tokens,
            cached_tokens,
            chunk_tokens=self.chunk_tokens,
            decode_seqs=decode_seqs,
            decode_ctx=decode_ctx,
        )

    def link_bps(self, peer: str) -> float:
        """Bytes/s measured from ``peer`` to this node; else the median of the
        links measured; 0 when nothing was measured."""
        for node, bps in self.links:
            if node == peer:
                return bps
        if not self.links:
            return 0.0
        rates = sorted(bps for _, bps in self.links)
        return rates[len(rates) // 2]

    def to_list(self) -> list[object]:
        return [
            *self.step.coefficients(),
            self.kv_bytes_per_token,
            self.chunk_tokens,
            self.max_batch,
            [[node, bps] for node, bps in self.links[:MAX_LINKS]],
        ]

    def to_json(self) -> dict[str, object]:
        return {
            "step": dataclasses.asdict(self.step),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "chunk_tokens": self.chunk_tokens,
            "max_batch": self.max_batch,
            "links": {node: bps for node, bps in self.links},
        }


def transfer_s(num_tokens: int, kv_bytes_per_token: int, bps: float, rtt_s: float = 0.0) -> float:
    """Moving ``num_tokens`` of KV over a link of ``bps`` bytes/s (inf if unknown)."""
    if num_tokens <= 0:
        return 0.0
    if bps <= 0.0:
        return math.inf
    return rtt_s + num_tokens * kv_bytes_per_token / bps


# -- fitting ------------------------------------------------------------------------


def fit_nonnegative(
    rows: Sequence[Sequence[float]], ys: Sequence[float], *, relative: bool = True
) -> tuple[float, ...]:
    """Least squares with every coefficient >= 0.

    Tries every subset of the columns (there are five), solving the normal
    equations on each, and keeps the best fit whose coefficients are all
    non-negative. ``relative`` weighs each row by 1/y, minimizing relative
    error (what a latency forecast is judged by). The weighted Gram matrix
    is built once, in one pass over the samples; each subset then costs a
    5x5 solve, so a refit is cheap enough for the event loop.
    """
    if not rows:
        raise ValueError("no samples to fit")
    n = len(rows[0])
    # Columns scaled to unit size: token pairs reach 1e8 where the intercept
    # is 1, and an unscaled system loses the small coefficients.
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(n)]
    gram = [[0.0] * n for _ in range(n)]
    rhs = [0.0] * n
    yy = 0.0
    for row, y in zip(rows, ys, strict=True):
        w2 = 1.0 / (y * y) if relative and y > 0 else 1.0
        x = [row[j] / scale[j] for j in range(n)]
        yy += w2 * y * y
        for i in range(n):
            wx = w2 * x[i]
            rhs[i] += wx * y
            gi = gram[i]
            for j in range(i, n):
                gi[j] += wx * x[j]
    for i in range(n):
        for j in range(i):
            gram[i][j] = gram[j][i]
    best: tuple[float, tuple[float, ...]] | None = None
    for size in range(1, n + 1):
        for cols in itertools.combinations(range(n), size):
            a = [[gram[i][j] for j in cols] for i in cols]
            b = [rhs[i] for i in cols]
            coef = _gauss(a, b)
            if coef is None or any(c < 0.0 for c in coef):
                continue
            # Weighted squared error from the Gram matrix: y'y - 2c'b + c'Ac.
            err = yy - 2.0 * sum(c * bi for c, bi in zip(coef, b, strict=True))
            err += sum(
                coef[i] * a[i][j] * coef[j] for i in range(len(cols)) for j in range(len(cols))
            )
            if best is None or err < best[0] - 1e-12 * max(1.0, yy):
                full = [0.0] * n
                for c, j in zip(coef, cols, strict=True):
                    full[j] = c / scale[j]
                best = (err, tuple(full))
    if best is None:
        return tuple(0.0 for _ in range(n))
    return best[1]


def _gauss(a: list[list[float]], b: list[float]) -> list[float] | None:
    n = len(b)
    m = [[*row, bv] for row, bv in zip(a, b, strict=True)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                if f:
                    for c in range(col, n + 1):
                        m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


class StepFitter:
    """Fits ``StepCost`` to measured steps: profiled ones kept for good, recent
    online ones in a window, refitted every ``refit_every`` samples."""

    def __init__(self, *, window: int = 256, refit_every: int = 16) -> None:
        self._pinned: list[tuple[StepFeatures, float]] = []
        self._recent: deque[tuple[StepFeatures, float]] = deque(maxlen=window)
        self._refit_every = refit_every
        self._since_fit = 0
        self.cost = StepCost()
        self.num_samples = 0

    def add(self, features: StepFeatures, seconds: float, *, pinned: bool = False) -> None:
        if seconds <= 0.0 or not math.isfinite(seconds):
            return
        (self._pinned if pinned else self._recent).append((features, seconds))
        self.num_samples += 1
        self._since_fit += 1
        if self._since_fit >= self._refit_every:
            self.refit()

    def refit(self) -> StepCost:
        self._since_fit = 0
        samples = [*self._pinned, *self._recent]
        if len(samples) < 3:
            return self.cost
        coef = fit_nonnegative([f.vector() for f, _ in samples], [s for _, s in samples])
        self.cost = StepCost(*coef)
        return self.cost

    def median_relative_error(self) -> float:
        """Median |predicted - measured| / measured over the samples kept."""
        samples = [*self._pinned, *self._recent]
        errs = sorted(abs(self.cost.step_s(f) - s) / s for f, s in samples)
        return errs[len(errs) // 2] if errs else math.nan


class LinkMeter:
    """Bytes/s of KV pulled from each peer: a moving average per peer."""

    def __init__(self, *, alpha: float = 0.3, min_bytes: int = 16 * 1024) -> None:
        self._alpha = alpha
        # Small transfers measure latency, not bandwidth.
        self._min_bytes = min_bytes
        self.rates: dict[str, float] = {}

    def add(self, peer: str, nbytes: int, seconds: float) -> None:
        if nbytes < self._min_bytes or seconds <= 0.0:
            return
        rate = nbytes / seconds
        old = self.rates.get(peer)
        self.rates[peer] = rate if old is None else old + self._alpha * (rate - old)

    def links(self) -> tuple[tuple[str, float], ...]:
        best = sorted(self.rates.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_LINKS]
        return tuple((node, round(bps, -3)) for node, bps in best)


# -- queues and forecasts -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefillWork:
    """A prompt waiting or being computed: tokens left, and tokens already in KV."""

    new_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
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
        xs = (0.0, *FORECAST_HORIZONS_S)
        bs = (float(now_batch), *self.batch)
        cs = (float(now_ctx), *self.context_tokens)
        if seconds >= xs[-1]:
            return bs[-1], cs[-1]
        for i in range(1, len(xs)):
            if seconds <= xs[i]:
                f = (seconds - xs[i - 1]) / (xs[i] - xs[i - 1])
                return bs[i - 1] + f * (bs[i] - bs[i - 1]), cs[i - 1] + f * (cs[i] - cs[i - 1])
        return bs[-1], cs[-1]

    def mean_over(
        self, start_s: float, length_s: float, now_batch: int, now_ctx: int, *, points: int = 5
    ) -> tuple[float, float]:
        """Batch and context averaged over ``length_s`` from ``start_s`` on: what
        a request that joins then and decodes that long shares its steps with."""
        if length_s <= 0.0 or points < 2:
            return self.at(start_s, now_batch, now_ctx)
        samples = [
            self.at(start_s + length_s * i / (points - 1), now_batch, now_ctx)
            for i in range(points)
        ]
        return (
            sum(b for b, _ in samples) / points,
            sum(c for _, c in samples) / points,
        )


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
    spans = [
        (
            w.starts_in_s,
            w.starts_in_s + lengths.expected_more(w.output_tokens, w.max_more_tokens) * step,
            w,
        )
        for w in work
    ]
    known_until = max((w.starts_in_s for w in work), default=0.0)
    run_s = lengths.mean() * step
    out_b: list[float] = []
    out_c: list[float] = []
    for h in FORECAST_HORIZONS_S:
        alive = [(start, w) for start, end, w in spans if start <= h < end]
        # Unknown arrivals, from the last known one on, still there at h.
        span = max(0.0, min(run_s, h - known_until))
        joined = arrival_rate * span
        out_b.append(float(len(alive)) + joined)
        out_c.append(
            float(sum(w.context_tokens + (h - start) / step for start, w in alive))
            + joined * (arrival_context_tokens + span / 2 / step)
        )
    return DecodeForecast(tuple(round(b, 2) for b in out_b), tuple(float(round(c)) for c in out_c))


def predicted_tbt_s(
    costs: NodeCosts, batch: float, context_tokens: float, *, queued_prefill_tokens: int = 0
) -> float:
    """Time between tokens of a decode step at ``batch`` and ``context_tokens``;
    on a node that also prefills, a step carries a prefill chunk while prompts wait."""
    b = max(1, math.ceil(batch))
    t = costs.step.decode_step_s(b, round(context_tokens))
    if queued_prefill_tokens > 0 and costs.chunk_tokens > 0:
        k = max(1, min(queued_prefill_tokens, costs.chunk_tokens - b))
        t += costs.step.token_s * k + costs.step.pair_s * prefill_pairs(k, 0)
    return t


def _weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    """The value where the weights below it first pass half of all of them."""
    order = sorted(range(len(values)), key=values.__getitem__)
    half = sum(weights) / 2.0
    acc = 0.0
    for i in order:
        acc += weights[i]
        if acc > half:
            return values[i]
    return values[order[-1]]


def fit_relative_l1(
    pairs: Sequence[tuple[float, float]],
    *,
    min_scale: float = 0.0,
    max_scale: float = math.inf,
    iterations: int = 30,
) -> tuple[float, float]:
    """(offset, scale) minimizing the sum of |measured - offset - scale x
    predicted| / measured over ``pairs`` of (predicted, measured) > 0, with
    offset >= 0 and the scale within [``min_scale``, ``max_scale``].

    Absolute relative error, not squared: a forecast is judged by its
    typical relative error, and a few requests that waited far longer than
    forecast (a burst, a stall) must not drag every promise toward them, as
    they do a least-squares line. Solved by iteratively reweighted least
    squares; the offset under a bound scale is a weighted median.
    """
    if not pairs:
        raise ValueError("no pairs to fit")
    offset, scale = 0.0, 1.0
    for _ in range(iterations):
        sw = swp = swpp = swm = swpm = 0.0
        for p, m in pairs:
            # |r| / m as a weighted square: weight 1 / (m |r|), floored so
            # that a pair the line goes through does not take all the weight.
            r = max(abs(m - offset - scale * p) / m, 1e-3)
            w = 1.0 / (m * m * r)
            sw += w
            swp += w * p
            swpp += w * p * p
            swm += w * m
            swpm += w * p * m
        det = sw * swpp - swp * swp
        if det <= 0.0:
            break
        new_scale = (sw * swpm - swp * swm) / det
        new_offset = (swm - new_scale * swp) / sw
        if new_offset < 0.0:
            # Through the origin: the scale is the weighted median of the ratios.
            new_offset = 0.0
            new_scale = _weighted_median([m / p for p, m in pairs], [p / m for p, m in pairs])
        new_scale = min(max(new_scale, min_scale), max_scale)
        done = abs(new_scale - scale) <= 1e-9 * scale and abs(new_offset - offset) <= 1e-12
        offset, scale = new_offset, new_scale
        if done:
            break
    # The best offset for the scale found (a bound scale moves it).
    offset = max(
        0.0, _weighted_median([m - scale * p for p, m in pairs], [1.0 / m for _, m in pairs])
    )
    return offset, scale


def _median_error(pairs: Iterable[tuple[float, float]], offset: float, scale: float) -> float:
    return statistics.median(abs(offset + scale * p - m) / m for p, m in pairs)


# Calibration.margin for an SLO: the forecasts judged run from the SLO times
# MARGIN_FLOOR to the SLO times MARGIN_CEIL (above it: forecasts may run
# long) in MARGIN_GRID steps even in log scale, each by the pairs forecast
# within a factor MARGIN_BAND of it.
MARGIN_FLOOR = 0.02
MARGIN_CEIL = 2.0
MARGIN_GRID = 80
MARGIN_BAND = 1.5


def _quantile(values: Sequence[float], q: float) -> float:
    """The smallest value that ``q`` of ``values`` are at or below."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class _NearPairs:
    """Calibration pairs (forecast, measured), oldest first, looked up by
    forecast: ``ratios(f)`` are the measured / forecast ratios of the pairs
    forecast within ``MARGIN_BAND`` of ``f``, or of the ``min_count``
    nearest to it in log scale (the newest among equals) where fewer were.
    Sorted once, so that the margin's grid costs a bisection a point."""

    def __init__(self, pairs: Sequence[tuple[float, float]], min_count: int) -> None:
        self._order = sorted(range(len(pairs)), key=lambda i: pairs[i][0])
        self._forecasts = [pairs[i][0] for i in self._order]
        self._ratios = [pairs[i][1] / pairs[i][0] for i in self._order]
        self._min = min_count

    def ratios(self, f: float) -> list[float]:
        fs = self._forecasts
        lo = bisect.bisect_left(fs, f / MARGIN_BAND)
        hi = bisect.bisect_right(fs, f * MARGIN_BAND)
        want = min(self._min, len(fs))
        if hi - lo >= want:
            return self._ratios[lo:hi]

        def dist(j: int) -> float:
            return abs(math.log(fs[j] / f))

        # The nearest are a run of the sorted forecasts: widen it towards
        # the nearer neighbour.
        while hi - lo < want:
            if lo > 0 and (hi == len(fs) or dist(lo - 1) <= dist(hi)):
                lo -= 1
            else:
                hi += 1
        far = max(dist(lo), dist(hi - 1))
        if (lo > 0 and dist(lo - 1) == far) or (hi < len(fs) and dist(hi) == far):
            # Pairs as near as the farthest taken are left out: take the
            # newest of them (rare: equal forecasts).
            ranked = sorted(range(len(fs)), key=lambda j: (dist(j), -self._order[j]))
            return [self._ratios[j] for j in ranked[:want]]
        return self._ratios[lo:hi]


class Calibration:
    """Measured ≈ offset + scale × predicted, fitted on recent requests.

    The step model prices compute; what a client waits for also holds the
    hops between nodes, the handoff and the event loops' other work. An
    entry node sees both the forecast and the outcome of every request it
    placed, so it corrects its forecasts by a line fitted to the recent
    pairs (least absolute relative error, ``fit_relative_l1``; both terms >=
    0, the scale within [``min_scale``, ``max_scale``]). Until
    ``min_samples`` pairs it is the identity.
    """

    def __init__(
        self,
        *,
        window: int = 128,
        min_samples: int = 8,
        min_scale: float = 0.25,
        max_scale: float = 20.0,
    ) -> None:
        self._pairs: deque[tuple[float, float]] = deque(maxlen=window)
        self._min = min_samples
        # A scale near 0 would make every forecast the same constant: the
        # model must keep a say in what is promised.
        self._min_scale = min_scale
        self._max_scale = max_scale
        self.offset_s = 0.0
        self.scale = 1.0
        self._since_fit = 0
        self._margins: dict[tuple[float, float], float] = {}

    def add(self, predicted_s: float, measured_s: float) -> None:
        if predicted_s <= 0.0 or measured_s <= 0.0:
            return
        self._pairs.append((predicted_s, measured_s))
        self._since_fit += 1
        if len(self._pairs) >= self._min and self._since_fit >= 4:
            # Line and margins move together, every fourth pair: a margin
            # costs a scan of the window, and the entry asks for it on
            # every request it places.
            self._since_fit = 0
            self.offset_s, self.scale = self._fit()
            self._margins.clear()

    def _fit(self) -> tuple[float, float]:
        """The line, kept only where it makes forecasts better than the model
        alone (the median relative error, as they are judged) on the newest
        quarter of the pairs, fitted without them: a line fitted to a
        window's noise beats the model on that window and on nothing else,
        and a model that is right needs no correction."""
        pairs = list(self._pairs)
        held = max(2, len(pairs) // 4)
        older, newest = pairs[:-held], pairs[-held:]
        if len(older) < 2:
            return 0.0, 1.0
        bounds = {"min_scale": self._min_scale, "max_scale": self._max_scale}
        offset, scale = fit_relative_l1(older, **bounds)
        if _median_error(newest, offset, scale) >= _median_error(newest, 0.0, 1.0):
            return 0.0, 1.0
        return fit_relative_l1(pairs, **bounds)

    def __len__(self) -> int:
        return len(self._pairs)

    def margin(self, target: float, slo_s: float = 0.0) -> float:
        """The factor admission multiplies the corrected forecast by, so that
        ``target`` of the requests it admits meet ``slo_s``. 1 below
        ``min_samples`` pairs or for a target of 0.

        Without an SLO: the ``target`` quantile of measured / corrected
        forecast over every recent pair (below 1 where the forecasts ran
        long). With one: how far a forecast errs depends on the forecast.
        Under load a request forecast at a tenth of a 100 ms SLO took three
        times as long (a short stream, a step stalled by a prefill chunk)
        while those forecast near it took 0.9-1.3x; on nodes that share
        cores the short forecasts ran 3x long as well, and they were the
        ones to miss a 25 ms SLO. So each forecast f is judged by the pairs
        forecast near it (``_NearPairs``): admitted is every forecast up to
        the first f at which f x that quantile passes the SLO, and the
        margin is SLO / f, the factor that admits exactly those (below 1
        where the forecasts near the SLO ran long).
        """
        if target <= 0.0 or len(self._pairs) < self._min:
            return 1.0
        key = (target, slo_s)
        cached = self._margins.get(key)
        if cached is None:
            pairs = [(self.apply(p), m) for p, m in self._pairs]
            if slo_s <= 0.0:
                cached = _quantile([m / f for f, m in pairs], target)
            else:
                near = _NearPairs(pairs, self._min)
                limit = slo_s * MARGIN_CEIL
                for i in range(MARGIN_GRID + 1):
                    f = slo_s * MARGIN_FLOOR * (MARGIN_CEIL / MARGIN_FLOOR) ** (i / MARGIN_GRID)
                    if f * _quantile(near.ratios(f), target) > slo_s:
                        limit = f
                        break
                cached = slo_s / limit
            cached = self._margins[key] = min(max(cached, self._min_scale), self._max_scale)
        return cached

    def apply(self, predicted_s: float) -> float:
        return self.offset_s + self.scale * predicted_s if predicted_s > 0.0 else predicted_s


def target_each(ttft_s: float, tbt_s: float, target: float) -> float:
    """The share of admitted requests each SLO is judged to hold for, so
    that ``target`` of them meet both: a request misses if either forecast
    runs long, so each may miss only half as often (measured with both at
    the target on a loopback cluster: 89-92% of admitted requests met both
    in two runs of six)."""
    if ttft_s > 0.0 and tbt_s > 0.0:
        return 1.0 - (1.0 - target) / 2.0
    return target
