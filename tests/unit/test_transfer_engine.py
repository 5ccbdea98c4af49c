"""TransferEngine in one process: two engines on loopback, local copies, the
caller's mistakes, cancel, unregister, tensors, descriptors, counters."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
import torch

from mooncaked.config import TransferConfig
from mooncaked.transfer import (
    Access,
    OpStatus,
    SegmentDescriptor,
    SegmentError,
    TransferEngine,
    TransferOp,
)
from tests.conftest import wait_until

SECRET = b"engine-unit-secret"
MiB = 1 << 20


@pytest.fixture
async def pair() -> AsyncIterator[tuple[TransferEngine, TransferEngine]]:
    a = TransferEngine(TransferConfig(transports=("tcp",), slice_bytes=64 * 1024), "a", SECRET)
    b = TransferEngine(TransferConfig(), "b", SECRET)
    await a.start()
    await b.start()
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def test_ops_to_this_node_are_local_copies() -> None:
    async with TransferEngine(TransferConfig(), "solo", SECRET) as engine:
        src = engine.register("src", bytearray(np.arange(4096, dtype=np.uint8) % 251))
        dst = engine.allocate("dst", 4096)
        batch = await engine.submit(
            [
                TransferOp.write("src", 0, "solo", "dst", 100, 1000),
                TransferOp.read("src", 2000, "solo", "dst", 100, 500),
                TransferOp.read("src", 0, "solo", "dst", 4000, 200),  # past the end
            ]
        )
        assert not await batch.wait()
        assert batch.statuses[:2] == [OpStatus.DONE, OpStatus.DONE]
        assert batch.transport(0) == "local"
        assert bytes(dst.view[100:1100]) == bytes(src.view[0:1000])
        assert bytes(src.view[2000:2500]) == bytes(dst.view[100:600])
        assert "outside segment 'dst' of 4096 bytes" in (batch.reason(2) or "")


async def test_caller_mistakes_about_local_memory_raise(
    pair: tuple[TransferEngine, TransferEngine],
) -> None:
    a, b = pair
    a.register("buf", bytearray(1000))
    a.add_peer("b", b.address)
    with pytest.raises(SegmentError, match="local segment 'nope' is not registered"):
        await a.submit([TransferOp.read("nope", 0, "b", "x", 0, 10)])
    with pytest.raises(SegmentError, match=r"op 1: range \[995, 1005\) is outside segment 'buf'"):
        await a.submit(
            [
                TransferOp.read("buf", 0, "b", "x", 0, 10),
                TransferOp.read("buf", 995, "b", "x", 0, 10),
            ]
        )
    with pytest.raises(ValueError, match="negative remote offset"):
        await a.submit([TransferOp.read("buf", 0, "b", "x", -1, 10)])
    with pytest.raises(TypeError, match="not a TransferOp"):
        await a.submit([("read", "buf")])  # type: ignore[list-item]


async def test_unknown_peer_fails_the_op_with_what_to_do(
    pair: tuple[TransferEngine, TransferEngine],
) -> None:
    a, _ = pair
    a.register("buf", bytearray(100))
    batch = await a.submit(
        [
            TransferOp.read("buf", 0, "ghost", "x", 0, 10),
            TransferOp.read("buf", 0, "a", "buf", 50, 10),
        ]
    )
    assert not await batch.wait()
    assert batch.statuses == [OpStatus.FAILED, OpStatus.DONE]
    assert "no address known for node 'ghost'" in (batch.reason(0) or "")


async def test_tensors_move_between_engines(pair: tuple[TransferEngine, TransferEngine]) -> None:
    a, b = pair
    # Per layer K and V of a paged KV cache: one block spans many byte ranges.
    layers, blocks, block_elems = 4, 8, 256
    src = [torch.randn(blocks, block_elems, dtype=torch.bfloat16) for _ in range(2 * layers)]
    dst = [torch.zeros_like(t) for t in src]
    for i, t in enumerate(src):
        a.register(f"kv.{i}", t)
    for i, t in enumerate(dst):
        b.register(f"kv.{i}", t, access=Access.READ_WRITE)
    a.add_descriptor(SegmentDescriptor.from_bytes(b.descriptor("kv.0").to_bytes()))
    block_bytes = block_elems * 2
    ops = [
        TransferOp.write(
            f"kv.{i}",
            blk * block_bytes,
            "b",
            f"kv.{i}",
            (blocks - 1 - blk) * block_bytes,
            block_bytes,
        )
        for i in range(2 * layers)
        for blk in (1, 2, 5)
    ]
    batch = await a.submit(ops)
    assert await batch.wait(), batch.failures()
    for s, d in zip(src, dst, strict=True):
        for blk in (1, 2, 5):
            assert torch.equal(d[blocks - 1 - blk], s[blk])
        assert not d[0].any()


async def test_big_op_is_sliced_and_striped(pair: tuple[TransferEngine, TransferEngine]) -> None:
    a, b = pair  # a slices at 64 KiB
    remote = b.allocate("pool", 4 * MiB, access=Access.READ_WRITE)
    remote.view[:] = np.random.default_rng(1).integers(0, 256, 4 * MiB, dtype=np.uint8).tobytes()
    local = a.allocate("buf", 4 * MiB)
    a.add_peer("b", b.address)
    batch = await a.submit([TransferOp.read("buf", 0, "b", "pool", 0, 4 * MiB)])
    assert await batch.wait(), batch.failures()
    assert bytes(local.view) == bytes(remote.view)
    # 4 MiB / 64 KiB slices; the serving thread counts a frame after sending it,
    # so the count may trail the reader by a moment.
    await wait_until(lambda: b.metrics().served_ops >= 64, "the served ops to be counted", 10)
    assert b.metrics().served_ops == 64
    m = a.metrics()
    assert m.bytes_read == 4 * MiB and m.ops_done == 1 and m.bytes_by_transport == {"tcp": 4 * MiB}


async def test_cancel_settles_and_frees_the_segment(
    pair: tuple[TransferEngine, TransferEngine],
) -> None:
    a, b = pair
    b.allocate("pool", 8 * MiB, access=Access.READ_WRITE)
    a.allocate("buf", 8 * MiB)
    a.add_peer("b", b.address)
    ops = [
        TransferOp.read("buf", i * 64 * 1024, "b", "pool", i * 64 * 1024, 64 * 1024)
        for i in range(128)
    ]
    batch = await a.submit(ops)
    with pytest.raises(SegmentError, match="in flight"):
        a.unregister("buf")
    batch.cancel()
    assert not await batch.wait()
    statuses = batch.statuses
    assert OpStatus.PENDING not in statuses
    assert all(
        batch.reason(i) == "cancelled" for i, s in enumerate(statuses) if s is OpStatus.FAILED
    )
    a.unregister("buf")  # no longer busy
    assert a.segment("buf") is None


async def test_descriptor_lists_the_transports_that_reach_a_segment() -> None:
    async with TransferEngine(TransferConfig(), "n", SECRET) as engine:
        engine.allocate("shared", 4096)
        engine.register("plain", bytearray(4096))
        shared, plain = engine.descriptor("shared"), engine.descriptor("plain")
        assert shared.transports == ("shm", "tcp") and plain.transports == ("tcp",)
        assert shared.address == engine.address and shared.node_id == "n"
        assert shared.length == 4096 and shared.location == "cpu"
        with pytest.raises(SegmentError, match="not registered"):
            engine.descriptor("nope")
    async with TransferEngine(TransferConfig(transports=("tcp",)), "m", SECRET) as engine:
        engine.allocate("shared", 4096)
        assert engine.descriptor("shared").transports == ("tcp",)


async def test_peers_in_one_process_use_shared_memory(
    pair: tuple[TransferEngine, TransferEngine],
) -> None:
    _, b = pair
    # a is tcp-only; an engine with shm reaches b's shared segment over shm.
    async with TransferEngine(TransferConfig(), "c", SECRET) as c:
        remote = b.allocate("pool", MiB, access=Access.READ_WRITE)
        remote.view[:10] = b"0123456789"
        local = c.allocate("buf", MiB)
        c.add_peer("b", b.address)
        batch = await c.submit([TransferOp.read("buf", 0, "b", "pool", 0, MiB)])
        assert await batch.wait(), batch.failures()
        assert batch.transport(0) == "shm"
        assert bytes(local.view[:10]) == b"0123456789"


async def test_closed_engine_refuses_work() -> None:
    engine = TransferEngine(TransferConfig(), "x", SECRET)
    with pytest.raises(RuntimeError, match="not running"):
        await engine.submit([])
    await engine.start()
    await engine.close()
    with pytest.raises(RuntimeError, match="not running"):
        await engine.submit([])
    with pytest.raises(ValueError, match="at least 8 bytes"):
        TransferEngine(TransferConfig(), "x", b"short")


async def test_zero_length_ops_are_done_without_moving_bytes(
    pair: tuple[TransferEngine, TransferEngine],
) -> None:
    a, _ = pair
    a.register("buf", bytearray(10))
    batch = await asyncio.wait_for(a.submit([TransferOp.read("buf", 10, "b", "x", 0, 0)]), 5)
    assert await batch.wait()


async def test_segments_registered_before_start_are_served_over_shm() -> None:
    early = TransferEngine(TransferConfig(), "early", SECRET)
    seg = early.allocate("pool", 4096, access=Access.READ_WRITE)
    seg.view[:4] = b"ping"
    await early.start()
    try:
        assert early.descriptor("pool").transports == ("shm", "tcp")
        async with TransferEngine(TransferConfig(), "reader", SECRET) as reader:
            local = reader.allocate("buf", 4096)
            reader.add_peer("early", early.address)
            batch = await reader.submit([TransferOp.read("buf", 0, "early", "pool", 0, 4096)])
            assert await batch.wait(), batch.failures()
            assert batch.transport(0) == "shm"
            assert bytes(local.view[:4]) == b"ping"
            assert reader.metrics().queued_slices == 0
    finally:
        await early.close()
