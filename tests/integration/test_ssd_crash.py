"""SIGKILL during heavy SSD writes, then recovery from the same path.

A child process writes blocks through the SSD tier as fast as it can (many
puts in flight, LRU evictions, log compactions) and is killed with SIGKILL
mid-way, twice (the second child recovers the first one's crash and is killed
in turn). The test then opens the same path: the index must be consistent,
every block it serves must hold exactly the bytes written under its hash, and
slots whose bytes the test flipped, and a torn record at the log's tail, are
dropped, never served.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mooncaked.cache.ssd import LOG_NAME, REC_SIZE, SLAB_NAME, SsdTier

BLOCK = 16 * 1024 + 100
SLOTS = 128
TAG = b"crash-test"

CHILD = """
import asyncio, hashlib, sys
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from mooncaked.cache.ssd import SsdTier

async def main(path, block, slots, first):
    tier = SsdTier(path, block, slots, layout_tag=b"crash-test", io_threads=4,
                   compact_min_bytes=16 * 1024)
    report = await tier.open()
    print("open", report.blocks, flush=True)
    counter = iter(range(first, first + 10**9))

    async def writer():
        for i in counter:
            h = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()
            if await tier.put(h, hashlib.shake_256(h).digest(block)):
                print("put", i, flush=True)

    await asyncio.gather(*(writer() for _ in range(16)))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
"""


def expected(block_hash: bytes) -> bytes:
    return hashlib.shake_256(block_hash).digest(BLOCK)


def run_and_kill(path: Path, first: int, num_puts: int) -> int:
    """Run a writer child until it has acknowledged num_puts puts, then SIGKILL it."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(BLOCK), str(SLOTS), str(first)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    acked = 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("put"):
                acked += 1
                if acked >= num_puts:
                    break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return acked


async def open_tier(path: Path) -> SsdTier:
    tier = SsdTier(path, BLOCK, SLOTS, layout_tag=TAG, io_threads=2)
    await tier.open()
    return tier


async def serve_all(tier: SsdTier) -> tuple[list[bytes], list[bytes]]:
    """(served, dropped): every served block must hold its own bytes."""
    served: list[bytes] = []
    dropped: list[bytes] = []
    out = bytearray(BLOCK)
    for bh in tier.hashes():
        if await tier.get(bh, out):
            assert bytes(out) == expected(bh), "served bytes that were not written under this hash"
            served.append(bh)
        else:
            dropped.append(bh)
    return served, dropped


def flip(path: Path, offset: int) -> None:
    with open(path / SLAB_NAME, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.timeout(120)
def test_sigkill_during_heavy_writes_recovers_a_consistent_index(tmp_path: Path) -> None:
    path = tmp_path / "ssd"
    # Enough puts for several evictions of the whole slab and log compactions.
    assert run_and_kill(path, 0, 3 * SLOTS) == 3 * SLOTS
    assert run_and_kill(path, 1_000_000, 3 * SLOTS) == 3 * SLOTS

    async def check() -> tuple[list[bytes], dict[bytes, int]]:
        tier = await open_tier(path)
        tier.check_integrity()
        assert tier.report.records > 0
        served, _ = await serve_all(tier)
        # The slab was full when the writer died; a recovery that lost most of
        # it would be a bug, not a crash artefact.
        assert len(served) >= SLOTS // 4
        assert tier.num_blocks == len(served)
        tier.check_integrity()
        offsets = {bh: (tier.slot_of(bh) or 0) * tier.slot_stride for bh in served}
        await tier.close()
        return served, offsets

    served, offsets = asyncio.run(check())

    victims = served[:3]
    for i, bh in enumerate(victims):
        flip(path, offsets[bh] + [0, BLOCK // 2, BLOCK - 1][i])
    torn = bytes(REC_SIZE // 2)
    with open(path / LOG_NAME, "ab") as f:
        f.write(torn)

    async def check_flipped() -> None:
        tier = await open_tier(path)
        assert tier.report.torn_tail_bytes == len(torn)
        served2, dropped = await serve_all(tier)
        assert sorted(dropped) == sorted(victims)
        assert sorted(served2) == sorted(served[3:])
        assert tier.num_corrupt == 3
        tier.check_integrity()
        await tier.close()
        # The drops were logged: the flipped blocks do not come back.
        tier = await open_tier(path)
        assert not any(tier.contains(bh) for bh in victims)
        assert tier.num_blocks == len(served) - 3
        await tier.close()

    asyncio.run(check_flipped())


# A writer whose log compaction stalls in its fsync (as on a slow or busy disk),
# while puts go on being acknowledged; the test kills it in that window.
STALLED_COMPACTION_CHILD = """
import asyncio, hashlib, os, sys, time
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from mooncaked.cache.ssd import SsdTier

def say(line):
    os.write(1, (line + "\\n").encode())

def stalled_fsync(fd):
    say("stalled")
    time.sleep(3600)

async def main(path, block):
    tier = SsdTier(path, block, 512, layout_tag=b"crash-test", io_threads=2,
                   compact_ratio=2.0, compact_min_bytes=4096,
                   on_removed=lambda h, evicted: evicted and say("evicted"))
    await tier.open()
    # Only compactions fsync while the tier runs (sync() uses fdatasync).
    os.fsync = stalled_fsync
    counter = iter(range(10**9))

    async def writer():
        for i in counter:
            h = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()
            if await tier.put(h, hashlib.shake_256(h).digest(block)):
                say(f"put {i}")
                if i % 2:
                    # Removes grow the log past its live size: a compaction starts.
                    say(f"remove {i}")
                    tier.remove(h)
            await asyncio.sleep(0.001)

    await asyncio.gather(*(writer() for _ in range(4)))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def block_hash_of(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


@pytest.mark.timeout(120)
def test_puts_acknowledged_during_a_compaction_survive_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "ssd"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-c", STALLED_COMPACTION_CHILD, str(path), str(BLOCK)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    acked: set[int] = set()
    removed: set[int] = set()
    acked_in_compaction = 0
    stalled = False
    try:
        assert proc.stdout is not None
        # Read to the end: what the writer said before it died is still in the pipe.
        for line in proc.stdout:
            word, _, arg = line.strip().partition(" ")
            if word == "stalled":
                stalled = True
            elif word == "put":
                acked.add(int(arg))
                acked_in_compaction += stalled
                if acked_in_compaction == 40:
                    proc.send_signal(signal.SIGKILL)
            elif word == "remove":
                removed.add(int(arg))
            else:
                pytest.fail(f"the writer said {line!r}: no eviction was meant to happen")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert acked_in_compaction >= 40

    async def check() -> None:
        tier = await open_tier(path)
        missing = [i for i in sorted(acked - removed) if not tier.contains(block_hash_of(i))]
        assert not missing, f"{len(missing)} acknowledged puts lost, first {missing[:5]}"
        served, dropped = await serve_all(tier)
        assert not dropped
        # More may be served: a put done but not yet reported, a block reported
        # removed just before the kill.
        assert {block_hash_of(i) for i in acked - removed} <= set(served)
        assert not (path / (LOG_NAME + ".tmp")).exists()
        tier.check_integrity()
        await tier.close()

    asyncio.run(check())
