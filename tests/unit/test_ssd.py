from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from pathlib import Path

import pytest
import torch

from mooncaked.cache.ssd import LOG_NAME, REC_SIZE, SLAB_NAME, TMP_LOG_NAME, SsdTier

BLOCK = 6000  # not a page multiple: slots are padded to 8 KiB


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def content(block_hash: bytes, size: int = BLOCK) -> bytes:
    return hashlib.shake_256(block_hash).digest(size)


async def open_tier(path: Path, num_slots: int = 8, **kw) -> SsdTier:
    tier = SsdTier(path, BLOCK, num_slots, layout_tag=b"test-layout", io_threads=2, **kw)
    await tier.open()
    return tier


async def read(tier: SsdTier, block_hash: bytes) -> bytes | None:
    out = bytearray(BLOCK)
    return bytes(out) if await tier.get(block_hash, out) else None


def flip_byte(path: Path, slot: int, stride: int, offset: int = 100) -> None:
    with open(path / SLAB_NAME, "r+b") as f:
        f.seek(slot * stride + offset)
        b = f.read(1)
        f.seek(slot * stride + offset)
        f.write(bytes([b[0] ^ 0xFF]))


async def test_put_get_round_trip_and_slot_stride(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path)
    assert tier.slot_stride == 8192
    assert await tier.put(h(1), content(h(1)))
    assert not await tier.put(h(1), content(h(1)))  # already there
    assert await read(tier, h(1)) == content(h(1))
    assert await read(tier, h(2)) is None
    out = torch.empty(BLOCK, dtype=torch.uint8)
    assert await tier.get(h(1), out)
    assert out.numpy().tobytes() == content(h(1))
    with pytest.raises(ValueError, match="6000 bytes"):
        await tier.put(h(3), b"short")
    tier.check_integrity()
    await tier.close()


async def test_blocks_survive_reopen_with_lru_order(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path, num_slots=3)
    for i in range(3):
        assert await tier.put(h(i), content(h(i)))
    assert await read(tier, h(0)) is not None  # order now 1, 2, 0
    await tier.close()

    tier = await open_tier(tmp_path, num_slots=3)
    assert tier.report.blocks == 3 and tier.report.corrupt_records == 0
    assert tier.hashes() == [h(1), h(2), h(0)]
    assert await tier.put(h(3), content(h(3)))
    assert not tier.contains(h(1))
    for i in (0, 2, 3):
        assert await read(tier, h(i)) == content(h(i))
    assert tier.num_evictions == 1
    tier.check_integrity()
    await tier.close()


async def test_eviction_keeps_most_recently_used(tmp_path: Path) -> None:
    removed: list[tuple[bytes, bool]] = []
    tier = await open_tier(
        tmp_path, num_slots=4, on_removed=lambda bh, ev: removed.append((bh, ev))
    )
    for i in range(4):
        await tier.put(h(i), content(h(i)))
    await read(tier, h(0))
    await read(tier, h(2))
    for i in range(4, 6):
        await tier.put(h(i), content(h(i)))
    assert removed == [(h(1), True), (h(3), True)]
    assert sorted(tier.hashes()) == sorted([h(0), h(2), h(4), h(5)])
    await tier.close()


async def test_flipped_slot_bytes_are_dropped_never_served(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path)
    for i in range(4):
        await tier.put(h(i), content(h(i)))
    bad_slot = tier.slot_of(h(2))
    assert bad_slot is not None
    stride = tier.slot_stride
    await tier.close()
    flip_byte(tmp_path, bad_slot, stride)

    tier = await open_tier(tmp_path)
    assert tier.contains(h(2))  # not read yet
    assert await read(tier, h(2)) is None
    assert not tier.contains(h(2)) and tier.num_corrupt == 1
    for i in (0, 1, 3):
        assert await read(tier, h(i)) == content(h(i))
    await tier.close()
    # The drop was logged: a later start does not bring it back.
    tier = await open_tier(tmp_path)
    assert sorted(tier.hashes()) == [h(0), h(1), h(3)]
    await tier.close()


async def test_verify_on_open_drops_bad_slots_at_start(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path)
    for i in range(3):
        await tier.put(h(i), content(h(i)))
    slots = [tier.slot_of(h(0)), tier.slot_of(h(1))]
    stride = tier.slot_stride
    await tier.close()
    for slot in slots:
        assert slot is not None
        flip_byte(tmp_path, slot, stride, offset=BLOCK - 1)
    tier = await open_tier(tmp_path, verify_on_open=True)
    assert tier.report.bad_slots == 2
    assert tier.hashes() == [h(2)]
    await tier.close()


async def test_torn_tail_and_corrupt_records_are_dropped(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path)
    for i in range(3):
        await tier.put(h(i), content(h(i)))
    await tier.close()
    log_path = tmp_path / LOG_NAME
    raw = bytearray(log_path.read_bytes())
    # The compacted log: a 64-byte header, then PUT h(0), h(1), h(2).
    assert len(raw) == 64 + 3 * REC_SIZE
    raw[64 + REC_SIZE + 5] ^= 0x01  # corrupt the record of h(1)
    raw += b"\x4d\x4b\x43\x52\x01\x00"  # half an append
    log_path.write_bytes(bytes(raw))

    tier = await open_tier(tmp_path)
    assert tier.report.corrupt_records == 1
    assert tier.report.torn_tail_bytes == 6
    assert sorted(tier.hashes()) == [h(0), h(2)]
    assert await read(tier, h(0)) == content(h(0))
    await tier.close()
    # Compaction on start left a clean log.
    assert (tmp_path / LOG_NAME).stat().st_size == 64 + 2 * REC_SIZE


async def test_lost_remove_with_reused_slot_is_caught_by_the_checksum(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path, num_slots=1)
    await tier.put(h(1), content(h(1)))
    await tier.close()
    old_log = (tmp_path / LOG_NAME).read_bytes()  # says: h(1) in slot 0
    tier = await open_tier(tmp_path, num_slots=1)
    await tier.put(h(2), content(h(2)))  # evicts h(1), reuses slot 0
    await tier.close()
    (tmp_path / LOG_NAME).write_bytes(old_log)  # as if REMOVE and PUT were lost

    tier = await open_tier(tmp_path, num_slots=1)
    assert tier.hashes() == [h(1)]
    assert await read(tier, h(1)) is None  # slot 0 holds h(2)'s bytes
    assert tier.num_blocks == 0 and tier.num_corrupt == 1
    await tier.close()


async def test_changed_layout_discards_the_old_contents(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path)
    await tier.put(h(1), content(h(1)))
    await tier.close()
    tier = SsdTier(tmp_path, BLOCK, 8, layout_tag=b"other-layout")
    report = await tier.open()
    assert report.discarded == "the block layout changed"
    assert tier.num_blocks == 0
    await tier.close()


async def test_smaller_capacity_drops_blocks_beyond_it(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path, num_slots=4)
    for i in range(4):
        await tier.put(h(i), content(h(i)))
    high = [i for i in range(4) if (tier.slot_of(h(i)) or 0) >= 2]
    await tier.close()
    tier = await open_tier(tmp_path, num_slots=2)
    assert tier.report.out_of_range == 2
    assert tier.num_blocks == 2 and not any(tier.contains(h(i)) for i in high)
    assert (tmp_path / SLAB_NAME).stat().st_size == 2 * tier.slot_stride
    for bh in tier.hashes():
        assert await read(tier, bh) == content(bh)
    tier.check_integrity()
    await tier.close()


async def test_log_is_compacted_while_running(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path, num_slots=4, compact_ratio=2.0, compact_min_bytes=2048)
    for i in range(200):
        await tier.put(h(i), content(h(i)))
    await tier.sync()
    # 4 live blocks: without compaction 200 PUTs and 196 REMOVEs (15,904 bytes)
    # would pile up. How many records arrive during one compaction depends on
    # the disk, so the bound is loose.
    assert tier.num_compactions >= 2
    assert (tmp_path / LOG_NAME).stat().st_size < 15_904 // 2
    await tier.close()
    tier = await open_tier(tmp_path, num_slots=4)
    assert sorted(tier.hashes()) == sorted(h(i) for i in range(196, 200))
    await tier.close()


async def test_concurrent_puts_and_gets_stay_consistent(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path, num_slots=16)

    async def writer(start: int) -> None:
        for i in range(start, start + 20):
            await tier.put(h(i), content(h(i)))

    async def reader() -> int:
        served = 0
        for _ in range(3):
            for i in range(20):
                data = await read(tier, h(i))
                if data is not None:
                    assert data == content(h(i))
                    served += 1
        return served

    await writer(0)
    # Reads of the first 20 race with the writes that evict them.
    results = await asyncio.gather(writer(100), writer(200), reader(), reader())
    assert tier.num_blocks == 16
    assert tier.num_corrupt == 0
    assert sum(r for r in results if r) > 0
    tier.check_integrity()
    await tier.close()


async def test_cancelled_put_frees_its_slot_after_the_write(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path, num_slots=2)
    task = asyncio.create_task(tier.put(h(1), content(h(1))))
    await asyncio.sleep(0)  # the write is in the pool now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await tier.close()  # waits for the thread, then frees the slot
    assert tier.num_free == 2 and tier.num_blocks == 0
    tier.check_integrity()


async def test_clear_empties_the_tier_and_its_log(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path)
    for i in range(5):
        await tier.put(h(i), content(h(i)))
    assert await tier.clear() == 5
    assert tier.num_blocks == 0 and tier.num_free == 8
    await tier.close()
    assert (tmp_path / LOG_NAME).stat().st_size == 64
    tier = await open_tier(tmp_path)
    assert tier.num_blocks == 0
    await tier.close()


async def test_missing_slab_discards_the_log(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path)
    await tier.put(h(1), content(h(1)))
    await tier.close()
    (tmp_path / SLAB_NAME).unlink()
    tier = await open_tier(tmp_path)
    assert tier.report.discarded == "the slab file was missing"
    assert tier.num_blocks == 0
    await tier.close()


async def test_use_before_open_is_an_error(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, BLOCK, 2)
    with pytest.raises(RuntimeError, match="await open"):
        await tier.put(h(1), content(h(1)))
    with pytest.raises(ValueError, match="compact_ratio"):
        SsdTier(tmp_path, BLOCK, 2, compact_ratio=1.0)


async def test_a_leftover_compaction_file_is_ignored_and_removed(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path)
    for i in range(3):
        await tier.put(h(i), content(h(i)))
    await tier.close()
    # A compaction killed before its rename: the tmp file may hold anything,
    # even a whole other log; oplog.bin is the complete one.
    (tmp_path / TMP_LOG_NAME).write_bytes((tmp_path / LOG_NAME).read_bytes()[:64])
    tier = await open_tier(tmp_path)
    assert not (tmp_path / TMP_LOG_NAME).exists()
    assert sorted(tier.hashes()) == [h(0), h(1), h(2)]
    for i in range(3):
        assert await read(tier, h(i)) == content(h(i))
    await tier.close()


async def test_puts_during_a_compaction_are_in_the_log_file_when_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The compaction's fsync of the new log waits for the test: a slow disk.
    entered, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        entered.set()
        release.wait(30)
        real_fsync(fd)

    tier = await open_tier(tmp_path, num_slots=64, compact_ratio=2.0, compact_min_bytes=1024)
    monkeypatch.setattr(os, "fsync", slow_fsync)
    # What a restart would index, read from the files while the tier runs.
    files = SsdTier(tmp_path, BLOCK, 64, layout_tag=b"test-layout")
    i = 0
    while not entered.is_set():
        # PUT and REMOVE pairs grow the log past twice its live size.
        assert await tier.put(h(i), content(h(i)))
        tier.remove(h(i))
        i += 1
        await asyncio.sleep(0)
    assert (tmp_path / TMP_LOG_NAME).exists()
    compactions = tier.num_compactions
    during = [h(1000 + j) for j in range(10)]
    for bh in during:
        assert await tier.put(bh, content(bh))
        assert bh in files.peek_index()
    tier.remove(during[0])
    assert during[0] not in files.peek_index()
    release.set()
    await tier.sync()  # queued behind the compaction
    # On a loaded machine the records written while the tmp file was made can
    # be enough for one more compaction before the sync.
    assert tier.num_compactions >= compactions + 1
    assert not (tmp_path / TMP_LOG_NAME).exists()
    # The new log: snapshot plus the records written while it was made.
    assert files.peek_index() == {bh: tier.slot_of(bh) for bh in during[1:]}
    await tier.close()
    tier = await open_tier(tmp_path, num_slots=64)
    for bh in during[1:]:
        assert await read(tier, bh) == content(bh)
    assert tier.num_blocks == 9
    await tier.close()


async def test_listeners_never_see_a_block_a_restart_would_not_bring_back(
    tmp_path: Path,
) -> None:
    files = SsdTier(tmp_path, BLOCK, 2, layout_tag=b"test-layout")
    seen: list[tuple[str, bytes, bool]] = []
    tier = await open_tier(
        tmp_path,
        num_slots=2,
        # On a store the PUT is in the log already; on a removal the REMOVE is not yet.
        on_stored=lambda bh: seen.append(("stored", bh, bh in files.peek_index())),
        on_removed=lambda bh, ev: seen.append(("removed", bh, bh in files.peek_index())),
    )
    for i in range(3):
        await tier.put(h(i), content(h(i)))  # the third evicts h(0)
    tier.remove(h(1))
    assert seen == [
        ("stored", h(0), True),
        ("stored", h(1), True),
        ("removed", h(0), True),
        ("stored", h(2), True),
        ("removed", h(1), True),
    ]
    assert files.peek_index() == {h(2): tier.slot_of(h(2))}
    await tier.close()


async def test_a_sync_racing_close_is_served_by_the_last_compaction(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path)
    await tier.put(h(1), content(h(1)))
    closing = asyncio.create_task(tier.close())
    await asyncio.sleep(0)  # close() has begun
    await asyncio.wait_for(tier.sync(), 10)
    await closing
    tier = await open_tier(tmp_path)
    assert await read(tier, h(1)) == content(h(1))
    await tier.close()
