"""The prefill side of the handoff without daemons: the runs a chunk's rows
become, and a step's report applied on the event loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from mooncaked.engine.handoff import KVWrite, StepSend
from mooncaked.engine.kv_sender import KVSender, SendMeta, SendReport
from mooncaked.engine.plan import StepPlan, chunk_of
from mooncaked.handoff import Handoff, KVGrant, KVLayout
from mooncaked.request import KVSent, Request, SamplingParams

BS = 4
LAYOUT = KVLayout(num_layers=2, num_blocks=16, block_size=BS, row_bytes=8)


def grant(
    node: str,
    block_ids: tuple[int, ...],
    first_block: int = 0,
    *,
    layout: KVLayout = LAYOUT,
    address: str = "127.0.0.1:1",
) -> KVGrant:
    return KVGrant(
        request_id="r",
        node_id=node,
        transfer_address=address,
        segment="kv",
        layout=layout,
        first_block=first_block,
        block_ids=block_ids,
        ttl_s=30.0,
    )


def test_runs_are_contiguous_on_both_sides() -> None:
    g = grant("d1", (10, 11, 12))
    # Request blocks 3, 4, 5 into granted 10, 11, 12: one run of 12 rows.
    assert KVSender._runs(g, [3, 4, 5], 0, 12) == [(3, 10, 0, 12)]
    # The source breaks at block 1 (7 does not follow 3): a run per side's run.
    assert KVSender._runs(g, [3, 7, 8], 0, 10) == [(3, 10, 0, 4), (7, 11, 0, 6)]
    # The destination breaks too.
    gap = grant("d1", (10, 12, 13))
    assert KVSender._runs(gap, [3, 4, 5], 0, 12) == [(3, 10, 0, 4), (4, 12, 0, 8)]


def test_runs_skip_the_blocks_the_decode_node_has_and_extend_across_block_ends() -> None:
    # The decode node had blocks 0 and 1 (a prefix hit there): rows from 8 on.
    g = grant("d1", (20, 21), first_block=2)
    assert KVSender._runs(g, [0, 1, 5, 6], 0, 14) == [(5, 20, 0, 6)]
    # A chunk starting mid-block extends across the block end that follows.
    g = grant("d1", (10, 11, 12))
    assert KVSender._runs(g, [3, 4, 5], 2, 9) == [(3, 10, 2, 7)]
    # Rows of one block only: the run starts where the chunk does.
    assert KVSender._runs(g, [3, 4, 5], 9, 12) == [(5, 12, 1, 3)]


def test_runs_of_a_grant_that_does_not_cover_the_prompt_are_none() -> None:
    g = grant("d1", (10, 11))
    assert KVSender._runs(g, [3, 4, 5], 0, 9) is None
    assert KVSender._runs(g, [3, 4, 5], 0, 8) == [(3, 10, 0, 8)]


class Writer:
    """Records each batch and its writes; a batch to ``refuse`` fails, and a
    peer at an address in ``bad_addresses`` cannot be added."""

    def __init__(self, refuse: set[str], bad_addresses: frozenset[str] = frozenset()) -> None:
        self.refuse = refuse
        self.bad_addresses = bad_addresses
        self.peers: list[str] = []
        self.batches: list[tuple[str, int]] = []
        self.writes: list[KVWrite] = []

    def add_peer(self, node_id: str, address: str) -> None:
        if address in self.bad_addresses:
            raise ValueError(f"{address!r} is not host:port")
        self.peers.append(node_id)

    async def write(
        self, segment: str, writes: list[KVWrite], timeout_s: float
    ) -> tuple[bool, str]:
        node = writes[0][1]
        self.batches.append((node, len(writes)))
        self.writes += writes
        if node in self.refuse:
            return False, f"{node} refused"
        return True, ""


def granted(
    rid: str, node: str, n: int, block_ids: tuple[int, ...], **grant_fields: Any
) -> Request:
    return Request(
        rid,
        list(range(n)),
        SamplingParams(max_tokens=1),
        handoff=Handoff(sink=grant(node, block_ids, **grant_fields)),
    )


async def send(sender: KVSender, meta: SendMeta | None) -> SendReport | None:
    """The worker side of one step, in a thread of its own as the runner's."""

    def step() -> SendReport | None:
        for layer in range(LAYOUT.num_layers):
            sender.save_layer(layer, meta)
        return sender.wait_for_save(meta)

    return await asyncio.to_thread(step)


async def run_step(sender: KVSender, plan: StepPlan) -> SendReport | None:
    return await send(sender, sender.build_meta(plan))


async def test_a_failed_write_fails_only_the_requests_of_its_decode_node() -> None:
    steps: list[StepSend] = []
    writer = Writer(refuse={"d2"})
    sender = KVSender(
        writer, segment="kv", layout=LAYOUT, loop=asyncio.get_running_loop(), on_step=steps.append
    )
    reqs = [
        granted("r1", "d1", 6, (8, 9)),
        granted("r2", "d2", 6, (8, 9)),
        granted("r3", "d1", 5, (10, 11)),
    ]
    for r in reqs:
        sender.request_added(r)
    tables = [[0, 1], [2, 3], [4, 5]]
    plan = StepPlan(
        [chunk_of(r, r.prompt_token_ids, 0, t, True) for r, t in zip(reqs, tables, strict=True)]
    )
    report = await run_step(sender, plan)
    assert isinstance(report, SendReport)
    # The step thread changed nothing of the loop's: the report says it all.
    assert sender.kv_sent(reqs[0]) == KVSent(0) and sender.stats.sent_bytes == 0
    # Rows x row bytes x K and V x layers: 6 * 8 * 2 * 2 and 5 * 8 * 2 * 2.
    assert report.bytes_sent == (("r1", 192), ("r3", 160), ("r2", 192))
    assert report.failed == (("r2", "a KV write to d2 failed: d2 refused"),)
    assert report.in_flight == () and report.num_failed_batches == 2
    # One batch per decode node per layer: d1's carries both of its requests.
    assert writer.batches == [("d1", 4), ("d2", 2), ("d1", 4), ("d2", 2)]
    sender.after_step(report)
    assert sender.kv_sent(reqs[0]) == KVSent(192)
    assert sender.kv_sent(reqs[1]) == KVSent(192, "a KV write to d2 failed: d2 refused")
    assert sender.kv_sent(reqs[2]) == KVSent(160)
    st = sender.stats
    assert (st.sent_bytes, st.send_failures, st.num_steps_sent) == (544, 2, 1)
    assert len(steps) == 1 and steps[0].num_bytes == 544 and not steps[0].ok
    # Finished: its state goes; a request that sent nothing has no outcome.
    sender.request_finished(reqs[0])
    assert sender.kv_sent(reqs[0]) is None
    assert sender.kv_sent(Request("other", [1], SamplingParams())) is None


async def test_a_middle_chunks_writes_are_waited_for_by_the_step_that_samples() -> None:
    writer = Writer(refuse={"d1"})  # the middle chunk's writes fail
    sender = KVSender(writer, segment="kv", layout=LAYOUT, loop=asyncio.get_running_loop())
    r = granted("r", "d1", 10, (8, 9, 10))
    sender.request_added(r)
    first = await run_step(sender, StepPlan([chunk_of(r, list(range(6)), 0, [0, 1], False)]))
    assert isinstance(first, SendReport)
    # Not waited for: in flight, no step figures, no failures known yet.
    assert [(b.node_id, b.request_ids) for b in first.in_flight] == [("d1", ("r",))] * 2
    assert first.step is None and first.failed == () and first.bytes_sent == (("r", 192),)
    sender.after_step(first)
    writer.refuse.clear()  # the rest lands
    plan = StepPlan([chunk_of(r, list(range(6, 10)), 6, [0, 1, 2], True)])
    meta = sender.build_meta(plan)
    assert isinstance(meta, SendMeta)
    assert meta.pending == first.in_flight
    assert [s.runs for s in meta.sends] == [((1, 9, 2, 4),)]
    report = await send(sender, meta)
    assert isinstance(report, SendReport) and report.step is not None
    # Its own two batches landed; the middle chunk's two, waited for now, had not.
    assert writer.batches == [("d1", 2)] * 4
    assert report.num_failed_batches == 2 and not report.step.ok
    sender.after_step(report)
    assert sender.kv_sent(r) == KVSent(192 + 4 * 8 * 2 * 2, "a KV write to d1 failed: d1 refused")


async def test_a_grant_that_expired_or_does_not_fit_sends_nothing() -> None:
    now = [0.0]
    sender = KVSender(
        Writer(set()),
        segment="kv",
        layout=LAYOUT,
        loop=asyncio.get_running_loop(),
        clock=lambda: now[0],
    )
    late = granted("late", "d1", 4, (8,))
    sender.request_added(late)  # its grant lasts until 30
    now[0] = 31.0
    short = granted("short", "d1", 10, (8, 9))
    fits = granted("fits", "d1", 4, (10,))
    sender.request_added(short)
    sender.request_added(fits)
    now[0] = 40.0
    plan = StepPlan(
        [
            chunk_of(late, late.prompt_token_ids, 0, [0], True),
            chunk_of(short, short.prompt_token_ids, 0, [1, 2, 3], True),
            chunk_of(fits, fits.prompt_token_ids, 0, [4], True),
        ]
    )
    meta = sender.build_meta(plan)
    assert isinstance(meta, SendMeta) and [s.request_id for s in meta.sends] == ["fits"]
    assert sender.kv_sent(late) == KVSent(0, "the grant expired before its KV was sent")
    assert sender.kv_sent(short) == KVSent(0, "the grant does not cover the prompt")
    # Failed once, skipped from then on.
    assert sender.build_meta(StepPlan(plan.chunks[:2])) is None


def offset(layer: int, kv: int, block: int, row: int = 0) -> int:
    """LAYOUT's byte offset, by hand: 16 blocks of 4 rows of 8 bytes per layer and K|V."""
    return ((layer * 2 + kv) * 16 + block) * 32 + row * 8


async def test_a_grant_of_another_layout_or_a_bad_address_fails_before_anything_is_sent() -> None:
    writer = Writer(set(), bad_addresses=frozenset({"nowhere"}))
    sender = KVSender(writer, segment="kv", layout=LAYOUT, loop=asyncio.get_running_loop())
    other = KVLayout(num_layers=2, num_blocks=16, block_size=BS, row_bytes=16)
    odd = granted("odd", "d1", 4, (8,), layout=other)
    lost = granted("lost", "d2", 4, (8,), address="nowhere")
    fine = granted("fine", "d3", 4, (9,))
    for r in (odd, lost, fine):
        sender.request_added(r)
    # Only the grant that fits names a peer to write to.
    assert writer.peers == ["d3"]
    assert sender.kv_sent(odd) == KVSent(
        0, f"the decode node's KV layout {other} does not match this node's {LAYOUT}"
    )
    assert sender.kv_sent(lost) == KVSent(0, "bad transfer address: 'nowhere' is not host:port")
    plan = StepPlan(
        [chunk_of(r, r.prompt_token_ids, 0, [i], True) for i, r in enumerate((odd, lost, fine))]
    )
    meta = sender.build_meta(plan)
    assert isinstance(meta, SendMeta) and [s.request_id for s in meta.sends] == ["fine"]
    sender.after_step(await send(sender, meta))
    assert writer.batches == [("d3", 2), ("d3", 2)]
    assert sender.kv_sent(fine) == KVSent(4 * 8 * 2 * 2)


async def test_without_layerwise_sends_one_batch_of_every_layer_after_the_step() -> None:
    writer = Writer(set())
    sender = KVSender(
        writer, segment="kv", layout=LAYOUT, loop=asyncio.get_running_loop(), layerwise=False
    )
    r = granted("r", "d1", 6, (8, 9))
    sender.request_added(r)
    report = await run_step(sender, StepPlan([chunk_of(r, r.prompt_token_ids, 0, [0, 1], True)]))
    assert isinstance(report, SendReport) and report.step is not None and report.step.ok
    # Both layers in one batch: K then V of layer 0, then of layer 1; rows
    # 0..5 of blocks 0-1 into rows 0..5 of granted blocks 8-9, one run each.
    assert writer.batches == [("d1", 4)]
    assert writer.writes == [
        (offset(layer, kv, 0), "d1", "kv", offset(layer, kv, 8), 6 * 8)
        for layer in (0, 1)
        for kv in (0, 1)
    ]
    assert report.bytes_sent == (("r", 192),) and report.num_bytes == 192


async def test_a_chunk_after_a_prefix_cached_here_also_sends_the_prefix() -> None:
    writer = Writer(set())
    sender = KVSender(writer, segment="kv", layout=LAYOUT, loop=asyncio.get_running_loop())
    # This node had the first 8 tokens cached: the chunk computes from 8 on,
    # but the decode node has none of them.
    r = granted("r", "d1", 10, (10, 11, 12))
    # The decode node has block 0: rows from 4 on are its to receive.
    partial = granted("p", "d2", 10, (21, 22), first_block=1)
    for req in (r, partial):
        sender.request_added(req)
    plan = StepPlan(
        [
            chunk_of(r, r.prompt_token_ids[8:], 8, [3, 4, 5], True),
            chunk_of(partial, partial.prompt_token_ids[8:], 8, [6, 7, 8], True),
        ]
    )
    meta = sender.build_meta(plan)
    assert isinstance(meta, SendMeta)
    assert [(s.request_id, s.runs) for s in meta.sends] == [
        ("r", ((3, 10, 0, 10),)),
        ("p", ((7, 21, 0, 6),)),
    ]


LAYOUT4 = KVLayout(num_layers=4, num_blocks=16, block_size=BS, row_bytes=8)


async def _grouped_batches(layer_batch_bytes: int) -> tuple[Writer, SendReport]:
    writer = Writer(set())
    sender = KVSender(
        writer,
        segment="kv",
        layout=LAYOUT4,
        loop=asyncio.get_running_loop(),
        layer_batch_bytes=layer_batch_bytes,
    )
    r = granted("r", "d1", 6, (8, 9), layout=LAYOUT4)
    sender.request_added(r)
    meta = sender.build_meta(StepPlan([chunk_of(r, r.prompt_token_ids, 0, [0, 1], True)]))

    def step() -> SendReport | None:
        for layer in range(LAYOUT4.num_layers):
            sender.save_layer(layer, meta)
        return sender.wait_for_save(meta)

    report = await asyncio.to_thread(step)
    assert isinstance(report, SendReport) and report.step is not None and report.step.ok
    return writer, report


async def test_layers_are_grouped_until_a_batch_carries_layer_batch_bytes() -> None:
    # A layer of this step is 6 rows x 8 bytes x K and V = 96 bytes.
    writer, report = await _grouped_batches(0)
    assert writer.batches == [("d1", 2)] * 4  # every layer alone
    writer, report = await _grouped_batches(192)
    # Layers 0-1 reach it; then the last two layers go one by one.
    assert writer.batches == [("d1", 4), ("d1", 2), ("d1", 2)]
    writer, report = await _grouped_batches(250)
    # Layers 0-2 would reach 288 bytes, but the layer before the last sends
    # what is left, so that the last layer goes alone: the shortest tail.
    assert writer.batches == [("d1", 6), ("d1", 2)]
    writer, report = await _grouped_batches(1 << 20)
    assert writer.batches == [("d1", 6), ("d1", 2)]
    # Grouped or not, the same rows land at the same places.
    assert sorted(writer.writes) == sorted(
        (offset(layer, kv, 0), "d1", "kv", offset(layer, kv, 8), 6 * 8)
        for layer in range(4)
        for kv in (0, 1)
    )
    assert report.bytes_sent == (("r", 384),) and report.num_bytes == 384


class Clock:
    """A clock the test sets: one time for the event loop's thread (where the
    writes complete), another for the step thread."""

    def __init__(self, loop_t: float, step_t: float) -> None:
        self.loop_thread = threading.get_ident()
        self.loop_t, self.step_t = loop_t, step_t

    def __call__(self) -> float:
        return self.loop_t if threading.get_ident() == self.loop_thread else self.step_t


async def test_the_exposed_tail_ends_when_the_writes_complete_not_when_the_step_waits() -> None:
    # The layers end at 10.0 and the writes complete at 10.05.
    clock = Clock(10.05, 10.0)
    writer = Writer(set())
    sender = KVSender(
        writer, segment="kv", layout=LAYOUT, loop=asyncio.get_running_loop(), clock=clock
    )
    r = granted("r", "d1", 6, (8, 9))
    sender.request_added(r)
    meta = sender.build_meta(StepPlan([chunk_of(r, r.prompt_token_ids, 0, [0, 1], True)]))

    def step() -> SendReport | None:
        for layer in range(LAYOUT.num_layers):
            sender.save_layer(layer, meta)
        # The head and sampling take until 10.3.
        clock.step_t = 10.3
        return sender.wait_for_save(meta)

    report = await asyncio.to_thread(step)
    assert isinstance(report, SendReport) and report.step is not None
    assert writer.batches == [("d1", 2), ("d1", 2)]
    assert report.step.exposed_seconds == pytest.approx(0.05)
    assert report.step.send_seconds == pytest.approx(0.05)
    # The step did not wait: its head outlasted the writes.
    assert report.step.blocked_seconds == 0.0
    sender.after_step(report)
    assert sender.stats.exposed_seconds == pytest.approx(0.05)
    assert sender.stats.blocked_seconds == 0.0
