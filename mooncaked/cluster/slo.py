"""The one definition of TTFT, TBT and "meets the SLOs".

Every caller judges a request by these: the entry's feedback to admission
(``router``), the simulator, ``mooncakectl bench`` and the tools.

- TTFT: from the request's arrival to its first output token.
- TBT: per request, the mean of the slowest tenth (at least one) of the gaps
  between consecutive output tokens after the first: the Mooncake paper's
  measure. A mean over the whole stream hides the stalls a user sees (a
  step that carried a long prefill chunk); a maximum is one outlier.
- A request meets the SLOs when it finished, its TTFT is within
  ``Slo.ttft_s`` and its TBT within ``Slo.tbt_s`` (0: no target). A request
  of one output token has no TBT and meets any TBT target.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# The share of a request's gaps whose mean is its TBT.
TBT_SLOWEST_SHARE = 0.1
# Gaps a stream needs before its TBT says something about the batch it
# decoded in rather than about one step (the entry calibrates on no fewer).
MIN_TBT_GAPS = 2


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency targets; 0 means none."""

    ttft_s: float = 0.0
    tbt_s: float = 0.0

    def met(self, ttft_s: float | None, tbt_s: float | None) -> bool:
        """Whether a finished request with this TTFT and TBT (None: one
        token, no gap) meets both targets. A request that never produced
        a token (``ttft_s`` None) meets none."""
        if ttft_s is None:
            return False
        if self.ttft_s > 0.0 and ttft_s > self.ttft_s:
            return False
        return not (self.tbt_s > 0.0 and tbt_s is not None and tbt_s > self.tbt_s)


def tbt_s(gaps: Sequence[float]) -> float | None:
    """A request's TBT from its gaps between tokens (None without a gap)."""
    if not gaps:
        return None
    k = max(1, math.ceil(len(gaps) * TBT_SLOWEST_SHARE))
    return sum(sorted(gaps, reverse=True)[:k]) / k


def target_each(ttft_s: float, tbt_s: float, target: float) -> float:
    """The share of admitted requests each SLO is judged to hold for, so
    that ``target`` of them meet both: a request misses if either forecast
    runs long, so each may miss only half as often (measured with both at
    the target on a loopback cluster: 89-92% of admitted requests met both
    in two runs of six)."""
    if ttft_s > 0.0 and tbt_s > 0.0:
        return 1.0 - (1.0 - target) / 2.0
    return target


class TokenClock:
    """A stream's token times as they arrive: its TTFT and its gaps.

    Tokens that arrive together (a chunk of ``n``) share the gap since the
    previous token evenly: they were produced over that time, and counting
    them as gaps of 0 would make the slowest tenth slower than any step.
    """

    __slots__ = ("_gaps", "_last_s", "arrival_s", "first_s")

    def __init__(self, arrival_s: float) -> None:
        self.arrival_s = arrival_s
        self.first_s: float | None = None
        self._last_s = 0.0
        self._gaps: list[float] = []

    def add(self, now: float, num_tokens: int = 1) -> None:
        if num_tokens <= 0:
            return
        if self.first_s is None:
            self.first_s = self._last_s = now
            num_tokens -= 1
            if num_tokens == 0:
                return
        gap = (now - self._last_s) / num_tokens
        self._gaps.extend([gap] * num_tokens)
        self._last_s = now

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.arrival_s

    @property
    def num_gaps(self) -> int:
        return len(self._gaps)

    def tbt_s(self) -> float | None:
        return tbt_s(self._gaps)
