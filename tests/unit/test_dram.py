from __future__ import annotations

import mmap
import os
import subprocess
import sys

import pytest
import torch

from mooncaked.cache.dram import BlockLayout, DramPool, gather_blocks, scatter_blocks
from tests.conftest import ManualClock

LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def make_kv(
    layout: BlockLayout, num_blocks: int, seed: int = 0, *, contiguous: bool = True
) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    # Non-contiguous: every tensor is a view of the first half of a wider one.
    width = layout.head_dim * (1 if contiguous else 2)
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, width)
    return [
        (
            torch.randn(shape, generator=g).to(layout.dtype)[..., : layout.head_dim],
            torch.randn(shape, generator=g).to(layout.dtype)[..., : layout.head_dim],
        )
        for _ in range(layout.num_layers)
    ]


def fill(pool: DramPool, block_hash: bytes, value: int) -> int:
    slot = pool.allocate(block_hash)
    assert slot is not None
    pool.slot(slot).fill_(value)
    pool.commit(slot)
    return slot


# -- layout ------------------------------------------------------------------


def test_block_bytes_covers_every_layer_k_and_v() -> None:
    assert LAYOUT.block_bytes == 2 * 2 * 4 * 2 * 8 * 2
    bf = BlockLayout(32, 16, 8, 128, torch.bfloat16)
    assert bf.block_bytes == 2 * 1024 * 1024
    assert bf.fingerprint() != BlockLayout(32, 16, 8, 128, torch.float16).fingerprint()
    assert bf.fingerprint() == BlockLayout(32, 16, 8, 128, torch.bfloat16).fingerprint()


def test_layout_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="head_dim"):
        BlockLayout(2, 4, 2, 0, torch.float16)
    with pytest.raises(ValueError, match="expected 2 layers"):
        LAYOUT.check_kv_caches(make_kv(LAYOUT, 3)[:1])
    other = BlockLayout(2, 4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="does not match"):
        LAYOUT.check_kv_caches(make_kv(other, 3))


def test_layout_from_kv_caches() -> None:
    assert BlockLayout.from_kv_caches(make_kv(LAYOUT, 5)) == LAYOUT


@pytest.mark.parametrize(
    ("block_ids", "rows"),
    [
        ([2, 3, 4], [0, 1, 2]),  # one run: slice copies
        ([7, 1, 5, 0, 3, 6], [4, 0, 9, 2, 7, 5]),  # scattered: index ops
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("contiguous", [True, False], ids=["numpy-path", "torch-path"])
def test_gather_then_scatter_round_trips(
    block_ids: list[int], rows: list[int], dtype: torch.dtype, contiguous: bool
) -> None:
    layout = BlockLayout(3, 4, 2, 8, dtype)
    kv = make_kv(layout, 8, contiguous=contiguous)
    assert all(k.is_contiguous() == contiguous for k, _ in kv)
    out = torch.zeros((10, layout.block_bytes), dtype=torch.uint8)
    gather_blocks(kv, block_ids, out, rows)
    typed = layout.typed(out)
    for layer, (k, v) in enumerate(kv):
        for b, r in zip(block_ids, rows, strict=True):
            assert torch.equal(typed[r, layer, 0], k[b])
            assert torch.equal(typed[r, layer, 1], v[b])
    untouched = [r for r in range(10) if r not in rows]
    assert not out[untouched].any()

    dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in kv]
    scatter_blocks(dst, block_ids, out, rows)
    for (k, v), (k2, v2) in zip(kv, dst, strict=True):
        assert torch.equal(k2[block_ids], k[block_ids])
        assert torch.equal(v2[block_ids], v[block_ids])
        others = [b for b in range(8) if b not in block_ids]
        assert not k2[others].any() and not v2[others].any()


def test_gather_rejects_mismatched_rows() -> None:
    out = torch.zeros((4, LAYOUT.block_bytes), dtype=torch.uint8)
    with pytest.raises(ValueError, match="2 block ids but 1 output rows"):
        gather_blocks(make_kv(LAYOUT, 4), [0, 1], out, [0])
    with pytest.raises(ValueError, match="uint8"):
        gather_blocks(make_kv(LAYOUT, 4), [0], out.view(torch.float16), [0])
    with pytest.raises(ValueError, match="block ids out of range"):
        gather_blocks(make_kv(LAYOUT, 4), [-1], out, [0])
    with pytest.raises(ValueError, match="source rows out of range"):
        scatter_blocks(make_kv(LAYOUT, 4), [0], out, [4])


# -- pool --------------------------------------------------------------------


def test_slots_are_fixed_offsets_in_one_buffer() -> None:
    pool = DramPool(LAYOUT, 4, pin_memory=False)
    assert pool.buffer.numel() == 4 * LAYOUT.block_bytes
    slot = fill(pool, h(1), 7)
    off = pool.slot_offset(slot)
    assert off == slot * LAYOUT.block_bytes
    assert bool((pool.buffer[off : off + LAYOUT.block_bytes] == 7).all())
    with pytest.raises(ValueError, match="out of range"):
        pool.slot_offset(4)


def test_pending_block_is_invisible_until_commit() -> None:
    pool = DramPool(LAYOUT, 2, pin_memory=False)
    slot = pool.allocate(h(1))
    assert slot == 0
    assert not pool.contains(h(1)) and pool.has(h(1))
    assert pool.lease([h(1)], "peer") is None
    with pytest.raises(ValueError, match="already in the pool"):
        pool.allocate(h(1))
    pool.check_integrity()
    pool.abort(slot)
    assert not pool.has(h(1)) and pool.num_free == 2
    fill(pool, h(1), 1)
    assert pool.get_slot(h(1)) is not None
    pool.check_integrity()


def test_eviction_takes_least_recently_used_with_bytes_intact() -> None:
    seen: list[tuple[bytes, int, bool, int]] = []
    pool = DramPool(LAYOUT, 3, pin_memory=False)
    pool.on_removed = lambda bh, slot, evicted: seen.append(
        (bh, slot, evicted, int(pool.slot(slot)[0]))
    )
    for i in range(3):
        fill(pool, h(i), 10 + i)
    pool.touch([h(0)])  # order now 1, 2, 0
    fill(pool, h(3), 13)
    assert seen == [(h(1), 1, True, 11)]
    fill(pool, h(4), 14)
    assert seen[-1] == (h(2), 2, True, 12)
    assert [pool.contains(h(i)) for i in range(5)] == [True, False, False, True, True]
    assert pool.num_evictions == 2
    assert pool.cached_hashes() == [h(0), h(3), h(4)]
    pool.check_integrity()


def test_leased_slot_is_neither_evicted_nor_overwritten() -> None:
    pool = DramPool(LAYOUT, 2, pin_memory=False)
    fill(pool, h(0), 1)
    fill(pool, h(1), 2)
    lease = pool.lease([h(0), h(1)], "peer-a")
    assert lease is not None and lease.slot_ids == (0, 1)
    assert pool.allocate(h(2)) is None  # a shortage, not an error
    assert pool.release(lease)
    # Released in prefix order: h(0) is least recent again and goes first.
    assert pool.allocate(h(2)) == 0
    pool.check_integrity()


def test_lease_covers_the_longest_present_prefix() -> None:
    pool = DramPool(LAYOUT, 4, pin_memory=False)
    fill(pool, h(0), 1)
    fill(pool, h(1), 2)
    lease = pool.lease([h(0), h(1), h(9), h(0)], "peer")
    assert lease is not None and lease.hashes == (h(0), h(1))
    assert pool.lease([h(9), h(0)], "peer") is None
    assert pool.num_leased_slots == 2


def test_removed_while_leased_frees_only_after_release() -> None:
    pool = DramPool(LAYOUT, 1, pin_memory=False)
    fill(pool, h(0), 5)
    lease = pool.lease([h(0)], "reader")
    assert lease is not None
    assert pool.remove(h(0))
    assert not pool.contains(h(0))
    assert pool.allocate(h(1)) is None  # the reader still reads slot 0
    assert bool((pool.slot(0) == 5).all())
    pool.check_integrity()
    assert pool.release(lease)
    assert pool.allocate(h(1)) == 0
    pool.check_integrity()


def test_expired_lease_is_reaped_and_its_release_reports_it() -> None:
    clock = ManualClock()
    pool = DramPool(LAYOUT, 1, pin_memory=False, clock=clock, lease_timeout_s=5.0)
    fill(pool, h(0), 1)
    lease = pool.lease([h(0)], "dead-peer")
    assert lease is not None
    clock.now += 4.0
    assert pool.allocate(h(1)) is None  # not expired yet
    clock.now += 2.0
    assert pool.allocate(h(1)) == 0  # reaped, then evicted
    assert pool.num_expired_leases == 1
    assert not pool.release(lease)  # the reader must discard what it read
    pool.check_integrity()


def test_renew_extends_and_release_owner_ends_all() -> None:
    clock = ManualClock()
    pool = DramPool(LAYOUT, 3, pin_memory=False, clock=clock, lease_timeout_s=5.0)
    for i in range(3):
        fill(pool, h(i), i)
    a = pool.lease([h(0)], "peer-a")
    b = pool.lease([h(1)], "peer-a")
    c = pool.lease([h(2)], "peer-b")
    assert a is not None and b is not None and c is not None
    clock.now += 4.0
    assert pool.renew(c, 5.0)
    clock.now += 2.0
    assert pool.reap_expired() == 2
    assert pool.num_leases == 1
    assert pool.release_owner("peer-b") == 1
    assert not pool.renew(c)
    assert pool.num_leased_slots == 0
    pool.check_integrity()


def test_clear_and_counts() -> None:
    pool = DramPool(LAYOUT, 4, pin_memory=False)
    for i in range(3):
        fill(pool, h(i), i)
    lease = pool.lease([h(1)], "x")
    assert lease is not None
    assert pool.clear() == 3
    assert pool.num_cached == 0 and pool.num_dead == 1 and pool.num_free == 3
    pool.release(lease)
    assert pool.num_free == 4
    pool.check_integrity()


def test_integrity_check_catches_corruption() -> None:
    pool = DramPool(LAYOUT, 2, pin_memory=False)
    fill(pool, h(0), 1)
    pool._free.append(0)  # a cached slot on the free list
    with pytest.raises(RuntimeError, match="free slots"):
        pool.check_integrity()


def test_pin_memory_without_cuda_is_a_caller_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ValueError, match="needs CUDA"):
        DramPool(LAYOUT, 1, pin_memory=True)


def test_slots_in_shared_memory_are_readable_from_another_process() -> None:
    size = 3 * LAYOUT.block_bytes
    fd = os.memfd_create("dram-test")
    try:
        os.ftruncate(fd, size)
        shared = mmap.mmap(fd, size)
        pool = DramPool(LAYOUT, 3, pin_memory=False, backing=shared)
        fill(pool, h(0), 0x11)
        slot = fill(pool, h(1), 0xAB)
        assert shared[pool.slot_offset(slot)] == 0xAB  # the pool writes in place
        reader = (
            "import sys; f = open(sys.argv[1], 'rb'); f.seek(int(sys.argv[2]));"
            "sys.stdout.write(f.read(int(sys.argv[3])).hex())"
        )
        args = [
            f"/proc/{os.getpid()}/fd/{fd}",
            str(pool.slot_offset(slot)),
            str(LAYOUT.block_bytes),
        ]
        out = subprocess.run(
            [sys.executable, "-c", reader, *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
        assert bytes.fromhex(out) == b"\xab" * LAYOUT.block_bytes
        pool.close()
        with pytest.raises(ValueError, match="need 1536"):
            DramPool(LAYOUT, 3, pin_memory=False, backing=bytearray(size - 1))
    finally:
        os.close(fd)
