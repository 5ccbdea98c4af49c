"""The scheduler driven with sampled token ids, no model: exact plans and orders."""

from __future__ import annotations

import pytest

from mooncaked.cache.hashing import block_hashes
from mooncaked.config import SchedulerConfig
from mooncaked.engine.connector import KVConnector, KVHit, LoadResult
from mooncaked.engine.kv_pool import BlockPool, CachedRun
from mooncaked.engine.output import token_stop_reason
from mooncaked.engine.plan import SampledToken, StepPlan
from mooncaked.engine.scheduler import QueueFullError, Scheduler
from mooncaked.handoff import Handoff, PrefillSource
from mooncaked.request import FinishReason, Request, RequestState, SamplingParams

BS = 4
EOS = 999


def make(
    num_blocks: int = 64,
    budget: int = 64,
    max_num_seqs: int = 8,
    max_waiting: int = 16,
    connector: KVConnector | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_waiting=max_waiting
        ),
        BlockPool(num_blocks),
        block_size=BS,
        max_model_len=256,
        model_id="test",
        connector=connector,
    )


def req(rid: str, n: int, max_tokens: int = 4, base: int = 0, **kw: object) -> Request:
    return Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens, **kw))


def step(s: Scheduler, token: int = 7) -> tuple[StepPlan, list[Request]]:
    plan = s.schedule()
    results = [SampledToken(token) if c.sample else None for c in plan.chunks]
    out = apply(s, plan, results)
    s.pool.check_integrity(s.block_tables())
    return plan, out


def apply(s: Scheduler, plan: StepPlan, results: list[SampledToken | None]) -> list[Request]:
    out = s.update(plan, results)
    # As the engine does: the output processor's verdict takes requests out.
    for r in out:
        reason = token_stop_reason(r, r.output_token_ids[-1], frozenset({EOS}), 256)
        if reason is not None:
            s.finish(r, reason)
    return out


def shape(plan: StepPlan) -> list[tuple[str, int, int, bool]]:
    return [(c.request_id, c.start_pos, c.num_tokens, c.sample) for c in plan.chunks]


def test_prefill_then_batched_decode_until_max_tokens() -> None:
    s = make()
    s.add_request(req("a", 6, max_tokens=3))
    s.add_request(req("b", 3, max_tokens=2))
    plan, out = step(s)
    assert shape(plan) == [("a", 0, 6, True), ("b", 0, 3, True)]
    assert [r.request_id for r in out] == ["a", "b"]
    plan, out = step(s)
    assert shape(plan) == [("a", 6, 1, True), ("b", 3, 1, True)]
    assert s.requests.keys() == {"a"}  # b reached max_tokens=2
    assert out[1].finish_reason is FinishReason.LENGTH
    plan, _ = step(s)
    assert shape(plan) == [("a", 7, 1, True)]
    assert not s.requests
    assert s.pool.num_used_blocks == 0


def test_chunked_prefill_respects_the_token_budget() -> None:
    s = make(budget=8)
    s.add_request(req("long", 20))
    s.add_request(req("short", 2))
    plan, _ = step(s)
    assert shape(plan) == [("long", 0, 8, False)]
    plan, _ = step(s)
    assert shape(plan) == [("long", 8, 8, False)]
    plan, _ = step(s)
    # The last 4 prompt tokens, then the rest of the budget goes to the next arrival.
    assert shape(plan) == [("long", 16, 4, True), ("short", 0, 2, True)]
    plan, _ = step(s)
    assert shape(plan) == [("long", 20, 1, True), ("short", 2, 1, True)]


def test_shared_prefix_hits_cached_blocks_and_counts_cached_tokens() -> None:
    s = make()
    s.add_request(req("a", 10, max_tokens=1))
    step(s)  # a finishes after one token; its two full blocks stay cached
    assert len(s.pool.cached_blocks) == 2
    b = req("b", 13, max_tokens=1)  # same first 10 tokens (0..9), then more
    s.add_request(b)
    plan, _ = step(s)
    assert shape(plan) == [("b", 8, 5, True)]
    assert b.num_cached_tokens == 8
    assert s.prefix_hit_tokens == 8 and s.prefix_queried_tokens == 23


def test_fully_cached_prompt_recomputes_its_last_block() -> None:
    s = make()
    s.add_request(req("a", 8, max_tokens=1))
    step(s)
    s.add_request(req("b", 8, max_tokens=1))
    plan, _ = step(s)
    assert shape(plan) == [("b", 4, 4, True)]


def test_preemption_frees_the_newest_request_and_it_resumes_by_recompute() -> None:
    # 4 blocks of 4 tokens: two requests of 7 prompt tokens fill them after one decode.
    s = make(num_blocks=4)
    a = req("a", 7, max_tokens=6)
    b = req("b", 7, max_tokens=6, base=100)
    s.add_request(a)
    s.add_request(b)
    step(s)  # both prefilled: 2 blocks each, 8 tokens held with the sampled one
    plan, _ = step(s)  # both decode into their 8th slot: no new block needed
    assert shape(plan) == [("a", 7, 1, True), ("b", 7, 1, True)]
    plan, _ = step(s)  # a needs a 3rd block: b is preempted
    assert shape(plan) == [("a", 8, 1, True)]
    assert plan.preempted == ["b"]
    assert b.state is RequestState.PREEMPTED and b.block_ids == []
    assert s.num_preemptions == 1
    while "a" in s.requests:
        step(s)
    # b comes back: its prompt and its 2 outputs so far are recomputed in one chunk.
    plan, _ = step(s)
    assert plan.chunks[0].request_id == b.request_id
    assert b.num_output_tokens == 3
    assert b.num_cached_tokens == 0  # reported once, at first admission
    while s.requests:
        step(s)
    assert b.num_output_tokens == 6
    assert s.pool.num_used_blocks == 0


def test_eos_and_stop_token_ids_finish_with_stop() -> None:
    s = make()
    a = req("a", 3)
    b = req("b", 3, stop_token_ids=(5,))
    c = req("c", 3, ignore_eos=True)
    for r in (a, b, c):
        s.add_request(r)
    plan = s.schedule()
    apply(s, plan, [SampledToken(EOS), SampledToken(5), SampledToken(EOS)])
    assert a.finish_reason is FinishReason.STOP
    assert b.finish_reason is FinishReason.STOP
    assert c.state is RequestState.RUNNING


def test_max_num_seqs_caps_running_and_fcfs_order_holds() -> None:
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 2, base=10 * i))
    plan, _ = step(s)
    assert [c.request_id for c in plan.chunks] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_waiting_queue_bound_raises_queue_full_with_retry_after() -> None:
    s = make(max_waiting=2)
    s.add_request(req("a", 2))
    s.add_request(req("b", 2))
    with pytest.raises(QueueFullError) as err:
        s.add_request(req("c", 2))
    assert err.value.retry_after_s >= 1.0
    step(s)  # a and b leave the waiting queue; ids stay in use until they finish
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("a", 2))
    s.add_request(req("c", 2))


def test_abort_while_waiting_and_running_frees_everything() -> None:
    s = make(budget=4)
    a = req("a", 10)
    b = req("b", 3)
    s.add_request(a)
    s.add_request(b)
    step(s)  # a holds a chunk of 4 tokens, b waits
    s.finish(a, FinishReason.ABORT)
    s.finish(b, FinishReason.ABORT)
    s.finish(b, FinishReason.ABORT)  # idempotent
    assert not s.requests and not s.running and not s.waiting
    assert s.pool.num_used_blocks == 0
    s.pool.check_integrity([])


class FixedConnector(KVConnector):
    """Offers ``blocks`` blocks past the device hits, or None while ``known`` is False."""

    def __init__(self, blocks: int | None) -> None:
        self.blocks = blocks
        self.known = True
        self.asked: list[tuple[str, int]] = []

    def lookup(self, req: Request, num_computed_tokens: int) -> KVHit | None:
        self.asked.append((req.request_id, num_computed_tokens))
        if not self.known:
            return None
        max_blocks = (req.num_tokens - 1) // BS - num_computed_tokens // BS
        n = max_blocks if self.blocks is None else min(self.blocks, max_blocks)
        return KVHit(n * BS)


def test_host_cached_prefix_is_loaded_then_only_the_tail_computed() -> None:
    conn = FixedConnector(2)
    s = make(connector=conn)
    r = req("r", 14)
    s.add_request(r)
    plan = s.schedule()
    assert plan.chunks == [] and len(plan.loads) == 1
    job = plan.loads[0]
    assert (job.first_block, job.num_tokens, job.block_ids) == (0, 8, r.block_ids)
    assert r.state is RequestState.LOADING and conn.asked == [("r", 0)]
    s.pool.check_integrity(s.block_tables())
    assert not s.finish_load(r, LoadResult(8))
    plan, _ = step(s)
    assert shape(plan) == [("r", 8, 6, True)]
    assert r.num_cached_tokens == 8 and s.prefix_hit_tokens == 8


def test_partial_load_computes_from_the_first_missing_block() -> None:
    s = make(connector=FixedConnector(None))
    r = req("r", 13)
    s.add_request(r)
    assert s.schedule().loads[0].num_tokens == 12
    with pytest.raises(RuntimeError, match="while its load runs"):
        s.finish(r, FinishReason.ABORT)
    s.finish_load(r, LoadResult(4))  # the second block vanished between lookup and load
    plan, _ = step(s)
    assert shape(plan) == [("r", 4, 9, True)]
    assert len(r.block_ids) == 4  # the unloaded blocks are reused for compute


def test_a_load_that_sampled_joins_the_decode_batch() -> None:
    # A remote prefill delivers every prompt token's KV and the first token.
    class Remote(KVConnector):
        def lookup(self, req: Request, num_computed_tokens: int) -> KVHit | None:
            return KVHit(req.num_tokens - num_computed_tokens)

    s = make(connector=Remote())
    r = req("r", 10, max_tokens=3)
    s.add_request(r)
    job = s.schedule().loads[0]
    assert (job.first_block, job.num_tokens, len(job.block_ids)) == (0, 10, 3)
    assert s.finish_load(r, LoadResult(10, SampledToken(42)))
    assert r.output_token_ids == [42] and r.num_computed_tokens == 10
    plan, _ = step(s)
    assert shape(plan) == [("r", 10, 1, True)]
    assert r.num_cached_tokens == 10


def test_requests_the_connector_cannot_answer_yet_wait_while_others_run() -> None:
    conn = FixedConnector(0)
    conn.known = False
    s = make(connector=conn)
    a = req("a", 3)
    s.add_request(a)
    plan, _ = step(s)
    assert plan.chunks == [] and a.state is RequestState.WAITING
    conn.known = True
    s.add_request(req("b", 3, base=50))
    plan, _ = step(s)
    assert [c.request_id for c in plan.chunks] == ["a", "b"]


def test_token_slice_equals_slicing_the_whole_sequence() -> None:
    r = req("r", 3)
    r.output_token_ids = [40, 41]
    full = r.all_token_ids
    for start in range(len(full) + 1):
        for end in range(start, len(full) + 2):
            assert r.token_slice(start, end) == full[start:end]


def test_work_says_when_each_handoff_is_expected_to_start_decoding() -> None:
    s = make()
    s.add_request(req("local", 8))
    for rid, base, ready_at in (("soon", 100, 10.5), ("late", 200, 9.0), ("unknown", 300, 0.0)):
        r = req(rid, 8, base=base)
        r.handoff = Handoff(source=PrefillSource(()), kv_ready_at=ready_at)
        s.add_request(r)
    prefill, decode = s.work()
    assert prefill == [(8, 0)]
    # When each placement expected its KV in (0: no forecast); the load
    # meter counts it from its own clock (tests/unit/test_cluster_local.py).
    assert decode == [(8, 0, 4, 10.5), (8, 0, 4, 9.0), (8, 0, 4, 0.0)]


def test_full_blocks_are_told_as_runs_with_their_tokens_and_parent() -> None:
    s = make(budget=6)
    runs: list[CachedRun] = []
    s.pool.run_listeners.append(runs.append)
    a = req("a", 10, max_tokens=3)
    s.add_request(a)
    step(s)  # tokens 0..5: block 0 fills
    step(s)  # tokens 6..9: block 1 fills, a token (7) is sampled
    step(s)  # the sampled token
    step(s)  # the second: block 2 fills
    hashes = block_hashes(a.all_token_ids, BS, "test")
    assert runs == [
        CachedRun((hashes[0],), None, (0, 1, 2, 3)),
        CachedRun((hashes[1],), hashes[0], (4, 5, 6, 7)),
        CachedRun((hashes[2],), hashes[1], (8, 9, 7, 7)),
    ]
    # A prefix hit is not told again: only the blocks computed past it.
    s.add_request(req("b", 9, max_tokens=1))
    step(s)
    b_hashes = block_hashes(list(range(9)), BS, "test")
    assert b_hashes[:2] == hashes[:2]
    assert runs[3:] == []
