"""Late binding: a request offered to its prefill candidates in turn.

The entry picks the prefill candidates on a gossip view that may be a
little old; the prefill nodes know their own queues. So the entry lists
several candidates with what it forecast of each (``PrefillOffer``), and
whoever asks them (the decode node's ``KVReceiver`` in the daemon, the
simulated cluster in the simulator) offers the request to each in turn
(``PrefillWalk``): one whose own queue makes it slower than the rest
passes it on before computing anything.

Pure and free of torch: the Conductor (``cluster.placement``) builds the
offers, the engine's handoff walks them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class PrefillOffer:
    """What the entry forecast of one prefill candidate, model seconds: its
    TTFT, and the parts of it that do not depend on its queue (a fetch of
    a longer prefix, which overlaps the queue, and the compute after it)."""

    ttft_s: float
    move_s: float
    rest_s: float
    # A wait past ``ttft_s`` (as a share of it) that is no news.
    slack: float = 0.0

    def to_list(self) -> list[float]:
        return [round(self.ttft_s, 6), round(self.move_s, 6), round(self.rest_s, 6), self.slack]

    @classmethod
    def from_list(cls, raw: Any) -> PrefillOffer:
        """Raises ValueError on anything but four finite numbers >= 0."""
        if not isinstance(raw, list) or len(raw) != 4:
            raise ValueError(f"an offer is [ttft_s, move_s, rest_s, slack], got {raw!r}")
        for v in raw:
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < math.inf:
                raise ValueError(f"an offer's figures must be numbers >= 0, got {raw!r}")
        return cls(float(raw[0]), float(raw[1]), float(raw[2]), float(raw[3]))

    def ttft_at(self, queue_s: float) -> float:
        """Its TTFT with this much queued ahead."""
        return max(queue_s, self.move_s) + self.rest_s

    def max_wait_s(self, beat_s: float) -> float:
        """The longest queue at which it takes the request: its TTFT within
        its forecast and slack, or not past ``beat_s`` (what else is left)."""
        return max(self.ttft_s * (1.0 + self.slack), beat_s) - self.rest_s


class PrefillWalk:
    """Late binding: offers a request to its prefill candidates in turn.

    Each but the last is offered the request with the longest queue at
    which it still beats what the entry forecast of the candidates left
    (plus a round trip per hop to reach them); one whose own queue is
    longer refuses, and the next is asked. The last takes it whatever its
    queue: entries list their near-equal candidates in their own random
    orders (``ranking.spread``), so the last differs from one request to
    the next. (Going back to the candidate that refused with the shortest
    queue instead sends the requests of a burst, which all walked the same
    nodes, to the same one: simulated, it made mean TTFT 1.6x longer.)
    Without offers every candidate takes the request when asked. Run by
    whoever asks the prefill nodes: the decode node in the daemon, the
    simulated cluster in the simulator.
    """

    def __init__(self, offers: tuple[PrefillOffer, ...], num: int, rtt_s: float) -> None:
        self._offers = offers if len(offers) == num else ()
        self._num = num
        self._rtt_s = rtt_s
        self._next = 0

    def next(self) -> tuple[int, float] | None:
        """The candidate to ask next and the longest queue it may take the
        request with (inf: no limit); None when nobody is left to ask."""
        i = self._next
        if i >= self._num:
            return None
        self._next += 1
        left = self._offers[i + 1 :]
        if not left:
            return i, math.inf
        beat = min(o.ttft_s + self._rtt_s * (k + 1) for k, o in enumerate(left))
        return i, self._offers[i].max_wait_s(beat)
