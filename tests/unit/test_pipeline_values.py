"""Pipelined prefill groups without daemons: the values, the chunk plan and the
pipeline's time, the wire forms, and one stage's activations moved into the
next stage's rows by real transfer engines."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest
import torch

from mooncaked.cache.hashing import block_hashes, layer_hashes
from mooncaked.cluster.costs import StepCost, equal_time_chunks, pipeline_prefill_s
from mooncaked.config import Config, ConfigError, PipelineConfig, config_from_dict
from mooncaked.config.data import TransferConfig
from mooncaked.config.errors import ConfigValueError
from mooncaked.engine.pipeline import ChunkRefused, StageError, StagePipe, row_runs
from mooncaked.engine.plan import ScheduledChunk, StepPlan
from mooncaked.handoff import ActGrant, LayerSpan, PrefillTarget, StageJob, StageRef, split_layers
from mooncaked.request import SamplingParams
from mooncaked.transfer import Access, TransferEngine
from mooncaked.transfer.access import GrantTable
from mooncaked.wire.handoff import decode_stages, decode_target, encode_target
from mooncaked.wire.kv_io import TransferKVWriter, TransferWriteGrants
from mooncaked.wire.pipeline import ChunkBody, StageOpen, decode_opened, encode_opened
from mooncaked.wire.prefill import PrefillBody
from tests.conftest import ManualClock
from tests.unit.test_kv_sender import grant as kv_grant

SECRET = b"pipeline-unit-tests-secret"


def test_layers_split_evenly_or_where_asked() -> None:
    spans = split_layers(30, 2)
    assert [(s.lo, s.hi) for s in spans] == [(0, 15), (15, 30)]
    assert [(s.lo, s.hi) for s in split_layers(4, 3)] == [(0, 2), (2, 3), (3, 4)]
    assert [(s.lo, s.hi) for s in split_layers(30, 3, (8, 20))] == [(0, 8), (8, 20), (20, 30)]
    assert spans[0].first and not spans[0].last and spans[1].last and not spans[1].whole
    assert LayerSpan(0, 4, 4).whole
    for args, match in (
        ((4, 5, ()), "non-empty"),
        ((4, 2, (4,)), "non-empty"),
        ((4, 3, (2,)), "names 1 boundaries"),
        ((4, 2, (0,)), "non-empty"),
    ):
        with pytest.raises(ValueError, match=match):
            split_layers(*args)


def test_activation_rows_follow_the_grant_blocks() -> None:
    g = ActGrant("s1", "http://s1", "r@stage1", "h:1", "act.in", 8, 4, (7, 2), start=16)
    assert g.end == 24
    # Position 16 is row 0 of block 7; 20 is row 0 of block 2.
    assert g.rows(16, 22) == [28, 29, 30, 31, 8, 9]
    with pytest.raises(ValueError, match="outside"):
        g.rows(15, 18)
    with pytest.raises(ValueError, match="outside"):
        g.rows(20, 25)
    assert row_runs([28, 29, 30, 31, 8, 9], [0, 1, 2, 3, 4, 5]) == [(28, 0, 4), (8, 4, 2)]
    assert row_runs([0, 1, 2], [5, 6, 9]) == [(0, 5, 2), (2, 9, 1)]


def test_a_stage_job_knows_its_place_and_its_chunks() -> None:
    act = ActGrant("s1", "u", "r", "h:1", "act.in", 8, 4, (0,), start=0)
    job = StageJob(0, 2, 32, (64, 48, 16), act_out=act)
    assert job.first and not job.last
    assert [job.chunk_end(p) for p in (32, 95, 96, 143, 144, 159, 160)] == [
        96, 96, 144, 144, 160, 160, None,
    ]  # fmt: skip
    assert StageJob(1, 2, 0, act_in=act).chunk_end(0) is None
    for bad, match in (
        (dict(index=1, num_stages=2), "takes its input"),
        (dict(index=0, num_stages=2), "sends its output"),
        (dict(index=2, num_stages=2), "does not exist"),
    ):
        with pytest.raises(ValueError, match=match):
            StageJob(bad["index"], bad["num_stages"], 0)
    # A probe times the stage alone: its output goes nowhere.
    assert StageJob(0, 3, 0, probe=True).first


def test_a_stage_caches_under_keys_of_its_own_layers() -> None:
    hashes = block_hashes(list(range(64)), 16, "m")
    first, second = layer_hashes(hashes, 0, 15), layer_hashes(hashes, 15, 30)
    assert len(first) == 4 and len(set(first) | set(second) | set(hashes)) == 12
    # Derived, so anyone holding the prompt's hashes finds a stage's run.
    assert layer_hashes(hashes[:2], 0, 15) == first[:2]


def test_chunks_level_in_time_as_the_context_grows() -> None:
    step = StepCost(0.005, 1e-3, 2e-7)
    chunks = equal_time_chunks(step, 6000, 0, 512, align=16)
    assert sum(chunks) == 6000 and chunks[0] == 512
    assert all(a >= b for a, b in itertools.pairwise(chunks[:-1]))
    assert all(c % 16 == 0 and c >= 128 for c in chunks[:-1])
    first = step.prefill_s(512, 0)
    times = []
    pos = 0
    for k in chunks[:-1]:
        times.append(step.prefill_s(k, pos))
        pos += k
    # Each within a block's worth of the first, never more (floors round down).
    assert all(t <= first * 1.0001 for t in times) and min(times) > 0.9 * first
    # No attention term: equal chunks. A cached prefix makes them shorter.
    assert equal_time_chunks(StepCost(0.0, 1e-3), 1000, 0, 256) == [256, 256, 256, 232]
    later = equal_time_chunks(step, 1024, 4096, 512, align=16)
    assert later[0] == 512 and later[1] < 512
    assert equal_time_chunks(step, 0, 0, 512) == []
    assert equal_time_chunks(step, 100, 0, 0) == [100]


def test_the_pipeline_fills_runs_at_its_slowest_stage_and_drains() -> None:
    # One second a chunk on each stage, no attention: 3 chunks through 2 stages.
    unit = StepCost(0.0, 1.0 / 100)
    chunks = [100, 100, 100]
    assert pipeline_prefill_s([unit, unit], chunks, 0) == pytest.approx(4.0)
    # A hop between the stages delays each chunk's start on the second.
    assert pipeline_prefill_s([unit, unit], chunks, 0, hop_s=[0.5] * 3) == pytest.approx(4.5)
    # A slower second stage sets the pace: 1 + 3 x 2.
    slow = StepCost(0.0, 2.0 / 100)
    assert pipeline_prefill_s([unit, slow], chunks, 0) == pytest.approx(7.0)
    # Queues: the second stage is busy for 5 s first.
    assert pipeline_prefill_s([unit, unit], chunks, 0, queue_s=[0.0, 5.0]) == pytest.approx(8.0)
    # One stage alone is the plain prefill of those chunks.
    step = StepCost(0.01, 1e-3, 2e-7)
    assert pipeline_prefill_s([step], [512, 512], 64) == pytest.approx(
        step.prefill_s(1024, 64, chunk_tokens=512)
    )


def test_the_pipeline_config_is_checked() -> None:
    assert not PipelineConfig().enabled
    cfg = config_from_dict(
        {"node": {"role": "prefill"}, "pipeline": {"group": "g", "stage": 1, "num_stages": 3}}
    )
    assert cfg.pipeline.enabled and cfg.pipeline.stage == 1
    for section, match in (
        ({"group": "g", "stage": 2}, "'pipeline.stage' must be in 0..1"),
        ({"group": "g", "num_stages": 1}, "num_stages' must be in 2..16"),
        ({"group": "g", "split": [3]}, None),
        ({"group": "g", "num_stages": 3, "split": [3]}, "must name 2 layer indices"),
        ({"group": "g", "num_stages": 3, "split": [3, 3]}, "ascending"),
        ({"group": "g", "activation_bytes": 10}, "activation_bytes"),
    ):
        doc = {"node": {"role": "prefill"}, "pipeline": section}
        if match is None:
            config_from_dict(doc)
            continue
        with pytest.raises(ConfigError, match=match):
            config_from_dict(doc)
    with pytest.raises(ConfigError, match=r"needs node\.role = 'prefill'"):
        config_from_dict({"pipeline": {"group": "g"}})
    with pytest.raises(ConfigValueError):
        PipelineConfig(group="g", stage=5)
    assert Config().pipeline == PipelineConfig()


def test_a_grant_may_open_only_some_planes() -> None:
    table = GrantTable(clock=ManualClock())
    g = table.grant(
        "kv", "s1", block_bytes=8, blocks_per_plane=4, block_ids=[1, 2], ttl_s=5, planes=(2, 4)
    )
    plane = 4 * 8  # one plane: 4 blocks of 8 bytes
    assert table.allows("kv", "s1", 2 * plane + 8, 16)  # plane 2, blocks 1-2
    assert table.allows("kv", "s1", 3 * plane + 8, 8)
    assert not table.allows("kv", "s1", 1 * plane + 8, 8)  # plane 1: another stage's
    assert not table.allows("kv", "s1", 4 * plane + 8, 8)
    assert not table.allows("kv", "s1", 2 * plane, 8)  # block 0: not granted
    assert g.planes == (2, 4)
    with pytest.raises(ValueError, match="planes"):
        table.grant("kv", "s1", block_bytes=8, blocks_per_plane=4, block_ids=[1], ttl_s=5,
                    planes=(3, 3))  # fmt: skip


STAGES = (StageRef("s0", "http://a", 0, 2), StageRef("s1", "http://b", 2, 4))


def test_stages_and_their_calls_travel_and_are_checked() -> None:
    target = PrefillTarget("s0", "http://a", stages=STAGES)
    assert decode_target(encode_target(target)) == target
    with pytest.raises(ValueError, match="the target's own id"):
        decode_target({**encode_target(target), "node_id": "s9"})
    with pytest.raises(ValueError, match=r"'stages\[1\]\[2\]' must be an integer in 2\.\.2"):
        decode_stages([["s0", "u", 0, 2], ["s1", "u", 3, 4]])
    with pytest.raises(ValueError, match=r"2\.\.16 stages"):
        decode_stages([["s0", "u", 0, 2]])
    with pytest.raises(ValueError, match="a pipelined prefill target is its head"):
        PrefillTarget("s1", "http://b", stages=STAGES)
    g = kv_grant("d1", (1, 2))
    body = PrefillBody("r", [1, 2, 3], SamplingParams(max_tokens=4), g, True, stages=STAGES)
    import orjson

    assert PrefillBody.decode(orjson.loads(body.encode())) == body
    call = StageOpen("r", [1, 2, 3], SamplingParams(), g, STAGES, 1, 32)
    back = StageOpen.decode(orjson.loads(call.encode()))
    assert back == call and back.upstream == STAGES[0] and back.me == STAGES[1]
    with pytest.raises(ValueError, match=r"'index' must be an integer in 1\.\.1"):
        StageOpen.decode({**orjson.loads(call.encode()), "index": 0})
    act = ActGrant("s1", "http://b", "r@stage1", "h:1", "act.in", 1152, 16, (3, 4), 32)
    assert decode_opened(encode_opened(32, act)) == (32, act)
    chunk = ChunkBody("r@stage1", 2, 64, 96)
    assert ChunkBody.decode(orjson.loads(chunk.encode())) == chunk
    with pytest.raises(ValueError, match="'end' must be an integer in 65"):
        ChunkBody.decode({"request_id": "r", "seq": 0, "start": 64, "end": 64})


HIDDEN = 8
ROWS = 64
BR = 4


@pytest.fixture
async def engines() -> AsyncIterator[tuple[TransferEngine, TransferEngine]]:
    tcp = TransferConfig(transports=("tcp",))
    async with (
        TransferEngine(tcp, "s0", SECRET) as s0,
        TransferEngine(tcp, "s1", SECRET) as s1,
    ):
        yield s0, s1


def _rows(engine: TransferEngine, name: str, access: Access) -> torch.Tensor:
    seg = engine.allocate(name, ROWS * HIDDEN * 4, access)
    return (
        torch.frombuffer(seg.view.cast("B"), dtype=torch.uint8)
        .view(torch.float32)
        .view(ROWS, HIDDEN)
    )


def pipes(
    s0: TransferEngine, s1: TransferEngine, clock: ManualClock | None = None
) -> tuple[StagePipe, StagePipe, list[tuple[int, int, int]]]:
    """The head of a 2-stage group on ``s0`` and its second stage on ``s1``;
    the head's notices reach the second stage's ``arrived`` directly (the
    chunk call's handler does no more), and are listed."""
    notices: list[tuple[int, int, int]] = []
    tail = StagePipe(
        node_id="s1",
        span=LayerSpan(2, 4, 4),
        hidden_size=HIDDEN,
        dtype=torch.float32,
        block_rows=BR,
        act_in=_rows(s1, "act.in", Access.GRANTED),
        act_out=None,
        transfer_address=s1.address,
        grants=TransferWriteGrants(s1),
        clock=clock or ManualClock(),
    )

    async def notice(grant: ActGrant, seq: int, start: int, end: int) -> None:
        notices.append((seq, start, end))
        try:
            tail.arrived(grant.request_id, seq, start, end)
        except ChunkRefused as exc:
            raise StageError(str(exc)) from None

    head = StagePipe(
        node_id="s0",
        span=LayerSpan(0, 2, 4),
        hidden_size=HIDDEN,
        dtype=torch.float32,
        block_rows=BR,
        act_in=None,
        act_out=_rows(s0, "act.out", Access.READ),
        transfer_address=s0.address,
        writer=TransferKVWriter(s0),
        notice=notice,
    )
    return head, tail, notices


def plan_of(rid: str, spans: list[tuple[int, int]]) -> StepPlan:
    return StepPlan(
        [ScheduledChunk(rid, [0] * (b - a), a, [], False, act_rows=None) for a, b in spans]
    )


async def test_a_stage_output_lands_in_the_next_stage_rows_in_order(
    engines: tuple[TransferEngine, TransferEngine],
) -> None:
    s0, s1 = engines
    head, tail, notices = pipes(s0, s1)
    grant = tail.reserve("r@stage1", 8, 30, upstream="s0", url="http://b", ttl_s=30)
    assert grant is not None and grant.start == 8 and len(grant.block_ids) == 6
    head.open_output("r@stage0", grant, 30, 5.0)
    hidden = torch.arange(22 * HIDDEN, dtype=torch.float32).view(22, HIDDEN)
    # Two steps: positions 8..20 then 20..30, as the head's chunks.
    head.after_step(plan_of("r@stage0", [(8, 20)]), hidden[:12])
    head.after_step(plan_of("r@stage0", [(20, 30)]), hidden[12:])
    assert await asyncio.wait_for(head.sent("r@stage0"), 10) == 22 * HIDDEN * 4
    assert notices == [(0, 8, 20), (1, 20, 30)]
    assert tail.act_in is not None
    got = tail.act_in.index_select(0, torch.tensor(grant.rows(8, 30)))
    assert torch.equal(got, hidden)
    # The frontier is where the last chunk ended; anything else is refused.
    for seq, start, end, match in (
        (1, 20, 30, "out of order or sent twice"),
        (2, 28, 30, "out of order or sent twice"),
        (2, 30, 31, "outside the prompt"),
    ):
        with pytest.raises(ChunkRefused, match=match):
            tail.arrived("r@stage1", seq, start, end)
    with pytest.raises(ChunkRefused, match="runs no request"):
        tail.arrived("other", 0, 0, 4)
    assert tail.stats.chunks_received == 2 and tail.stats.chunks_refused == 4
    assert s1.num_grants == 1
    head.close_output("r@stage0")
    tail.release("r@stage1")
    assert s1.num_grants == 0
    tail.check_integrity()
    assert tail.status()["input_blocks_free"] == ROWS // BR
    await head.close()
    await tail.close()


async def test_rows_a_writer_may_still_write_stay_held_until_its_grant_ends(
    engines: tuple[TransferEngine, TransferEngine],
) -> None:
    s0, s1 = engines
    clock = ManualClock()
    _head, tail, _ = pipes(s0, s1, clock)
    total = ROWS // BR
    grant = tail.reserve("r", 0, 40, upstream="s0", url="u", ttl_s=10)
    assert grant is not None
    tail.arrived("r", 0, 0, 16)
    # Ended early (its input not all in): the rows wait out the grant.
    tail.release("r")
    tail.check_integrity()
    assert tail.status()["input_blocks_held"] == 10
    assert tail.reserve("big", 0, (total - 9) * BR, upstream="s0", url="u", ttl_s=1) is None
    clock.now += 10.0
    assert tail.reserve("big", 0, total * BR, upstream="s0", url="u", ttl_s=1) is not None
    assert tail.stats.reserve_refused == 1
    tail.arrived("big", 0, 0, total * BR)
    tail.release("big")
    # All its input in: freed at once.
    grant = tail.reserve("r2", 0, 8, upstream="s0", url="u", ttl_s=10)
    tail.arrived("r2", 0, 0, 8)
    tail.release("r2")
    assert tail.status()["input_blocks_held"] == 0 and tail.status()["input_blocks_free"] == total
    await tail.close()


async def test_an_output_the_next_stage_refuses_fails_the_request(
    engines: tuple[TransferEngine, TransferEngine],
) -> None:
    s0, s1 = engines
    head, tail, _ = pipes(s0, s1)
    grant = tail.reserve("r@stage1", 0, 16, upstream="s0", url="u", ttl_s=30)
    assert grant is not None
    head.open_output("r@stage0", grant, 16, 5.0)
    # The next stage forgot the request (it was aborted there).
    tail.release("r@stage1")
    head.after_step(plan_of("r@stage0", [(0, 16)]), torch.zeros(16, HIDDEN))
    with pytest.raises(StageError):
        await asyncio.wait_for(head.sent("r@stage0"), 10)
    assert head.stats.send_failures == 1
    await head.close()
    await tail.close()


def test_the_reference_stage_config_loads() -> None:
    from pathlib import Path

    from mooncaked.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "config" / "prefill-stage.toml")
    assert cfg.node.role == "prefill" and cfg.pipeline.enabled
    assert (cfg.pipeline.group, cfg.pipeline.stage, cfg.pipeline.num_stages) == ("cpp-0", 0, 2)
    assert cfg.transfer.host != "127.0.0.1" and cfg.cluster.gossip_host == cfg.transfer.host
