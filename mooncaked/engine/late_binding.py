"""Late binding: a request offered to its prefill candidates in turn.

The entry picks the prefill candidates on a gossip view that may be a
little old; the prefill nodes know their own queues. So the entry lists
several candidates with what it forecast of each (``PrefillOffer``), and
whoever asks them (the decode node's ``KVReceiver`` in the daemon, the
simulated cluster in the simulator) offers the request to each in turn
(``PrefillWalk``): one whose own queue makes it slower than the rest
passes it on before computing anything.

Pure and free of torch: the Conductor (``cluster.placement``) builds the
offers (``mooncaked.handoff.PrefillOffer``), the engine's handoff walks them.
"""

from __future__ import annotations

import math

from mooncaked.handoff import PrefillOffer, PrefillSource


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

    @classmethod
    def of(cls, source: PrefillSource) -> PrefillWalk:
        """The walk over a decode-side request's prefill candidates."""
        offers = tuple(t.offer for t in source.targets if t.offer is not None)
        return cls(offers, len(source.targets), source.hop_s)

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
