"""Fitting: the step model to measured steps, link bandwidths, and each
entry's correction of its forecasts by what it measured (``Calibration``).

Pure: samples in, coefficients out; no I/O and no clock.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence

from mooncaked.cluster.costs import MAX_LINKS, StepCost, StepFeatures


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
    forecast: ``ratios(f)`` say what the pairs forecast within
    ``MARGIN_BAND`` of ``f`` (or the ``min_count`` nearest to it in log
    scale, the newest among equals, where fewer were) tell of a forecast
    of ``f``: how much longer than ``f`` it is to take.

    A pair forecast at ``p`` that took ``m`` tells it by its error carried
    over: added as is to a longer forecast (``f + m - p``: what makes a
    forecast run long, a request placed meanwhile, the KV landing late,
    does not grow with the forecast), in proportion to a shorter one
    (``f x m / p``). Carried over in proportion to a longer one too, the
    few seconds a burst added to short forecasts made a forecast near a
    30 s SLO look 5-20x too short to an entry that had seen only short
    ones (simulated: most of the requests it rejected would have met the
    SLO). Sorted once, so that the margin's grid costs a bisection a point."""

    def __init__(self, pairs: Sequence[tuple[float, float]], min_count: int) -> None:
        self._order = sorted(range(len(pairs)), key=lambda i: pairs[i][0])
        self._forecasts = [pairs[i][0] for i in self._order]
        self._measured = [pairs[i][1] for i in self._order]
        self._min = min_count

    def _ratios(self, f: float, js: Iterable[int]) -> list[float]:
        fs, ms = self._forecasts, self._measured
        return [1.0 + (ms[j] - fs[j]) / f if f >= fs[j] else ms[j] / fs[j] for j in js]

    def ratios(self, f: float) -> list[float]:
        fs = self._forecasts
        lo = bisect.bisect_left(fs, f / MARGIN_BAND)
        hi = bisect.bisect_right(fs, f * MARGIN_BAND)
        want = min(self._min, len(fs))
        if hi - lo >= want:
            return self._ratios(f, range(lo, hi))

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
            return self._ratios(f, ranked[:want])
        return self._ratios(f, range(lo, hi))


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
