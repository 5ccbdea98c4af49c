"""The decode side of the handoff with a real scheduler and pool, no daemons:
what becomes of the granted blocks when the prefill node answers, fails, or
the request is aborted; the pool's self-check after every move."""

from __future__ import annotations

import asyncio
import math

import pytest

from mooncaked.config import SchedulerConfig
from mooncaked.engine.connector import NO_HIT, BlockHold, ConnectorContext, KVHit, LoadResult
from mooncaked.engine.handoff import PrefillBusy, PrefillCall, PrefillError, PrefillReply
from mooncaked.engine.kv_pool import BlockPool
from mooncaked.engine.kv_receiver import GRANT_GRACE_S, KVReceiver
from mooncaked.engine.plan import LoadJob, SampledToken
from mooncaked.engine.scheduler import Scheduler
from mooncaked.handoff import Handoff, KVGrant, KVLayout, PrefillSource, PrefillTarget, StageRef
from mooncaked.request import FinishReason, Request, RequestState, SamplingParams

BS = 4
TTL = 30.0


class Grants:
    """Write grants opened and closed, in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []

    def open(self, grant: KVGrant, peer: str, ttl_s: float) -> object:
        self.log.append(("open", (peer, grant.block_ids, ttl_s)))
        return peer

    def close(self, handle: object) -> None:
        self.log.append(("close", handle))


class Rig:
    """A scheduler whose connector is a receiver, on a clock the test moves."""

    def __init__(
        self, prefill: PrefillCall, num_blocks: int = 16, targets: tuple[str, ...] = ("p1",)
    ) -> None:
        self.now = 100.0
        self.grants = Grants()
        self.receiver = KVReceiver(
            node_id="d1",
            transfer_address="127.0.0.1:1",
            segment="kv",
            layout=KVLayout(num_layers=1, num_blocks=num_blocks, block_size=BS, row_bytes=8),
            prefill=prefill,
            grant_ttl_s=TTL,
            write_grants=self.grants,
        )
        self.pool = BlockPool(num_blocks)
        self.receiver.bind(ConnectorContext(self.pool, [], BS, lambda: None, lambda: self.now))
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_waiting=16),
            self.pool,
            block_size=BS,
            max_model_len=256,
            model_id="test",
            connector=self.receiver,
        )
        self.req = Request(
            "r",
            list(range(10)),
            SamplingParams(max_tokens=4),
            handoff=Handoff(
                source=PrefillSource(tuple(PrefillTarget(t, f"http://{t}") for t in targets))
            ),
        )

    def admit(self) -> LoadJob:
        self.scheduler.add_request(self.req)
        plan = self.scheduler.schedule()
        assert not plan.chunks and len(plan.loads) == 1
        self.check()
        return plan.loads[0]

    def check(self) -> None:
        self.pool.check_integrity(self.scheduler.block_tables())


def failing(why: str) -> PrefillCall:
    async def prefill(
        target: PrefillTarget, req: Request, grant: KVGrant, wait: float
    ) -> PrefillReply:
        raise PrefillError(why)

    return prefill


async def test_an_answered_handoff_holds_nothing() -> None:
    async def prefill(
        target: PrefillTarget, req: Request, grant: KVGrant, wait: float
    ) -> PrefillReply:
        return PrefillReply("p1", SampledToken(42), num_cached_tokens=4)

    rig = Rig(prefill)
    job = rig.admit()
    assert (job.block_ids, job.cancellable) == ([0, 1, 2], True)
    result = await rig.receiver.load(rig.req, job)
    assert result == LoadResult(10, SampledToken(42), num_cached_tokens=4, prefill_node="p1")
    assert rig.grants.log == [("open", ("p1", (0, 1, 2), TTL + GRANT_GRACE_S)), ("close", "p1")]
    assert rig.scheduler.finish_load(rig.req, result)
    assert rig.pool.num_holds == 0 and rig.req.block_ids == [0, 1, 2]
    rig.check()
    rig.scheduler.finish(rig.req, FinishReason.STOP)
    assert rig.pool.num_free_blocks == 16
    rig.check()


async def test_a_failed_handoff_computes_into_fresh_blocks_and_holds_the_granted_ones() -> None:
    rig = Rig(failing("p1 timed out"))
    job = rig.admit()
    result = await rig.receiver.load(rig.req, job)
    until = 100.0 + TTL + GRANT_GRACE_S
    assert result == LoadResult(0, prefill_node="d1", hold=BlockHold((0, 1, 2), until, swap=True))
    assert rig.receiver.stats.fell_back == 1 and rig.grants.log[-1] == ("close", "p1")
    rig.scheduler.finish_load(rig.req, result)
    assert rig.req.block_ids == [3, 4, 5] and rig.pool.held_blocks() == [0, 1, 2]
    rig.check()
    # The prompt is computed here, into the fresh blocks.
    plan = rig.scheduler.schedule()
    assert [(c.start_pos, c.block_ids) for c in plan.chunks] == [(0, [3, 4, 5])]
    rig.check()
    # The granted blocks come back once no grant of them can be live.
    assert rig.pool.release_expired(until - 0.01) == 0
    assert rig.pool.release_expired(until) == 1
    assert rig.pool.num_holds == 0 and rig.pool.num_free_blocks == 13
    rig.check()


async def test_a_failed_handoff_short_of_fresh_blocks_keeps_the_granted_ones() -> None:
    rig = Rig(failing("p1 refused"), num_blocks=4)
    job = rig.admit()
    result = await rig.receiver.load(rig.req, job)
    rig.scheduler.finish_load(rig.req, result)
    # One block free, three needed: the request computes into the granted
    # ones, and the pool holds them too until the deadline.
    assert rig.req.block_ids == [0, 1, 2] and rig.pool.held_blocks() == [0, 1, 2]
    rig.check()
    rig.scheduler.finish(rig.req, FinishReason.ABORT)
    assert rig.pool.num_free_blocks == 1
    rig.check()
    rig.pool.release_expired(math.inf)
    assert rig.pool.num_free_blocks == 4
    rig.check()


async def test_an_aborted_handoff_holds_the_granted_blocks_until_the_deadline() -> None:
    asked = asyncio.Event()

    async def prefill(
        target: PrefillTarget, req: Request, grant: KVGrant, wait: float
    ) -> PrefillReply:
        asked.set()
        await asyncio.Event().wait()  # a prefill node that never answers
        raise AssertionError("unreachable")

    rig = Rig(prefill)
    job = rig.admit()
    task = asyncio.create_task(rig.receiver.load(rig.req, job))
    await asyncio.wait_for(asked.wait(), 10)
    rig.now = 105.0
    task.cancel()
    result = await task
    # Cancelled, and still a result: nothing landed, the blocks stay held.
    assert not task.cancelled() and rig.receiver.stats.cancelled == 1
    until = 105.0 + TTL + GRANT_GRACE_S
    assert result == LoadResult(0, hold=BlockHold((0, 1, 2), until, swap=False))
    assert rig.grants.log[-1] == ("close", "p1")
    rig.scheduler.finish_load(rig.req, result)
    assert rig.req.state is RequestState.RUNNING and rig.req.block_ids == [0, 1, 2]
    rig.check()
    rig.scheduler.finish(rig.req, FinishReason.ABORT)
    # The request is gone; its blocks are not handed out before the deadline.
    assert rig.pool.num_free_blocks == 13 and rig.pool.held_blocks() == [0, 1, 2]
    rig.check()
    assert rig.pool.next_deadline() == until
    rig.pool.release_expired(until)
    assert rig.pool.num_free_blocks == 16
    rig.check()


@pytest.mark.parametrize(
    ("first", "counted"),
    [(PrefillError("p1 timed out"), "retried"), (PrefillBusy("p1 queue is long"), "passed_on")],
    ids=["failed", "busy"],
)
async def test_a_failed_or_busy_prefill_node_is_replaced_by_the_next_under_its_own_grant(
    first: PrefillError, counted: str
) -> None:
    asked: list[str] = []

    async def prefill(
        target: PrefillTarget, req: Request, grant: KVGrant, wait: float
    ) -> PrefillReply:
        asked.append(target.node_id)
        if target.node_id == "p1":
            raise first
        return PrefillReply("p2", SampledToken(7), num_cached_tokens=4)

    rig = Rig(prefill, targets=("p1", "p2"))
    job = rig.admit()
    result = await rig.receiver.load(rig.req, job)
    assert asked == ["p1", "p2"]
    assert result == LoadResult(10, SampledToken(7), num_cached_tokens=4, prefill_node="p2")
    # Each node may write the blocks only while it is the one asked.
    grant = (0, 1, 2), TTL + GRANT_GRACE_S
    assert rig.grants.log == [
        ("open", ("p1", *grant)),
        ("close", "p1"),
        ("open", ("p2", *grant)),
        ("close", "p2"),
    ]
    st = rig.receiver.stats
    assert (st.ok, getattr(st, counted), st.fell_back) == (1, 1, 0)


async def test_a_grant_that_cannot_be_opened_asks_nobody_and_computes_here() -> None:
    asked: list[str] = []

    async def prefill(
        target: PrefillTarget, req: Request, grant: KVGrant, wait: float
    ) -> PrefillReply:
        asked.append(target.node_id)
        return PrefillReply(target.node_id, SampledToken(7), num_cached_tokens=0)

    rig = Rig(prefill, targets=("p1", "p2"))

    tried: list[str] = []

    def refuse(grant: KVGrant, peer: str, ttl_s: float) -> object:
        tried.append(peer)
        raise ValueError("block 2 is outside the segment")

    rig.grants.open = refuse  # type: ignore[method-assign]
    job = rig.admit()
    result = await rig.receiver.load(rig.req, job)
    # The grant itself is bad: no other node is tried either.
    assert tried == ["p1"] and asked == [] and rig.grants.log == []
    until = 100.0 + TTL + GRANT_GRACE_S
    assert result == LoadResult(0, prefill_node="d1", hold=BlockHold((0, 1, 2), until, swap=True))
    assert rig.receiver.stats.fell_back == 1


async def test_only_an_untried_request_with_prefill_nodes_is_offered_from_outside() -> None:
    rig = Rig(failing("p1 refused"))
    receiver, req = rig.receiver, rig.req
    assert receiver.lookup(req, 4) == KVHit(6, cancellable=True)
    # No prefill nodes: nothing comes from outside.
    assert receiver.lookup(Request("local", list(range(10)), SamplingParams()), 0) == NO_HIT
    # Preempted after it sampled: it recomputes here.
    req.output_token_ids.append(5)
    assert receiver.lookup(req, 0) == NO_HIT
    req.output_token_ids.clear()
    # Its handoff ran (and failed): computed here from then on, until it finishes.
    await receiver.load(req, rig.admit())
    assert receiver.lookup(req, 0) == NO_HIT
    receiver.request_finished(req)
    assert receiver.lookup(req, 0) == KVHit(10, cancellable=True)


async def test_a_long_forecast_prompt_gets_a_grant_long_enough_for_it() -> None:
    seen: list[float] = []

    async def prefill(
        target: PrefillTarget, req: Request, grant: KVGrant, wait: float
    ) -> PrefillReply:
        seen.append(grant.ttl_s)
        raise PrefillError("p1 failed")

    rig = Rig(prefill)
    # The placement expects the KV in 40 s: twice that, more than the configured 30.
    rig.req.handoff = Handoff(source=rig.req.handoff.source, kv_ready_at=rig.now + 40.0)
    job = rig.admit()
    result = await rig.receiver.load(rig.req, job)
    assert seen == [80.0]
    assert rig.grants.log[0] == ("open", ("p1", (0, 1, 2), 80.0 + GRANT_GRACE_S))
    # What the failed node may still write stays held as long as its grant.
    assert result.hold is not None and result.hold.until == 100.0 + 80.0 + GRANT_GRACE_S
    # A short forecast keeps the configured time.
    rig2 = Rig(prefill)
    rig2.req.handoff = Handoff(source=rig2.req.handoff.source, kv_ready_at=rig2.now + 1.0)
    await rig2.receiver.load(rig2.req, rig2.admit())
    assert seen[-1] == TTL


class StageGrants(Grants):
    def open(  # type: ignore[override]
        self, grant: KVGrant, peer: str, ttl_s: float, layers: tuple[int, int] | None = None
    ) -> object:
        self.log.append(("open", (peer, layers)))
        return peer


async def test_each_stage_of_a_group_may_write_only_its_own_layers() -> None:
    asked: list[str] = []

    async def prefill(
        target: PrefillTarget, req: Request, grant: KVGrant, wait: float
    ) -> PrefillReply:
        asked.append(target.node_id)
        return PrefillReply(target.node_id, SampledToken(7), num_cached_tokens=0)

    rig = Rig(prefill)
    rig.receiver.layout = KVLayout(num_layers=4, num_blocks=16, block_size=BS, row_bytes=8)
    rig.grants = StageGrants()
    rig.receiver._write_grants = rig.grants
    bad = (StageRef("b0", "u", 0, 1), StageRef("b1", "u", 2, 4))  # layer 1 held by nobody
    good = (StageRef("s0", "u", 0, 3), StageRef("s1", "u", 3, 4))
    rig.req.handoff = Handoff(
        source=PrefillSource(
            (PrefillTarget("b0", "u", stages=bad), PrefillTarget("s0", "u", stages=good))
        )
    )
    result = await rig.receiver.load(rig.req, rig.admit())
    assert asked == ["s0"] and result.prefill_node == "s0"
    assert rig.grants.log == [
        ("open", ("s0", (0, 3))),
        ("open", ("s1", (3, 4))),
        ("close", "s0"),
        ("close", "s1"),
    ]
