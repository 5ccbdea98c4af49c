"""A stage of a pipelined prefill group in the engine, without daemons: the
scheduler's part (where it starts, how far it may go, its chunks) and the
model's (stages compose into the whole model, bit for bit)."""

from __future__ import annotations

import dataclasses

import torch

from mooncaked.cache.hashing import block_hashes, layer_hashes
from mooncaked.config import ModelConfig, PipelineConfig
from mooncaked.engine.loader import load_model
from mooncaked.engine.plan import ScheduledChunk, StepPlan
from mooncaked.engine.runner import ModelRunner
from mooncaked.handoff import ActGrant, Handoff, StageJob
from mooncaked.request import Request, SamplingParams
from tests.unit.test_scheduler import BS, make, shape

ACT = ActGrant("s1", "u", "r", "h:1", "act.in", 16, BS, tuple(range(32)), start=0)


def stage_req(rid: str, n: int, job: StageJob, base: int = 0) -> Request:
    """A stage's request, keyed by its layers' hashes as the engine keys it."""
    tokens = [base + i for i in range(n)]
    r = Request(rid, tokens, SamplingParams(max_tokens=1), handoff=Handoff(stage=job))
    r.block_hashes = layer_hashes(block_hashes(tokens, BS, "test"), 2, 4)
    r.ready_tokens = job.start if job.act_in is not None else None
    return r


def test_a_later_stage_computes_only_what_arrived() -> None:
    s = make(budget=64)
    job = StageJob(1, 2, 0, act_in=ACT)
    r = stage_req("r", 40, job)
    s.add_request(r)
    # Admitted, nothing arrived: no chunk, and nothing is wrong.
    assert shape(s.schedule()) == []
    r.ready_tokens = 24
    plan = s.schedule()
    assert shape(plan) == [("r", 0, 24, False)]
    assert plan.chunks[0].act_rows == ACT.rows(0, 24)
    s.update(plan, [None])
    assert shape(s.schedule()) == []
    r.ready_tokens = 40
    # The last stage samples at the prompt's end.
    assert shape(s.schedule()) == [("r", 24, 16, True)]


def test_the_head_runs_its_planned_chunks_and_samples_nothing() -> None:
    s = make(budget=64)
    job = StageJob(0, 2, 0, (16, 12, 12), act_out=ACT)
    s.add_request(stage_req("r", 40, job))
    sizes = []
    while plan := s.schedule():
        if not plan.chunks:
            break
        sizes += [(c.start_pos, c.num_tokens, c.sample, c.act_rows) for c in plan.chunks]
        s.update(plan, [None])
        if s.requests["r"].num_computed_tokens == 40:
            break
    assert sizes == [(0, 16, False, None), (16, 12, False, None), (28, 12, False, None)]


def test_a_stage_starts_exactly_where_its_group_agreed() -> None:
    s = make(budget=64)
    # Another request cached the first 16 tokens' blocks here.
    first = stage_req("a", 20, StageJob(1, 2, 0, act_in=ACT))
    s.add_request(first)
    first.ready_tokens = 20
    s.update(s.schedule(), [None])
    # The group agreed on 8 (another stage held less): computed from 8, not 16.
    later = stage_req("b", 20, StageJob(1, 2, 8, act_in=dataclasses.replace(ACT, start=8)))
    s.add_request(later)
    later.ready_tokens = 20
    plan = s.schedule()
    assert ("b", 8, 12, True) in shape(plan)
    # One that was to start from 16 here but holds nothing fails explicitly.
    lost = stage_req(
        "c", 40, StageJob(1, 2, 16, act_in=dataclasses.replace(ACT, start=16)), base=100
    )
    s.add_request(lost)
    lost.ready_tokens = 40
    s.schedule()
    failed = s.take_failed()
    assert [(r.request_id, "evicted meanwhile" in why) for r, why in failed] == [("c", True)]
    assert s.take_failed() == []


def test_stages_compose_into_the_whole_model_bit_for_bit() -> None:
    whole = load_model(ModelConfig())
    stages = [
        load_model(ModelConfig(), pipeline=PipelineConfig(group="g", stage=i, num_stages=3))
        for i in range(3)
    ]
    assert [len(m.model.model.layers) for m in stages] == [2, 1, 1]
    assert stages[1].model.model.embed_tokens is None and stages[0].model.lm_head is None
    ids = list(range(3, 80))
    blocks = list(range(-(-len(ids) // 16)))

    def plan(act_rows: list[int] | None = None) -> StepPlan:
        return StepPlan([ScheduledChunk("r", ids, 0, blocks, True, act_rows=act_rows)])

    want = ModelRunner(whole, 16, 16).forward_logits(plan())[0]
    rows = list(range(len(ids)))
    runners = [ModelRunner(m, 16, 16) for m in stages]
    hidden = runners[0].run(plan()).hidden
    for runner in runners[1:-1]:
        runner.act_in = hidden
        hidden = runner.run(plan(rows)).hidden
    runners[-1].act_in = hidden
    got = runners[-1].forward_logits(plan(rows))[0]
    assert torch.equal(got, want)
