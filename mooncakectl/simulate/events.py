"""The simulator's clock: a heap of timed callbacks, run in time order.

Ties run in the order they were scheduled, so a run is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventQueue:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0
        self.num_events = 0

    def at(self, when: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        if when < self.now:
            raise RuntimeError(f"event scheduled in the past ({when} < {self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, fn, arg))

    def run(self) -> None:
        heap = self._heap
        pop = heapq.heappop
        while heap:
            when, _, fn, arg = pop(heap)
            self.now = when
            self.num_events += 1
            fn(arg)
