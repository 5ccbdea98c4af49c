"""The scheduler with attention offloading: KV on a memory node holds no local blocks.

Steps are applied as the offloading runner reports them: every one-token
chunk that samples ran its attention on the memory node, which holds its KV
afterwards (``kv_moved``), unless the step says the memory node lost it
(``kv_lost``).
"""

from __future__ import annotations

from mooncaked.engine.plan import SampledToken, StepPlan
from mooncaked.engine.scheduler import Scheduler
from mooncaked.request import FinishReason, RequestState
from tests.unit.test_scheduler import make, req, shape


def offload_step(s: Scheduler, lost: tuple[str, ...] = ()) -> StepPlan:
    plan = s.schedule()
    decodes = tuple(c.request_id for c in plan.chunks if c.num_tokens == 1 and c.sample)
    results = [SampledToken(7) if c.sample else None for c in plan.chunks]
    out = s.update(plan, results, kv_moved=() if lost else decodes, kv_lost=lost)
    for r in out:
        if r.num_output_tokens >= r.sampling.max_tokens:
            s.finish(r, FinishReason.LENGTH)
    s.pool.check_integrity(s.block_tables())
    return plan


def test_offloaded_requests_hold_no_blocks_so_a_batch_outgrows_the_pool() -> None:
    # 4 blocks of 4 tokens; three requests of 7 + 6 tokens need 12 blocks in all.
    s = make(num_blocks=4)
    a, b, c = (req(x, 7, max_tokens=6, base=100 * i) for i, x in enumerate("abc"))
    for r in (a, b, c):
        s.add_request(r)
    plan = offload_step(s)  # a and b prefill into the 4 blocks; c waits
    assert shape(plan) == [("a", 0, 7, True), ("b", 0, 7, True)]
    assert s.pool.num_free_blocks == 0 and c.state is RequestState.WAITING
    plan = offload_step(s)  # their first decodes upload them: the blocks go back
    assert shape(plan) == [("a", 7, 1, True), ("b", 7, 1, True)]
    assert [ch.kv_remote for ch in plan.chunks] == [False, False]
    assert s.remote == {"a", "b"} and a.block_ids == [] and b.block_ids == []
    plan = offload_step(s)  # c is admitted into the freed blocks
    assert shape(plan) == [("a", 8, 1, True), ("b", 8, 1, True), ("c", 0, 7, True)]
    assert [(ch.kv_remote, ch.block_ids) for ch in plan.chunks[:2]] == [(True, []), (True, [])]
    while s.requests:
        offload_step(s)
    assert [r.num_output_tokens for r in (a, b, c)] == [6, 6, 6]
    assert s.num_preemptions == 0
    assert s.pool.num_used_blocks == 0 and s.remote == set()


def test_lost_kv_is_recomputed_and_the_memory_node_told_to_forget_it() -> None:
    dropped: list[str] = []
    s = make(num_blocks=8)
    s.on_remote_dropped = dropped.append
    a, b = req("a", 7, max_tokens=6), req("b", 5, max_tokens=6, base=100)
    s.add_request(a)
    s.add_request(b)
    offload_step(s)
    offload_step(s)
    assert s.remote == {"a", "b"}
    plan = offload_step(s, lost=("a", "b"))
    assert shape(plan) == [("a", 8, 1, True), ("b", 6, 1, True)]
    # The lost step's tokens are void; both rejoin the queue to be recomputed.
    assert a.state is RequestState.PREEMPTED and b.state is RequestState.PREEMPTED
    assert (a.num_output_tokens, b.num_output_tokens) == (2, 2)
    assert s.remote == set() and sorted(dropped) == ["a", "b"]
    # Prompt and outputs so far, in local blocks again (past the first
    # blocks, still in the prefix cache).
    plan = offload_step(s)
    assert shape(plan) == [("a", 4, 5, True), ("b", 4, 3, True)]
    assert all(not ch.kv_remote and ch.block_ids for ch in plan.chunks)
    while s.requests:
        offload_step(s)
    assert s.pool.num_used_blocks == 0


def test_a_lost_request_that_outgrew_the_pool_fails_explicitly() -> None:
    # 4 blocks hold its 13-token prompt (and the first decode's token), not 17 tokens.
    s = make(num_blocks=4)
    a = req("a", 13, max_tokens=8)
    s.add_request(a)
    for _ in range(4):
        offload_step(s)
    assert s.remote == {"a"} and a.num_tokens == 17
    offload_step(s, lost=("a",))
    failed = s.take_failed()
    assert [(r.request_id, "more KV blocks than this node has" in why) for r, why in failed] == [
        ("a", True)
    ]
    s.finish(a, FinishReason.ABORT)
    assert s.pool.num_used_blocks == 0 and not s.requests


def test_a_request_aborted_while_its_kv_moved_is_forgotten_on_the_memory_node() -> None:
    dropped: list[str] = []
    s = make()
    s.on_remote_dropped = dropped.append
    a = req("a", 3)
    s.add_request(a)
    offload_step(s)
    plan = s.schedule()
    s.finish(a, FinishReason.ABORT)  # the abort lands while the step runs
    s.update(plan, [SampledToken(7)], kv_moved=("a",))
    assert dropped == ["a"] and s.remote == set()
    assert s.pool.num_used_blocks == 0
