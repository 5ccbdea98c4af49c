"""An entry node's admission policy around ``conductor.decide``.

One object per entry, holding what the entry learns from the requests it
places: the ledger of placements gossip does not show yet, the corrections
of the forecasts by what it measured (``fit.Calibration``) and their
admission margins, the output lengths of its requests, and when it last
heard of one. ``place`` decides and records; ``explain`` decides and records
nothing; ``on_first_token`` and ``on_finished`` feed back what happened.

No I/O and no clock of its own: the router calls it with the live gossip
view and its clock, the simulator with a simulated view and simulated time,
so both run the same policy.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

from mooncaked.cluster.conductor import Decision, decide
from mooncaked.cluster.fit import Calibration
from mooncaked.cluster.forecast import OutputLengths
from mooncaked.cluster.placement import (
    ConductorParams,
    PendingLoad,
    Placement,
    PlacementRequest,
    Reject,
    calibrated,
)
from mooncaked.cluster.slo import MIN_TBT_GAPS, Slo, target_each
from mooncaked.cluster.state import ClusterView

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


def may_probe(result: Placement | Reject, quiet_s: float) -> bool:
    """Whether to judge ``result`` again without the margins: an SLO
    rejection by an entry that has neither admitted nor measured a request
    for ``quiet_s`` (``PROBE_AFTER_S``)."""
    return (
        isinstance(result, Reject)
        and result.code in ("ttft_slo", "tbt_slo")
        and quiet_s >= PROBE_AFTER_S
    )


class PendingLedger:
    """What this entry node placed that gossip does not reflect yet.

    Each placement counts against its nodes until their gossiped state is
    newer than it was at placement and ``min_age_s`` has passed (the node
    has had time to take the request in and publish it), or ``max_age_s``
    at most. Without it a burst entering one node piles onto whichever
    node looked idlest at its start.
    """

    def __init__(self, *, min_age_s: float = 0.3, max_age_s: float = 3.0) -> None:
        self._min_age_s = min_age_s
        self._max_age_s = max_age_s
        # (placed at, node id, state version then, load)
        self._entries: list[tuple[float, str, int, PendingLoad]] = []

    def add(self, view: ClusterView, node_id: str, load: PendingLoad, now: float) -> None:
        m = view.members.get(node_id)
        version = m.state.version if m is not None and m.state is not None else 0
        self._entries.append((now, node_id, version, load))

    def pending(self, view: ClusterView, now: float) -> dict[str, PendingLoad]:
        kept: list[tuple[float, str, int, PendingLoad]] = []
        out: dict[str, PendingLoad] = {}
        for entry in self._entries:
            at, node_id, version, load = entry
            age = now - at
            m = view.members.get(node_id)
            seen = m is not None and m.state is not None and m.state.version > version
            if age >= self._max_age_s or (seen and age >= self._min_age_s):
                continue
            kept.append(entry)
            p = out.get(node_id, PendingLoad())
            out[node_id] = PendingLoad(
                p.prefill_s + load.prefill_s,
                p.prefill_tokens + load.prefill_tokens,
                p.decodes + load.decodes,
            )
        self._entries = kept
        return out

    def __len__(self) -> int:
        return len(self._entries)


class Admission:
    """One entry's placement and admission policy, and what it learnt."""

    def __init__(
        self,
        params: ConductorParams,
        slo: Slo,
        *,
        rng: random.Random,
        target: float = 0.95,
        now: float = 0.0,
    ) -> None:
        self.params = params
        self.slo = slo
        # The share of admitted requests meant to meet the SLOs.
        self.target = target
        self.rng = rng
        self.ledger = PendingLedger()
        # Forecasts corrected by what this entry measured of its requests.
        self.ttft_calibration = Calibration()
        self.tbt_calibration = Calibration()
        # Output lengths of the requests it placed: what a new one is expected to produce.
        self.lengths = OutputLengths()
        # When it last admitted a request or measured one it placed.
        self.last_heard = now
        # Requests admitted although the margins alone rejected them (PROBE_AFTER_S).
        self.num_probes = 0
        # (policy, outcome) -> count, and (policy, reason) -> count of rejections.
        self.decisions: Counter[tuple[str, str]] = Counter()
        self.rejections: Counter[tuple[str, str]] = Counter()

    def margins(self) -> tuple[float, float]:
        """What admission multiplies the corrected TTFT and TBT forecasts by,
        for the entry's SLOs (``Calibration.margin``)."""
        each = target_each(self.slo.ttft_s, self.slo.tbt_s, self.target)
        return (
            self.ttft_calibration.margin(each, self.slo.ttft_s),
            self.tbt_calibration.margin(each, self.slo.tbt_s),
        )

    def explain(
        self,
        view: ClusterView,
        request: PlacementRequest,
        now: float,
        *,
        exclude: frozenset[str] = frozenset(),
        margins: bool = True,
    ) -> Decision:
        """What ``place`` would decide now, recording nothing. ``margins=False``
        judges the corrected forecasts without the margins."""
        if request.expected_output_tokens <= 0.0:
            request = dataclasses.replace(
                request,
                expected_output_tokens=self.lengths.expected_more(0, request.max_tokens),
            )
        params = calibrated(
            self.params,
            self.ttft_calibration,
            self.tbt_calibration,
            self.slo,
            self.target,
            margins=margins,
        )
        return decide(
            view,
            request,
            rng=self.rng,
            exclude=exclude,
            params=params,
            slo=self.slo,
            pending=self.ledger.pending(view, now),
        )

    def place(
        self,
        view: ClusterView,
        request: PlacementRequest,
        now: float,
        *,
        exclude: frozenset[str] = frozenset(),
    ) -> Decision:
        """Decide, admit a probe past the margins when the entry has heard
        nothing for ``PROBE_AFTER_S``, and record the placement against its
        nodes until gossip shows it."""
        decision = self.explain(view, request, now, exclude=exclude)
        if may_probe(decision.result, now - self.last_heard):
            probe = self.explain(view, request, now, exclude=exclude, margins=False)
            if isinstance(probe.result, Placement):
                decision = probe
                self.num_probes += 1
        policy = decision.policy.value
        result = decision.result
        if isinstance(result, Reject):
            self.rejections[policy, result.code] += 1
            self.decisions[policy, "rejected"] += 1
            return decision
        outcome = (
            "colocated" if result.colocated else ("fetch" if result.fetch else "disaggregated")
        )
        self.decisions[policy, outcome] += 1
        self._record(view, decision, result, now)
        self.last_heard = now
        return decision

    def _record(
        self, view: ClusterView, decision: Decision, placement: Placement, now: float
    ) -> None:
        first = placement.prefill[0].node_id if placement.prefill else placement.decode.node_id
        score = next((s for s in decision.prefill if s.node_id == first), None)
        work = score.prefill_s if score is not None else 0.0
        tokens = score.new_tokens if score is not None else 0
        if score is not None and score.stages:
            # A pipelined group: each stage has its own share of the work queued.
            for node_id, stage_s in zip(score.stages, score.stage_s, strict=False):
                self.ledger.add(view, node_id, PendingLoad(stage_s, tokens, 0), now)
            self.ledger.add(view, placement.decode.node_id, PendingLoad(0.0, 0, 1), now)
            return
        if first == placement.decode.node_id:
            self.ledger.add(view, first, PendingLoad(work, tokens, 1), now)
        else:
            self.ledger.add(view, first, PendingLoad(work, tokens, 0), now)
            self.ledger.add(view, placement.decode.node_id, PendingLoad(0.0, 0, 1), now)

    def on_first_token(self, placement: Placement, ttft_s: float, now: float) -> None:
        """A request this entry placed produced its first token ``ttft_s`` after arrival."""
        if placement.model_ttft_s > 0.0:
            self.ttft_calibration.add(placement.model_ttft_s, ttft_s)
            self.last_heard = now

    def on_finished(
        self,
        placement: Placement | None,
        num_output_tokens: int,
        tbt_s: float | None,
        num_gaps: int,
        now: float,
    ) -> None:
        """A request this entry placed finished with ``num_output_tokens`` and
        this TBT (``slo.tbt_s``) over ``num_gaps`` gaps. ``placement`` None:
        its timing measures no one placement (it ran on several decode
        nodes); its length still counts."""
        self.lengths.add(num_output_tokens)
        if (
            placement is None
            or tbt_s is None
            or placement.model_tbt_s <= 0.0
            or num_gaps < MIN_TBT_GAPS
        ):
            return
        self.tbt_calibration.add(placement.model_tbt_s, tbt_s)
        self.last_heard = now
