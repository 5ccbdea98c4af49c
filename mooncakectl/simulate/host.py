"""Nodes that share one machine's cores, as the nodes of a loopback cluster do.

On a real cluster every node has its own accelerator and a step's time is
its own. Nodes started side by side on one machine share its cores: while
more compute threads step at once than the machine has cores, each step
runs slower by their ratio. A step is priced when it starts, by the threads
stepping then (its own included); the steps already under way on other
nodes keep their price. Steps are short next to a request's life, so a
change in the sharing is felt from each node's next step.
"""

from __future__ import annotations

import math


class SharedHost:
    def __init__(self, cores: float) -> None:
        if not cores > 0 or not math.isfinite(cores):
            raise ValueError(f"--host-cores must be > 0, got {cores}")
        self.cores = float(cores)
        self._stepping: dict[str, int] = {}
        self._busy_threads = 0

    def start(self, node_id: str, threads: int) -> float:
        """A step of ``node_id`` with ``threads`` threads starts: by how much
        the cores' sharing stretches it (>= 1)."""
        if node_id in self._stepping:
            raise RuntimeError(f"node {node_id} started a step on the host twice")
        self._stepping[node_id] = threads
        self._busy_threads += threads
        return max(1.0, self._busy_threads / self.cores)

    def stop(self, node_id: str) -> None:
        self._busy_threads -= self._stepping.pop(node_id)

    @property
    def busy_threads(self) -> int:
        return self._busy_threads
