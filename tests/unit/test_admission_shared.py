"""One admission policy for the daemon and the simulator, and a simulator whose
numbers depend on its inputs alone."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import mooncaked.cluster.admission as admission_mod
from mooncakectl.bench.trace import read_trace
from mooncakectl.bench.workloads import TraceScale
from mooncakectl.simulate.cluster import Shape, SimConfig, simulate
from mooncakectl.simulate.costs import preset_node
from mooncakectl.simulate.results import request_json, sim_summary
from mooncaked.cluster.conductor import Decision
from mooncaked.cluster.placement import ConductorParams, EarlyReject, Policy, Reject
from mooncaked.cluster.slo import Slo
from mooncaked.cluster.state import ClusterView, NodeLoad
from mooncaked.config import Config
from mooncaked.engine.core import EngineCore
from mooncaked.engine.loader import load_model
from mooncaked.request import SamplingParams
from mooncaked.router import RouteError
from tests.conftest import ManualClock
from tests.routers import entry_router
from tests.unit.test_conductor_costs import add

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "conversation_trace_head200.jsonl"


def busy_config(**kw: object) -> SimConfig:
    # 200 requests at 40x the trace's rate on 2P+2D: prefill queues, shared
    # NICs (KV flows and fetches overlap), every entry calibrating, early
    # rejection on the predicted load.
    return SimConfig(
        Shape(2, 2),
        preset_node("llama3-70b-8xa800"),
        params=ConductorParams(early_reject=EarlyReject.PREDICTED),
        slo=Slo(ttft_s=10.0, tbt_s=0.05),
        scale=TraceScale(time_scale=1 / 40),
        **kw,  # type: ignore[arg-type]
    )


def test_the_router_and_the_simulator_place_through_one_admission_object(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(
        self: admission_mod.Admission, view: object, request: object, now: float, **kw: object
    ) -> Decision:
        self.rejections[self.params.policy.value, "patched"] += 1
        return Decision(Reject(429, "patched", code="patched"), self.params.policy)

    monkeypatch.setattr(admission_mod.Admission, "place", refuse)
    records = read_trace(FIXTURE)[:10]
    res = simulate(busy_config(), records)
    assert [r.reject_code for r in res.requests] == ["patched"] * 10

    engine = EngineCore(Config(), load_model(Config().model))
    view = ClusterView("d1", clock=ManualClock())
    add(view, "p1", "prefill", model=engine.model_id)
    add(view, "d1", "decode", load=NodeLoad(), model=engine.model_id)
    router = entry_router("d1", view, engine=engine)
    sub = router.submit(list(range(40)), SamplingParams(max_tokens=4), "r", [])
    with pytest.raises(RouteError) as exc:
        router.placement(sub.req, sub.req.prompt_token_ids, set())
    assert exc.value.code == "patched"
    assert router.admission.rejections == {(Policy.CONDUCTOR.value, "patched"): 1}


def test_the_simulator_gives_the_same_numbers_whatever_ran_before() -> None:
    records = read_trace(FIXTURE)
    cfg = busy_config(seed=3)

    def outcome() -> tuple[object, list[dict[str, object]]]:
        res = simulate(cfg, records)
        s = sim_summary(res)
        return (
            (s.rejected, s.rejections, s.late_failures, s.ttft_ms, s.tbt_ms, s.bytes_moved),
            [request_json(r) for r in res.requests],
        )

    first = outcome()
    # Other runs in between: other shapes, seeds and policies allocate and
    # free objects (flows, requests, nodes) the next run's hashing would see.
    for other in (
        replace(cfg, shape=Shape(3, 1), seed=7),
        replace(cfg, params=replace(cfg.params, policy=Policy.LOAD_BALANCE)),
    ):
        simulate(other, records)
    again = outcome()
    assert again == first
    # The run is busy enough to depend on its ties: rejections, shared NICs.
    summary, _ = first
    assert summary[0] > 0 and summary[5]["kv"] > 0  # type: ignore[index]
