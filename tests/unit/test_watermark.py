"""Eviction by watermark: a background task evicts down to the low mark once
DRAM usage passes the high one, skipping leased and pinned blocks (soft-pinned
ones last), with exact block ids."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from mooncaked.cache.dram import DramPool
from mooncaked.cache.layout import BlockLayout
from mooncaked.cache.pins import FOREVER, PinKind, PinTable
from mooncaked.cache.store import DeviceBlocks, TieredStore
from mooncaked.cache.watermark import WatermarkEvictor
from mooncaked.config import ConfigValueError, StoreConfig
from tests.conftest import wait_until

LAYOUT = BlockLayout(num_layers=1, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float16)


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fill(pool: DramPool, evictor: WatermarkEvictor, block_hash: bytes) -> None:
    slot = pool.allocate(block_hash)
    assert slot is not None
    pool.commit(slot)
    evictor.notice()  # what the store does on every commit


@pytest.fixture
async def pool_and_pins() -> AsyncIterator[tuple[DramPool, PinTable, WatermarkEvictor]]:
    pins = PinTable(budget=10, budget_ratio=1.0)
    # 10 slots: a run starts past 8 used and evicts down to 5.
    pool = DramPool(LAYOUT, 10, pin_memory=False, pin_of=pins.kind_of)
    evictor = WatermarkEvictor(pool, high=0.8, low=0.5)
    task = asyncio.create_task(evictor.serve())
    yield pool, pins, evictor
    evictor.stop()
    await task


def pin(pool: DramPool, pins: PinTable, i: int, kind: PinKind) -> None:
    pins.pin([h(i)], kind, FOREVER if kind is PinKind.HARD else 1e12)
    pool.requeue(h(i))


async def test_background_eviction_skips_leased_and_pinned_blocks(pool_and_pins) -> None:
    pool, pins, evictor = pool_and_pins
    for i in range(8):
        fill(pool, evictor, h(i))
    lease = pool.lease([h(0), h(1)], "reader")
    assert lease is not None
    pin(pool, pins, 2, PinKind.HARD)
    pin(pool, pins, 3, PinKind.SOFT)
    await asyncio.sleep(0)
    assert evictor.stats.runs == 0 and pool.num_cached == 8  # at the mark, not past it
    fill(pool, evictor, h(8))  # 9 used: past the high mark
    await wait_until(lambda: evictor.stats.runs == 1, "a watermark run")
    # Down to 5: the least recently used unpinned, unleased blocks went.
    assert sorted(pool.cached_hashes()) == sorted([h(0), h(1), h(2), h(3), h(8)])
    assert evictor.stats.evictions == 4 and pool.num_evictions == 4
    pool.check_integrity()
    assert pool.release(lease)


async def test_soft_pinned_blocks_go_last_and_hard_ones_never(pool_and_pins) -> None:
    pool, pins, evictor = pool_and_pins
    for i in range(8):
        fill(pool, evictor, h(i))
    for i in range(6):
        pin(pool, pins, i, PinKind.HARD if i < 3 else PinKind.SOFT)
    fill(pool, evictor, h(8))
    await wait_until(lambda: evictor.stats.runs == 1, "a watermark run")
    # The unpinned 6, 7, 8 go first; one more (the least recent soft pin,
    # block 3) reaches the low mark of 5; the hard pins stay.
    assert pool.cached_hashes() == [h(4), h(5), h(0), h(1), h(2)]
    assert evictor.stats.evictions == 4 and evictor.stats.short_runs == 0
    pool.check_integrity()


async def test_a_run_that_finds_only_hard_pins_ends_short(pool_and_pins) -> None:
    pool, pins, evictor = pool_and_pins
    for i in range(9):
        pool.commit(pool.allocate(h(i)) or 0)
        pin(pool, pins, i, PinKind.HARD)
    evictor.notice()
    await wait_until(lambda: evictor.stats.runs == 1, "a watermark run")
    await asyncio.sleep(0)
    assert pool.num_cached == 9 and evictor.stats.short_runs == 1


def test_watermarks_are_checked() -> None:
    pool = DramPool(LAYOUT, 4, pin_memory=False)
    with pytest.raises(ValueError, match="0 < low < high <= 1"):
        WatermarkEvictor(pool, high=0.5, low=0.5)
    with pytest.raises(ConfigValueError, match="low_watermark"):
        StoreConfig(high_watermark=0.7, low_watermark=0.8)
    with pytest.raises(ConfigValueError, match="high_watermark"):
        StoreConfig(high_watermark=1.5)
    assert not WatermarkEvictor(pool, high=1.0, low=0.5).enabled


async def test_the_store_evicts_by_watermark_as_blocks_arrive(tmp_path: Path) -> None:
    cfg = StoreConfig(dram_bytes=10 * LAYOUT.block_bytes, high_watermark=0.8, low_watermark=0.5)
    store = TieredStore(LAYOUT, cfg, pin_memory=False)
    await store.start()
    try:
        shape = (12, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        kv = [(torch.zeros(shape, dtype=LAYOUT.dtype), torch.zeros(shape, dtype=LAYOUT.dtype))]
        for i in range(9):
            fut = store.offload([h(i)], DeviceBlocks(kv, [i]))
            assert fut is not None
            await fut
        await wait_until(lambda: store.stats().watermark_runs == 1, "a watermark run")
        stats = store.stats()
        assert stats.watermark_evictions == 4 and stats.dram.evictions == 4
        assert store.dram.cached_hashes() == [h(i) for i in range(4, 9)]
        store.check_integrity()
    finally:
        await store.close()
