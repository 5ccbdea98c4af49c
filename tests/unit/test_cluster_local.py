"""The daemon's side of gossip: load from a real scheduler and engine, block-event
batching into a real block log, and holder lookup over a real cluster view."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from mooncaked.cache.tiers import Tier as StoreTier
from mooncaked.cluster.costs import StepFeatures, prefill_pairs
from mooncaked.cluster.events import BlockEventBatcher
from mooncaked.cluster.forecast import PrefillWork
from mooncaked.cluster.holders import ClusterHolders
from mooncaked.cluster.load import CostMeter, LoadMeter, engine_work
from mooncaked.cluster.state import (
    BlockEvent,
    BlockLog,
    BlockOp,
    ClusterView,
    Member,
    MemberStatus,
    NodeBlocks,
    NodeLoad,
    NodeState,
)
from mooncaked.config import SchedulerConfig
from mooncaked.engine.kv_pool import BlockPool
from mooncaked.engine.plan import SampledToken
from mooncaked.engine.scheduler import Scheduler
from mooncaked.engine.snapshot import EngineLoad, EngineSnapshot, ModelFacts
from mooncaked.request import FinishReason, Request, SamplingParams
from tests.conftest import ManualClock, make_config


def h(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


# -- load ----------------------------------------------------------------------


def test_scheduler_load_counts_prompt_tokens_left_and_decodes() -> None:
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8, max_waiting=8),
        BlockPool(64),
        block_size=4,
        max_model_len=256,
        model_id="test",
    )
    for rid, n in (("a", 6), ("b", 10), ("c", 3)):
        s.add_request(Request(rid, list(range(n)), SamplingParams(max_tokens=4)))
    assert s.load() == (19, 0)

    def step() -> None:
        plan = s.schedule()
        s.update(plan, [SampledToken(7) if c.sample else None for c in plan.chunks])

    step()  # a: all 6 tokens, sampled; b: 2 of 10; c waits
    assert s.load() == (8 + 3, 1)
    step()  # a decodes; b: 7 more (1 left); c waits
    assert s.load() == (1 + 3, 1)
    step()  # a decodes; b: its last token, sampled; c: 3 tokens, sampled
    assert s.load() == (0, 3)
    s.finish(s.requests["a"], FinishReason.ABORT)
    assert s.load() == (0, 2)


async def test_load_meter_reads_the_engine_and_predicts_queue_time() -> None:
    from mooncaked.engine.core import EngineCore

    engine = EngineCore(
        make_config(kv={"num_blocks": 64}, scheduler={"max_num_batched_tokens": 64})
    )
    clock = ManualClock()
    draining = [False]
    costs = CostMeter(engine)
    meter = LoadMeter(
        role="prefill",
        api_addr="127.0.0.1:8000",
        engine=lambda: engine,
        draining=lambda: draining[0],
        clock=clock,
        costs=costs,
    )
    await engine.start()
    try:
        idle = meter()
        assert (idle.role, idle.model_id, idle.api_addr) == (
            "prefill",
            "builtin:tiny@0",
            "127.0.0.1:8000",
        )
        assert idle.load == NodeLoad() and not idle.draining
        assert idle.costs.chunk_tokens == 64 and idle.costs.kv_bytes_per_token > 0
        # Straight into the scheduler: no step runs it (the loop is not woken).
        req = Request("r", list(range(100)), SamplingParams())
        engine.scheduler.add_request(req)
        engine.publish_snapshot()
        # Busy, but no step measured yet: no prediction.
        assert meter().load.queued_prefill_tokens == 100
        assert meter().load.predicted_queue_s == 0.0
        # Steps that cost 10 ms + 1 ms a token, and nothing else.
        for n in (16, 32, 64, 64, 48):
            f = StepFeatures(n, prefill_pairs(n, 0), 0, 0)
            costs.fitter.add(f, 0.010 + 0.001 * n, pinned=True)
        # Samples, not fitted yet (as after a profile, before its closing refit) ...
        assert meter().load.predicted_queue_s == 0.0
        # ... and the refit alone, adding no sample, reaches what the node publishes.
        costs.fitter.refit()
        # 100 tokens in two steps of a 64-token budget: 2 * 10 ms + 100 * 1 ms.
        assert meter().load.predicted_queue_s == pytest.approx(0.12, abs=1e-3)
        engine.scheduler.finish(req, FinishReason.ABORT)
        engine.publish_snapshot()
        draining[0] = True
        done = meter()
        assert done.load == NodeLoad() and done.draining
        # The same inputs make an equal state: gossip announces nothing new.
        assert meter() == done
    finally:
        await engine.close()
    off = LoadMeter(
        role="decode", api_addr="h:1", engine=lambda: None, draining=lambda: True, clock=clock
    )
    assert off().load == NodeLoad() and off().draining and off().model_id == ""


def test_engine_work_counts_a_handoffs_expected_start_from_the_readers_clock() -> None:
    model = ModelFacts("m", 256, 512, 2, "float32", "cpu", 16, 64, 128, 64, 8)
    snap = EngineSnapshot(
        model,
        EngineLoad(running_decode_batch=1, kv_usage=0.25),
        prefill=((8, 0),),
        decode=((9, 1, 3, 0.0), (8, 0, 4, 10.5), (8, 0, 4, 9.0)),
    )
    work = engine_work(snap, now=10.0)
    assert work.prefill == [PrefillWork(8, 0)]
    # Decoding now; half a second to go; overdue counts from now.
    assert [d.starts_in_s for d in work.decode] == [0.0, 0.5, 0.0]
    assert (work.running_decode_batch, work.kv_usage) == (1, 0.25)


# -- block events --------------------------------------------------------------


async def test_block_events_of_one_loop_turn_are_one_batch() -> None:
    log = BlockLog("me", 1, NodeBlocks(1), 1024)
    batches: list[list[BlockEvent]] = []

    def publish(events: list[BlockEvent]) -> int:
        batches.append(list(events))
        return log.record(events)

    batcher = BlockEventBatcher(publish, asyncio.get_running_loop())
    # As an engine step fires them: synchronously, one per block.
    batcher.on_device_event(h(1), True)
    batcher.on_device_event(h(2), True)
    batcher.on_store_event(h(1), StoreTier.DRAM, True)
    batcher.on_store_event(h(3), StoreTier.SSD, True)
    batcher.on_device_event(h(2), False)
    assert batches == []
    await asyncio.sleep(0)
    assert len(batches) == 1 and batcher.num_batches == 1 and batcher.num_events == 5
    assert [(e[1], e[2]) for e in batches[0]] == [
        ("device", BlockOp.STORED),
        ("device", BlockOp.STORED),
        ("dram", BlockOp.STORED),
        ("ssd", BlockOp.STORED),
        ("device", BlockOp.REMOVED),
    ]
    assert log.index.masks == {h(1): 0b011, h(3): 0b100}
    batcher.add_snapshot([(h(5), "dram", BlockOp.STORED)])
    batcher.close()  # publishes what is pending at once
    assert len(batches) == 2 and log.index.masks[h(5)] == 0b010
    batcher.on_device_event(h(6), True)
    await asyncio.sleep(0)
    assert len(batches) == 2 and h(6) not in log.index.masks


async def test_a_failed_publish_is_counted_and_the_next_batch_goes_out() -> None:
    log = BlockLog("me", 1, NodeBlocks(1), 1024)
    batcher = BlockEventBatcher(log.record, asyncio.get_running_loop())
    batcher.add_snapshot([(b"short", "dram", BlockOp.STORED)])
    await asyncio.sleep(0)
    assert batcher.num_errors == 1 and batcher.num_batches == 0
    batcher.on_device_event(h(1), True)
    await asyncio.sleep(0)
    assert batcher.num_batches == 1 and log.index.masks == {h(1): 0b001}


# -- holders -------------------------------------------------------------------


def _member(
    node_id: str,
    status: MemberStatus = MemberStatus.ALIVE,
    *,
    api_addr: str | None = None,
    draining: bool = False,
    known: bool = True,
) -> Member:
    st = NodeState(
        node_id,
        1,
        3,
        "127.0.0.1:1",
        "both",
        "m",
        f"{node_id}.local:8000" if api_addr is None else api_addr,
        draining,
        NodeLoad(),
        0,
        0,
        0,
    )
    return Member(node_id, ("127.0.0.1", 1), 1, 1, status, 0.0, 0.0, st if known else None)


def _holding(view: ClusterView, member: Member, masks: list[int]) -> None:
    view.members[member.node_id] = member
    blocks = NodeBlocks(1)
    blocks.masks.update({h(i): m for i, m in enumerate(masks) if m})
    view.blocks[member.node_id] = blocks


def test_holders_rank_longest_leasable_prefix_first() -> None:
    view = ClusterView("me", clock=lambda: 0.0)
    seq = [h(i) for i in range(4)]
    dram, ssd, device = 0b010, 0b100, 0b001
    _holding(view, _member("me"), [dram] * 4)  # never ask ourselves
    _holding(view, _member("two"), [dram, dram])
    _holding(view, _member("three-ssd"), [dram, ssd, ssd])
    _holding(view, _member("three"), [dram, device | dram, dram])
    _holding(view, _member("three-draining", draining=True), [dram] * 3)
    # Longer, but only on the device (not leasable) past the first block.
    _holding(view, _member("device"), [dram, device, device, device])
    _holding(view, _member("suspect", MemberStatus.SUSPECT), [dram] * 4)
    _holding(view, _member("no-api", api_addr=""), [dram] * 4)
    _holding(view, _member("unknown-state", known=False), [dram] * 4)
    holders = ClusterHolders(lambda: view, static=("http://static:1",), max_holders=10)
    assert holders.holders(seq) == [
        "http://three.local:8000",
        "http://three-ssd.local:8000",
        "http://three-draining.local:8000",
        "http://two.local:8000",
        "http://device.local:8000",
    ]
    top = ClusterHolders(lambda: view, max_holders=2)
    assert top.holders(seq) == ["http://three.local:8000", "http://three-ssd.local:8000"]
    # Nobody holds the prefix's first block: the static peers, or nobody at all.
    assert holders.holders([h(9), *seq]) == ["http://static:1"]
    assert top.holders([h(9)]) == []
    assert top.holders([]) == []
    # Before gossip runs, only the static peers.
    assert ClusterHolders(lambda: None, static=("http://static:1",)).holders(seq) == [
        "http://static:1"
    ]
    with pytest.raises(ValueError, match="max_holders"):
        ClusterHolders(lambda: view, max_holders=0)
