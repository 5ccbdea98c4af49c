"""Links between simulated nodes: each node's NICs carry so many bytes/s out
and in, and the flows on a NIC share it equally.

A flow's rate is the least of its shares at both ends; when a flow starts
or ends, the flows sharing a NIC with it are re-rated from that moment
(what they moved so far is settled first).

Flows on a NIC are kept in the order they started (dicts, not sets: a set
of objects hashed by address iterates in an order that depends on what
else the process allocated, and so would the simulation's ties).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mooncakectl.simulate.events import EventQueue


@dataclass(slots=True, eq=False)
class Flow:
    src: str
    dst: str
    nbytes: float
    on_done: Callable[[Flow], None]
    started_s: float = 0.0
    remaining: float = 0.0
    rate: float = 0.0
    settled_s: float = 0.0
    # Bumped on every re-rating: a completion event of an older version is stale.
    version: int = 0
    done_s: float | None = None
    tag: str = ""


@dataclass(slots=True)
class Nic:
    bps: float
    out_flows: dict[Flow, None] = field(default_factory=dict)
    in_flows: dict[Flow, None] = field(default_factory=dict)


class Network:
    def __init__(self, events: EventQueue, nic_bps: dict[str, float]) -> None:
        for node, bps in nic_bps.items():
            if not bps > 0:
                raise ValueError(f"node {node}: NIC bandwidth must be > 0 bytes/s, got {bps!r}")
        self._events = events
        self.nics = {node: Nic(bps) for node, bps in nic_bps.items()}
        self.bytes_moved: dict[str, float] = {}

    def start(
        self, src: str, dst: str, nbytes: float, on_done: Callable[[Flow], None], tag: str = ""
    ) -> Flow:
        now = self._events.now
        flow = Flow(src, dst, nbytes, on_done, now, nbytes, 0.0, now, tag=tag)
        self.bytes_moved[tag] = self.bytes_moved.get(tag, 0.0) + nbytes
        if nbytes <= 0 or src == dst:
            flow.remaining = 0.0
            self._events.at(now, self._finish, (flow, 0))
            return flow
        a, b = self.nics[src], self.nics[dst]
        a.out_flows[flow] = None
        b.in_flows[flow] = None
        self._rerate({**a.out_flows, **b.in_flows})
        return flow

    def _rate(self, f: Flow) -> float:
        a, b = self.nics[f.src], self.nics[f.dst]
        return min(a.bps / len(a.out_flows), b.bps / len(b.in_flows))

    def _rerate(self, flows: dict[Flow, None]) -> None:
        now = self._events.now
        for f in flows:
            f.remaining = max(0.0, f.remaining - f.rate * (now - f.settled_s))
            f.settled_s = now
            f.rate = self._rate(f)
            f.version += 1
            self._events.at(now + f.remaining / f.rate, self._finish, (f, f.version))

    def _finish(self, arg: tuple[Flow, int]) -> None:
        f, version = arg
        if version != f.version or f.done_s is not None:
            return
        f.done_s = self._events.now
        f.remaining = 0.0
        if f.src != f.dst and f.nbytes > 0:
            a, b = self.nics[f.src], self.nics[f.dst]
            a.out_flows.pop(f, None)
            b.in_flows.pop(f, None)
            self._rerate({**a.out_flows, **b.in_flows})
        f.on_done(f)
