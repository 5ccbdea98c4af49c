from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch

from mooncaked.cache.dram import physical_memory_bytes
from mooncaked.cache.hashing import block_hashes
from mooncaked.cache.ssd import SLAB_NAME
from mooncaked.cache.store import (
    BlockLayout,
    DeviceBlocks,
    StoreHit,
    Tier,
    TieredStore,
)
from mooncaked.config import ConfigValueError, StoreConfig

LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
BB = LAYOUT.block_bytes
HASHES = block_hashes(list(range(4 * 12)), 4, "test-model")

D, S = Tier.DRAM, Tier.SSD


def make_kv(num_blocks: int = 16, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [
        (
            torch.randn(shape, generator=g).to(LAYOUT.dtype),
            torch.randn(shape, generator=g).to(LAYOUT.dtype),
        )
        for _ in range(LAYOUT.num_layers)
    ]


def zeros_like(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, ...]]:
    return [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in kv]


def same_blocks(kv_a, ids_a: list[int], kv_b, ids_b: list[int]) -> bool:
    return all(
        torch.equal(ka[ids_a], kb[ids_b]) and torch.equal(va[ids_a], vb[ids_b])
        for (ka, va), (kb, vb) in zip(kv_a, kv_b, strict=True)
    )


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.fixture
async def make_store(tmp_path: Path) -> AsyncIterator[Callable[..., object]]:
    opened: list[TieredStore] = []

    async def factory(*, ssd: bool = True, on_block_event=None, **kw) -> TieredStore:
        kw.setdefault("dram_bytes", 8 * BB)
        kw.setdefault("ssd_bytes", 64 * 8192)
        kw.setdefault("ssd_io_threads", 2)
        # Eviction on allocation only: these tests fill the pool on purpose
        # (tests/unit/test_watermark.py has the background eviction's).
        kw.setdefault("high_watermark", 1.0)
        cfg = StoreConfig(ssd_path=str(tmp_path / "ssd") if ssd else "", **kw)
        store = TieredStore(LAYOUT, cfg, pin_memory=False, on_block_event=on_block_event)
        await store.start()
        opened.append(store)
        return store

    yield factory
    for store in opened:
        await store.close()


async def offload(store: TieredStore, hashes, kv, ids: list[int]) -> int:
    fut = store.offload(hashes, DeviceBlocks(kv, ids))
    assert fut is not None
    return await fut


async def test_second_serving_hits_dram_with_identical_blocks(make_store) -> None:
    store = await make_store(ssd=False)
    kv = make_kv()
    src_ids = [3, 7, 1, 0, 9, 4]
    assert await offload(store, HASHES[:6], kv, src_ids) == 6
    assert store.lookup(HASHES[:8]) == StoreHit((D,) * 6)

    fresh = zeros_like(kv)  # the device pool was cleared in between
    dst_ids = [10, 11, 12, 13, 14, 15]
    assert await store.load(HASHES[:8], DeviceBlocks(fresh, [*dst_ids, 0, 1])) == 6
    assert same_blocks(kv, src_ids, fresh, dst_ids)
    assert not fresh[0][0][[0, 1]].any()  # blocks past the prefix untouched

    stats = store.stats()
    assert (stats.dram.hits, stats.dram.misses) == (6, 2)
    assert stats.dram.bytes_read == 6 * BB and stats.dram.bytes_written == 6 * BB
    assert (stats.loads, stats.blocks_loaded, stats.offloads) == (1, 6, 1)
    store.check_integrity()


async def test_offload_of_cached_blocks_only_touches_them(make_store) -> None:
    store = await make_store(ssd=False)
    kv = make_kv()
    assert await offload(store, HASHES[:3], kv, [0, 1, 2]) == 3
    fut = store.offload(HASHES[:3], DeviceBlocks(kv, [0, 1, 2]))
    assert fut is not None and fut.done() and fut.result() == 0
    assert await offload(store, HASHES[:4], kv, [0, 1, 2, 3]) == 1
    assert store.stats().dram.blocks_stored == 4


async def test_lookup_reports_tiers_and_counts_hits_and_misses(make_store) -> None:
    store = await make_store(ssd_write_through=False)
    kv = make_kv()
    await offload(store, HASHES[:2], kv, [0, 1])
    await offload(store, HASHES[4:5], kv, [4])
    assert store.ssd is not None
    staged = torch.zeros(BB, dtype=torch.uint8)
    assert await store.ssd.put(HASHES[2], staged)

    assert store.lookup(HASHES[:5]) == StoreHit((D, D, S))
    assert store.lookup(HASHES[5:7]) == StoreHit()
    assert store.lookup(HASHES[:5], record_stats=False).num_in(S) == 1
    stats = store.stats()
    # DRAM: 2 found of 5 asked, then 0 of 2. SSD: asked for 3 (not in DRAM), 1 found; then 2.
    assert (stats.dram.hits, stats.dram.misses) == (2, 5)
    assert (stats.ssd.hits, stats.ssd.misses) == (1, 4)
    assert stats.dram.hit_ratio == pytest.approx(2 / 7)


async def test_dram_evictions_demote_to_ssd_and_load_back(make_store) -> None:
    store = await make_store(dram_bytes=2 * BB, ssd_write_through=False)
    kv = make_kv()
    for i in range(4):
        assert await offload(store, HASHES[i : i + 1], kv, [i]) == 1
    await store.flush()
    stats = store.stats()
    assert (stats.dram.evictions, stats.ssd_demotions, stats.ssd.blocks_stored) == (2, 2, 2)
    assert store.lookup(HASHES[:5]) == StoreHit((S, S, D, D))

    fresh = zeros_like(kv)
    assert await store.load(HASHES[:4], DeviceBlocks(fresh, [8, 9, 10, 11])) == 4
    assert same_blocks(kv, [0, 1, 2, 3], fresh, [8, 9, 10, 11])
    stats = store.stats()
    assert stats.ssd.bytes_read == 2 * BB and stats.dram.bytes_read == 2 * BB
    # Both DRAM slots were leased by this very load: the SSD blocks went
    # through staging buffers instead of being promoted.
    assert store.lookup(HASHES[:4], record_stats=False) == StoreHit((S, S, D, D))
    store.check_integrity()


async def test_restart_on_the_same_ssd_path_serves_hits_from_ssd(make_store) -> None:
    store = await make_store()
    kv = make_kv()
    assert await offload(store, HASHES[:5], kv, [5, 6, 7, 8, 9]) == 5
    await store.flush()
    await store.close()

    store = await make_store()
    assert store.lookup(HASHES[:6]) == StoreHit((S,) * 5)
    fresh = zeros_like(kv)
    assert await store.load(HASHES[:6], DeviceBlocks(fresh, [0, 1, 2, 3, 4, 15])) == 5
    assert same_blocks(kv, [5, 6, 7, 8, 9], fresh, [0, 1, 2, 3, 4])
    assert store.stats().ssd.bytes_read == 5 * BB
    assert store.lookup(HASHES[:5], record_stats=False) == StoreHit((D,) * 5)


async def test_eviction_keeps_the_most_recently_used_blocks(make_store) -> None:
    store = await make_store(ssd=False, dram_bytes=3 * BB)
    kv = make_kv()
    await offload(store, HASHES[:3], kv, [0, 1, 2])
    out = torch.empty((1, BB), dtype=torch.uint8)
    assert await store.load(HASHES[:1], out) == 1  # block 0 used again
    await offload(store, HASHES[3:5], kv, [3, 4])
    present = [store.dram.contains(bh) for bh in HASHES[:5]]
    assert present == [True, False, False, True, True]
    assert store.stats().dram.evictions == 2


async def test_full_offload_queue_drops_and_counts(make_store) -> None:
    store = await make_store(ssd=False, offload_queue=1)
    kv = make_kv()
    first = store.offload(HASHES[:2], DeviceBlocks(kv, [0, 1]))
    second = store.offload(HASHES[2:4], DeviceBlocks(kv, [2, 3]))
    assert first is not None and second is None
    assert await first == 2
    stats = store.stats()
    assert (stats.offloads, stats.offloads_dropped) == (1, 1)
    assert store.lookup(HASHES[:4], record_stats=False).num_blocks == 2


async def test_full_ssd_write_queue_drops_and_counts(make_store) -> None:
    store = await make_store(ssd_write_queue=1)
    kv = make_kv()
    assert await offload(store, HASHES[:3], kv, [0, 1, 2]) == 3
    await store.flush()
    stats = store.stats()
    assert (stats.ssd_writes_queued, stats.ssd_writes_dropped) == (1, 2)
    assert store.ssd is not None and store.ssd.num_blocks == 1


async def test_block_events_report_every_tier_change(make_store) -> None:
    events: list[tuple[int, str, bool]] = []
    store = await make_store(
        on_block_event=lambda bh, tier, stored: events.append(
            (HASHES.index(bh), tier.label, stored)
        ),
    )
    kv = make_kv()
    await offload(store, HASHES[:2], kv, [0, 1])
    await store.flush()
    assert events == [(0, "dram", True), (1, "dram", True), (0, "ssd", True), (1, "ssd", True)]
    events.clear()
    assert await store.clear() == 4
    assert events == [(0, "dram", False), (1, "dram", False), (0, "ssd", False), (1, "ssd", False)]


async def test_a_failing_listener_does_not_break_the_store(make_store) -> None:
    def broken(bh: bytes, tier: Tier, stored: bool) -> None:
        raise KeyError("listener bug")

    store = await make_store(ssd=False, on_block_event=broken)
    assert await offload(store, HASHES[:2], make_kv(), [0, 1]) == 2
    assert store.stats().event_listener_errors == 2
    store.check_integrity()


async def test_clear_empties_both_tiers(make_store) -> None:
    store = await make_store()
    await offload(store, HASHES[:4], make_kv(), [0, 1, 2, 3])
    await store.flush()
    assert await store.clear() == 8  # 4 in DRAM, 4 on SSD
    assert store.lookup(HASHES[:4]) == StoreHit()
    store.check_integrity()


async def test_no_dram_tier_offloads_straight_to_ssd(make_store) -> None:
    store = await make_store(dram_bytes=0)
    assert store.dram.num_slots == 0
    src = torch.randint(0, 256, (3, BB), dtype=torch.uint8)
    fut = store.offload(HASHES[:3], src)
    assert fut is not None and await fut == 3
    await store.flush()
    assert store.lookup(HASHES[:3]) == StoreHit((S,) * 3)
    out = torch.zeros((3, BB), dtype=torch.uint8)
    assert await store.load(HASHES[:3], out) == 3
    assert torch.equal(out, src)


async def test_host_tensor_source_and_destination(make_store) -> None:
    store = await make_store(ssd=False)
    src = torch.randint(0, 256, (4, BB), dtype=torch.uint8)
    fut = store.offload(HASHES[:4], src)
    assert fut is not None and await fut == 4
    out = torch.zeros((5, BB), dtype=torch.uint8)
    assert await store.load(HASHES[:5], out) == 4
    assert torch.equal(out[:4], src) and not out[4].any()


async def test_a_corrupt_ssd_block_ends_the_loaded_prefix(make_store, tmp_path: Path) -> None:
    store = await make_store(dram_bytes=0)
    src = torch.randint(0, 256, (4, BB), dtype=torch.uint8)
    fut = store.offload(HASHES[:4], src)
    assert fut is not None and await fut == 4
    await store.close()
    assert store.ssd is not None
    slot = store.ssd.slot_of(HASHES[2])
    assert slot is not None
    overwrite(tmp_path / "ssd" / SLAB_NAME, slot * store.ssd.slot_stride + 17, b"\x00\x01\x02")

    store = await make_store()
    assert store.lookup(HASHES[:4]) == StoreHit((S,) * 4)  # not read yet
    out = torch.zeros((4, BB), dtype=torch.uint8)
    assert await store.load(HASHES[:4], out) == 2
    assert torch.equal(out[:2], src[:2])
    assert store.stats().ssd_corrupt_dropped == 1
    # Block 3 read well and stays (promoted to DRAM), but is no longer a prefix.
    assert store.lookup(HASHES[:4], record_stats=False) == StoreHit((D, D))
    assert store.dram.contains(HASHES[3])
    store.check_integrity()


async def test_concurrent_loads_and_offloads_stay_consistent(make_store) -> None:
    store = await make_store(dram_bytes=4 * BB, ssd_bytes=8 * 8192)
    kv = make_kv(32)

    async def producer(start: int) -> None:
        for i in range(start, start + 6):
            fut = store.offload(HASHES[i : i + 1], DeviceBlocks(kv, [i]))
            if fut is not None:
                await fut

    async def consumer(seed: int) -> int:
        loaded = 0
        for i in range(11):
            fresh = zeros_like(kv)
            n = await store.load(HASHES[i : i + 2], DeviceBlocks(fresh, [20, 21]))
            assert same_blocks(kv, [i, i + 1][:n], fresh, [20, 21][:n])
            loaded += n
        return loaded

    await asyncio.gather(producer(0), producer(6), consumer(0), consumer(1))
    await store.flush()
    store.check_integrity()
    assert store.ssd is not None and store.ssd.num_corrupt == 0


async def test_cancelled_load_leaves_the_pools_consistent(make_store) -> None:
    store = await make_store(dram_bytes=4 * BB)
    await offload(store, HASHES[:4], make_kv(), [0, 1, 2, 3])
    await store.flush()
    store.dram.clear()  # only on SSD now
    task = asyncio.create_task(store.load(HASHES[:4], torch.zeros((4, BB), dtype=torch.uint8)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The SSD reads run on after the cancel; they commit or abort their slots.
    await asyncio.gather(*[t for t in store._tasks if t.get_name() == "store-ssd-promote"])
    assert store.dram.num_leases == 0 and store.dram.num_pending == 0
    assert store.dram.num_cached == 4  # the reads landed and were committed
    store.check_integrity()


async def test_caller_mistakes_raise(make_store) -> None:
    cfg = StoreConfig(ssd_path="")
    idle = TieredStore(LAYOUT, cfg, pin_memory=False)
    with pytest.raises(RuntimeError, match="await start"):
        idle.offload(HASHES[:1], torch.zeros((1, BB), dtype=torch.uint8))
    store = await make_store(ssd=False)
    kv = make_kv()
    with pytest.raises(ValueError, match="2 block ids for 3 hashes"):
        store.offload(HASHES[:3], DeviceBlocks(kv, [0, 1]))
    with pytest.raises(ValueError, match="uint8 tensor"):
        await store.load(HASHES[:1], torch.zeros((1, BB), dtype=torch.float32))
    other = BlockLayout(2, 4, 2, 8, torch.float16)
    kv16 = [(k.to(other.dtype), v.to(other.dtype)) for k, v in kv]
    with pytest.raises(ValueError, match="does not match"):
        store.offload(HASHES[:1], DeviceBlocks(kv16, [0]))


def test_dram_size_from_a_share_of_ram() -> None:
    cfg = StoreConfig(dram_bytes=0, dram_fraction=1e-5)
    store = TieredStore(LAYOUT, cfg, pin_memory=False)
    assert store.dram.num_slots == int(1e-5 * physical_memory_bytes()) // BB
    with pytest.raises(ConfigValueError, match="ssd_io_threads"):
        StoreConfig(ssd_io_threads=0)
