"""Pins: the table (merge, budget, expiry), eviction order in DRAM and on the
SSD, PIN/UNPIN records in the SSD log (old logs, torn records, compaction),
and the store's pins across a reopen."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mooncaked.cache.dram import DramPool
from mooncaked.cache.layout import BlockLayout
from mooncaked.cache.oplog import (
    HEADER_SIZE,
    LOG_NAME,
    OP_PIN,
    OP_UNPIN,
    REC_SIZE,
    encode_header,
    encode_pin,
    encode_record,
    encode_unpin,
    parse_log,
    replay_ops,
    replay_pins,
)
from mooncaked.cache.pins import FOREVER, PinBudgetExceeded, PinKind, PinTable, check_ttl
from mooncaked.cache.slab import SlabIndex
from mooncaked.cache.store import DeviceBlocks, TieredStore
from mooncaked.config import StoreConfig
from tests.conftest import ManualClock

LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
SOFT, HARD = PinKind.SOFT, PinKind.HARD


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fill(pool: DramPool, block_hash: bytes) -> int:
    slot = pool.allocate(block_hash)
    assert slot is not None
    pool.commit(slot)
    return slot


# -- the table ----------------------------------------------------------------


def test_pins_merge_to_the_stronger_kind_and_the_later_deadline() -> None:
    table = PinTable(budget=10, budget_ratio=0.5)
    assert table.pin([h(1), h(2)], SOFT, 100.0) == [
        (h(1), table.get(h(1))),
        (h(2), table.get(h(2))),
    ]
    # A soft pin with an earlier deadline changes nothing; a hard one wins.
    assert table.pin([h(1)], SOFT, 50.0) == []
    table.pin([h(1)], HARD, 80.0)
    pin = table.get(h(1))
    assert pin is not None and (pin.kind, pin.deadline) == (HARD, 100.0)
    # A later soft pin of a hard-pinned hash keeps it hard, with the later end.
    table.pin([h(1)], SOFT, 200.0)
    pin = table.get(h(1))
    assert pin is not None and (pin.kind, pin.deadline) == (HARD, 200.0)
    assert table.kind_of(h(2)) is SOFT and table.kind_of(h(3)) is None
    assert (table.count(SOFT), table.count(HARD)) == (1, 1)


def test_a_pin_past_the_budget_is_refused_whole_naming_the_budget() -> None:
    table = PinTable(budget=3, budget_ratio=0.25)
    table.pin([h(1), h(2)], SOFT, 100.0)
    with pytest.raises(PinBudgetExceeded, match=r"budget of 3 blocks.*max_pinned_ratio = 0.25"):
        table.pin([h(2), h(3), h(4)], HARD, FOREVER)
    assert len(table) == 2 and table.kind_of(h(2)) is SOFT
    # Hashes pinned already cost nothing: one new hash fits.
    table.pin([h(1), h(2), h(3)], HARD, FOREVER)
    assert len(table) == 3


def test_expire_ends_pins_in_deadline_order_skipping_merged_ones() -> None:
    table = PinTable(budget=10, budget_ratio=1.0)
    table.pin([h(1)], SOFT, 10.0)
    table.pin([h(2)], SOFT, 20.0)
    table.pin([h(3)], HARD, FOREVER)
    table.pin([h(1)], SOFT, 30.0)  # merged: its old deadline is stale in the heap
    assert table.next_deadline() == 20.0
    assert table.expire(25.0) == [h(2)]
    assert table.next_deadline() == 30.0
    assert table.expire(30.0) == [h(1)]
    assert table.next_deadline() is None and table.kind_of(h(3)) is HARD
    assert table.unpin([h(3), h(9)]) == [h(3)]


def test_ttl_rules() -> None:
    check_ttl(None, True)
    check_ttl(0.5, False)
    with pytest.raises(ValueError, match="a soft pin needs ttl_s"):
        check_ttl(None, False)
    for bad in (0.0, -1.0, math.inf, 1e12):
        with pytest.raises(ValueError, match="ttl_s must be in"):
            check_ttl(bad, True)


# -- eviction order in DRAM --------------------------------------------------


def test_dram_evicts_unpinned_then_soft_pinned_never_hard_pinned() -> None:
    table = PinTable(budget=8, budget_ratio=1.0)
    pool = DramPool(LAYOUT, 4, pin_memory=False, pin_of=table.kind_of)
    for i in range(4):
        fill(pool, h(i))
    table.pin([h(0)], HARD, FOREVER)
    table.pin([h(1)], SOFT, 100.0)
    pool.requeue(h(0))
    pool.requeue(h(1))
    pool.check_integrity()
    assert pool.cached_hashes() == [h(2), h(3), h(1), h(0)]
    # Eviction pressure: the unpinned go first, then the soft pin, never the hard one.
    assert fill(pool, h(10)) == 2
    assert fill(pool, h(11)) == 3
    assert pool.cached_hashes() == [h(10), h(11), h(1), h(0)]
    assert pool.evict(10) == [h(10), h(11), h(1)]
    assert pool.cached_hashes() == [h(0)] and pool.num_evictable == 0
    assert fill(pool, h(12)) == 1  # the last slot freed is the first reused
    pool.check_integrity()


def test_dram_pin_ending_puts_the_block_first_in_line() -> None:
    table = PinTable(budget=8, budget_ratio=1.0)
    pool = DramPool(LAYOUT, 3, pin_memory=False, pin_of=table.kind_of)
    for i in range(3):
        fill(pool, h(i))
    table.pin([h(2)], HARD, FOREVER)
    pool.requeue(h(2))
    pool.touch([h(0)])  # order 1, 0 (2 is out of the queues)
    assert pool.cached_hashes() == [h(1), h(0), h(2)]
    table.unpin([h(2)])
    pool.requeue(h(2))
    assert pool.cached_hashes() == [h(2), h(1), h(0)]
    pool.check_integrity()


def test_dram_leased_pinned_block_rejoins_its_pins_queue_on_release() -> None:
    table = PinTable(budget=8, budget_ratio=1.0)
    pool = DramPool(LAYOUT, 2, pin_memory=False, pin_of=table.kind_of)
    fill(pool, h(0))
    fill(pool, h(1))
    lease = pool.lease([h(0)], "reader")
    assert lease is not None
    table.pin([h(0)], SOFT, 100.0)
    pool.requeue(h(0))  # leased: stays out of every queue
    pool.check_integrity()
    assert pool.release(lease)
    assert pool.cached_hashes() == [h(1), h(0)]
    assert pool.evict(1) == [h(1)]
    pool.check_integrity()


def test_dram_integrity_check_catches_a_pin_changed_without_requeue() -> None:
    table = PinTable(budget=8, budget_ratio=1.0)
    pool = DramPool(LAYOUT, 2, pin_memory=False, pin_of=table.kind_of)
    fill(pool, h(0))
    table.pin([h(0)], HARD, FOREVER)
    with pytest.raises(RuntimeError, match="eviction queue"):
        pool.check_integrity()


# -- eviction order on the SSD slab -------------------------------------------


def test_slab_victims_skip_hard_pins_and_take_soft_pins_last() -> None:
    table = PinTable(budget=8, budget_ratio=1.0)
    slab = SlabIndex(4, table.kind_of)
    for i in range(3):
        slot = slab.take_free()
        assert slot is not None
        slab.begin_write(slot, h(i))
        slab.publish(slot, h(i), crc=i)
    table.pin([h(0)], HARD, FOREVER)
    table.pin([h(1)], SOFT, 100.0)
    slab.requeue(h(0))
    slab.requeue(h(1))
    slab.check_integrity()
    assert slab.hashes() == [h(2), h(1), h(0)]
    assert slab.victim() == slab.slot_of(h(2))
    slab.unindex(slab.slot_of(h(2)) or 0)
    assert slab.victim() == slab.slot_of(h(1))
    slab.unindex(slab.slot_of(h(1)) or 0)
    assert slab.victim() is None
    slab.check_integrity()


# -- the SSD log's records ------------------------------------------------------


def test_pin_records_replay_last_one_wins_and_never_touch_the_index() -> None:
    header = encode_header(64, 4096, 8, b"t".ljust(16, b"\0"))
    records = [
        encode_record(1, 2, h(5), 111),  # PUT h5 at slot 2
        # A hard pin's kind (2) sits in the slot field: it must not read as slot 2.
        encode_pin(h(5), int(HARD), 0),
        encode_pin(h(6), int(SOFT), 1_900_000_000),
        encode_unpin(h(6)),
        encode_pin(h(7), int(SOFT), 1_800_000_000),
    ]
    parsed = parse_log(header + b"".join(records), 64, 4096, b"t".ljust(16, b"\0"))
    assert parsed.corrupt_records == 0 and len(parsed.ops) == 5
    index, _, _ = replay_ops(parsed.ops, 8)
    assert index == {h(5): 2}
    assert replay_pins(parsed.ops) == {h(5): (int(HARD), 0), h(7): (int(SOFT), 1_800_000_000)}
    assert [op[0] for op in parsed.ops][1:] == [OP_PIN, OP_PIN, OP_UNPIN, OP_PIN]


def test_a_torn_or_corrupt_pin_record_is_dropped() -> None:
    tag = b"t".ljust(16, b"\0")
    good = encode_pin(h(1), int(HARD), 0)
    bad = bytearray(encode_pin(h(2), int(HARD), 0))
    bad[8] ^= 0xFF
    torn = encode_pin(h(3), int(HARD), 0)[: REC_SIZE // 2]
    raw = encode_header(64, 4096, 8, tag) + good + bytes(bad) + torn
    parsed = parse_log(raw, 64, 4096, tag)
    assert (parsed.corrupt_records, parsed.torn_tail_bytes) == (1, REC_SIZE // 2)
    assert replay_pins(parsed.ops) == {h(1): (int(HARD), 0)}
    assert len(raw) == HEADER_SIZE + 2 * REC_SIZE + REC_SIZE // 2


# -- the store ----------------------------------------------------------------


def store_config(tmp_path: Path, **kw: object) -> StoreConfig:
    args: dict[str, object] = {
        "dram_bytes": 8 * LAYOUT.block_bytes,
        "ssd_path": str(tmp_path / "ssd"),
        "ssd_bytes": 64 * 4096,
        "ssd_io_threads": 2,
        "high_watermark": 1.0,
        "max_pinned_ratio": 0.5,
        **kw,
    }
    return StoreConfig(**args)  # type: ignore[arg-type]


def make_kv(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shape = (num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [
        (torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half())
        for _ in range(LAYOUT.num_layers)
    ]


async def offload(store: TieredStore, hashes: list[bytes], kv: list, ids: list[int]) -> None:
    fut = store.offload(hashes, DeviceBlocks(kv, ids))
    assert fut is not None
    await fut


async def test_store_pins_survive_pressure_and_a_reopen_and_end_on_time(tmp_path: Path) -> None:
    wall = ManualClock(1_700_000_000.0)
    kv = make_kv(24)
    store = TieredStore(LAYOUT, store_config(tmp_path), pin_memory=False, wall_clock=wall)
    await store.start()
    await offload(store, [h(i) for i in range(5)], kv, [0, 1, 2, 3, 4])
    result = store.pin([h(0), h(1), h(99)], ttl_s=None, hard=True)
    assert result.pinned == (h(0), h(1)) and result.missing == (h(99),)
    store.pin([h(2)], ttl_s=60.0, hard=False)
    # The budget is half of 8 DRAM slots: 3 pinned, one more fits, two do not.
    with pytest.raises(PinBudgetExceeded, match="budget of 4 blocks"):
        store.pin([h(3), h(4)], ttl_s=5.0, hard=False)
    # Pressure: 12 more blocks through 8 slots evicts every unpinned one.
    for i in range(12):
        await offload(store, [h(100 + i)], kv, [5 + i])
    assert {h(0), h(1), h(2)} <= set(store.dram.cached_hashes())
    assert not store.dram.contains(h(3)) and not store.dram.contains(h(4))
    stats = store.pin_stats()
    assert (stats.soft_blocks, stats.hard_blocks, stats.budget_blocks) == (1, 2, 4)
    assert stats.in_dram == 3
    await store.flush()
    store.check_integrity()
    await store.close()

    # A restart: the pins come back from the SSD log with their blocks.
    reopened = TieredStore(LAYOUT, store_config(tmp_path), pin_memory=False, wall_clock=wall)
    await reopened.start()
    pins = reopened.retention.pins
    assert (pins.kind_of(h(0)), pins.kind_of(h(1)), pins.kind_of(h(2))) == (HARD, HARD, SOFT)
    assert all(reopened.ssd is not None and reopened.ssd.contains(h(i)) for i in range(3))
    assert reopened.pin_stats().restored == 3
    # The soft pin ends at its deadline (whole seconds, rounded up, once logged).
    wall.now += 61.0
    assert reopened.retention.expire() == 1
    assert pins.kind_of(h(2)) is None
    assert reopened.unpin([h(0)]) == 1
    reopened.check_integrity()
    await reopened.close()

    again = TieredStore(LAYOUT, store_config(tmp_path), pin_memory=False, wall_clock=wall)
    await again.start()
    assert [h_ for h_, _ in again.retention.pins.items()] == [h(1)]
    await again.close()


async def test_pins_of_blocks_gone_or_expired_are_dropped_on_restore(tmp_path: Path) -> None:
    wall = ManualClock(1_700_000_000.0)
    kv = make_kv(4)
    store = TieredStore(LAYOUT, store_config(tmp_path), pin_memory=False, wall_clock=wall)
    await store.start()
    await offload(store, [h(0), h(1)], kv, [0, 1])
    store.pin([h(0)], ttl_s=10.0, hard=False)
    store.pin([h(1)], ttl_s=None, hard=True)
    await store.flush()
    await store.close()
    # The log's last compaction: a PUT per block, a PIN per pin.
    raw = (tmp_path / "ssd" / LOG_NAME).read_bytes()
    assert len(raw) == HEADER_SIZE + 4 * REC_SIZE
    wall.now += 20.0
    reopened = TieredStore(LAYOUT, store_config(tmp_path), pin_memory=False, wall_clock=wall)
    await reopened.start()
    assert reopened.retention.pins.kind_of(h(0)) is None  # its time ran out while down
    assert reopened.retention.pins.kind_of(h(1)) is HARD
    stats = reopened.pin_stats()
    assert (stats.restored, stats.dropped_on_restore) == (1, 1)
    await reopened.close()


async def test_remove_drops_blocks_and_pins_and_clear_drops_every_pin(tmp_path: Path) -> None:
    kv = make_kv(4)
    store = TieredStore(LAYOUT, store_config(tmp_path), pin_memory=False)
    await store.start()
    await offload(store, [h(0), h(1), h(2)], kv, [0, 1, 2])
    await store.flush()
    store.pin([h(0), h(1)], ttl_s=None, hard=True)
    assert store.remove([h(0), h(7)]) == 1
    assert store.tiers_of(h(0)) == () and h(0) not in store.retention.pins
    assert len(store.tiers_of(h(1))) == 2
    await store.clear()
    assert len(store.retention.pins) == 0
    store.check_integrity()
    await store.close()


def test_a_log_from_before_pins_replays_as_it_did() -> None:
    tag = b"t".ljust(16, b"\0")
    # What the tier wrote before the pin kinds: PUTs and REMOVEs only.
    raw = encode_header(64, 4096, 8, tag) + b"".join(
        [
            encode_record(1, 0, h(1), 11),
            encode_record(1, 1, h(2), 22),
            encode_record(2, 0, h(1), 0),
            encode_record(1, 0, h(3), 33),
        ]
    )
    parsed = parse_log(raw, 64, 4096, tag)
    assert (parsed.corrupt_records, parsed.discarded) == (0, "")
    index, crcs, _ = replay_ops(parsed.ops, 8)
    assert index == {h(2): 1, h(3): 0} and crcs == {1: 22, 0: 33}
    assert replay_pins(parsed.ops) == {}
