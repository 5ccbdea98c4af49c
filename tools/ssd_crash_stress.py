"""SIGKILL stress of the SSD tier: an acknowledged put must survive a kill at any instant.

    python tools/ssd_crash_stress.py --cycles 400
    python tools/ssd_crash_stress.py --cycles 30 --seed 7 --dir /var/tmp/stress

Each cycle starts a writer process on the same tier directory and kills it with
SIGKILL at a random instant. The writer first opens the tier (recovering what
the previous writer's death left: it never closes cleanly) and checks it:

- every block the parent knows must be there (acknowledged by an earlier
  writer and not evicted since) is indexed and read back with exactly the
  bytes written under its hash; a block that is not is *lost*;
- every block the tier indexes is read: bytes that differ from the ones
  written under its hash are *corrupt served* (a failed CRC is *dropped*,
  which is allowed: the tier never serves it).

Then it puts new blocks with many puts in flight, into a small slab (LRU
evictions on nearly every put) with a small log threshold (compactions every
few dozen puts), and tells the parent of each put once acknowledged and of
each eviction. The eviction notice comes from ``on_removed``, which the tier
calls before it writes the REMOVE record, so the parent never expects a block
whose removal could already be on disk.

The parent kills the writer after a random number of acknowledged puts plus a
random delay of up to a few milliseconds; in ``--early-kill-fraction`` of the
cycles it kills at a random instant from the start instead (import, recovery,
the check, or writing). After the last cycle it opens the tier itself and
checks it once more. A leftover ``oplog.bin.tmp`` after a kill means the writer
died with a compaction in progress (between writing the new log and renaming
it); kills in a compaction's last step (the directory fsync) are not told apart.

Exit status 0 when nothing was lost and nothing corrupt was served, 1 otherwise
(or when a writer died of anything but the SIGKILL).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mooncaked.cache.ssd import TMP_LOG_NAME, SsdTier

LAYOUT_TAG = b"crash-stress"
# Block ids of one writer start here times its cycle number: ids never repeat.
IDS_PER_CYCLE = 10_000_000


def block_hash(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def block_data(h: bytes, size: int) -> bytes:
    """What is written under ``h``: a function of the hash, so any block can be checked."""
    return hashlib.shake_256(h).digest(size)


def open_tier(args: argparse.Namespace) -> SsdTier:
    return SsdTier(
        Path(args.dir) / "ssd",
        args.block_bytes,
        args.slots,
        layout_tag=LAYOUT_TAG,
        io_threads=4,
        compact_ratio=2.0,
        compact_min_bytes=args.compact_bytes,
    )


@dataclass(slots=True)
class CheckResult:
    checked: int
    lost: list[int]
    corrupt_served: int
    dropped: int
    served: int


async def check_tier(tier: SsdTier, required: set[int]) -> CheckResult:
    """Read every indexed block; which required blocks are not served intact."""
    out = bytearray(tier.block_bytes)
    intact: set[bytes] = set()
    corrupt = dropped = served = 0
    for h in tier.hashes():
        if not await tier.get(h, out):
            dropped += 1
            continue
        served += 1
        if bytes(out) == block_data(h, tier.block_bytes):
            intact.add(h)
        else:
            corrupt += 1
    lost = [i for i in sorted(required) if block_hash(i) not in intact]
    return CheckResult(len(required), lost, corrupt, dropped, served)


# -- the writer (a child process) ---------------------------------------------


def say(line: str) -> None:
    # Unbuffered: once this returns the line is in the pipe, which outlives a kill.
    os.write(1, (line + "\n").encode())


async def writer_main(args: argparse.Namespace, required: set[int]) -> None:
    ids = {block_hash(i): i for i in required}
    writing = False

    def removed(h: bytes, evicted: bool) -> None:
        # Before the REMOVE is written (see the module docstring).
        if writing and h in ids:
            say(f"evict {ids[h]}")

    tier = open_tier(args)
    tier.on_removed = removed
    await tier.open()
    result = await check_tier(tier, required)
    for i in result.lost:
        say(f"lost {i}")
    say(
        f"checked {result.checked} served {result.served} "
        f"corrupt {result.corrupt_served} dropped {result.dropped}"
    )
    writing = True
    counter = itertools.count(args.first)
    compactions = tier.num_compactions

    async def writer() -> None:
        nonlocal compactions
        for i in counter:
            h = block_hash(i)
            ids[h] = i
            if await tier.put(h, block_data(h, args.block_bytes)):
                say(f"put {i}")
            if tier.num_compactions != compactions:
                say(f"compactions {tier.num_compactions - compactions}")
                compactions = tier.num_compactions

    await asyncio.gather(*(writer() for _ in range(args.writers)))


# -- the parent ---------------------------------------------------------------


@dataclass(slots=True)
class Totals:
    cycles: int = 0
    early_kills: int = 0
    kills_in_compaction: int = 0
    checks: int = 0
    checked: int = 0
    lost: int = 0
    corrupt_served: int = 0
    dropped: int = 0
    served: int = 0
    acked: int = 0
    compactions: int = 0
    failures: int = 0


def handle(line: str, required: set[int], totals: Totals) -> None:
    """One line of a writer's report."""
    word, *rest = line.split()
    if word == "put":
        required.add(int(rest[0]))
        totals.acked += 1
    elif word == "evict":
        required.discard(int(rest[0]))
    elif word == "compactions":
        totals.compactions += int(rest[0])
    elif word == "lost":
        # Counted once: a later check must not find it missing again.
        required.discard(int(rest[0]))
        totals.lost += 1
    elif word == "checked":
        fields = dict(zip(rest[1::2], map(int, rest[2::2]), strict=True))
        totals.checks += 1
        totals.checked += int(rest[0])
        totals.served += fields["served"]
        totals.corrupt_served += fields["corrupt"]
        totals.dropped += fields["dropped"]
    else:
        raise RuntimeError(f"a writer said {line!r}")


def run_cycle(
    args: argparse.Namespace, cycle: int, rng: random.Random, required: set[int], totals: Totals
) -> None:
    work = Path(args.dir)
    required_path = work / "required.txt"
    required_path.write_text(" ".join(map(str, sorted(required))))
    stderr_path = work / "writer.stderr"
    early = rng.random() < args.early_kill_fraction
    kill_after = rng.randint(1, args.max_puts)
    delay = rng.uniform(0.0, 1.0) if early else rng.uniform(0.0, 0.005)
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                "--dir",
                str(work),
                "--required",
                str(required_path),
                "--first",
                str(cycle * IDS_PER_CYCLE),
                "--block-bytes",
                str(args.block_bytes),
                "--slots",
                str(args.slots),
                "--compact-bytes",
                str(args.compact_bytes),
                "--writers",
                str(args.writers),
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    timed_out = threading.Event()

    def watchdog() -> None:
        timed_out.set()
        proc.send_signal(signal.SIGKILL)

    guard = threading.Timer(args.writer_timeout, watchdog)
    guard.start()
    early_timer = threading.Timer(delay, proc.send_signal, (signal.SIGKILL,))
    if early:
        early_timer.start()
    try:
        stdout: TextIO | None = proc.stdout
        if stdout is None:
            raise RuntimeError("the writer has no stdout pipe")
        acked = 0
        # Read to the end: what the writer said before it died is still in the pipe.
        for line in stdout:
            handle(line, required, totals)
            if not early and line.startswith("put "):
                acked += 1
                if acked == kill_after:
                    time.sleep(delay)
                    proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        guard.cancel()
        early_timer.cancel()
        if proc.returncode is None:
            proc.kill()
            proc.wait()
    totals.cycles += 1
    totals.early_kills += early
    if (work / "ssd" / TMP_LOG_NAME).exists():
        totals.kills_in_compaction += 1
    if timed_out.is_set() or proc.returncode != -signal.SIGKILL:
        totals.failures += 1
        why = "hung" if timed_out.is_set() else f"exited with {proc.returncode}"
        tail = stderr_path.read_text(errors="replace")[-2000:]
        print(f"cycle {cycle}: the writer {why}\n{tail}", file=sys.stderr)


async def final_check(args: argparse.Namespace, required: set[int], totals: Totals) -> None:
    tier = open_tier(args)
    await tier.open()
    result = await check_tier(tier, required)
    tier.check_integrity()
    await tier.close()
    totals.checks += 1
    totals.checked += result.checked
    totals.lost += len(result.lost)
    totals.corrupt_served += result.corrupt_served
    totals.dropped += result.dropped
    totals.served += result.served
    if result.lost:
        print(f"final check: lost blocks {result.lost[:20]}", file=sys.stderr)


def run(args: argparse.Namespace, out: TextIO) -> int:
    rng = random.Random(args.seed)
    required: set[int] = set()
    totals = Totals()
    started = time.monotonic()
    for cycle in range(1, args.cycles + 1):
        run_cycle(args, cycle, rng, required, totals)
    asyncio.run(final_check(args, required, totals))
    ok = totals.lost == 0 and totals.corrupt_served == 0 and totals.failures == 0
    print(
        f"seed: {args.seed}\n"
        f"cycles: {totals.cycles}\n"
        f"kills: {totals.cycles} ({totals.early_kills} at a random instant from the start)\n"
        f"kills during compaction: {totals.kills_in_compaction}"
        " (an oplog.bin.tmp was left behind)\n"
        f"puts acknowledged: {totals.acked}\n"
        f"compactions seen by writers: {totals.compactions}\n"
        f"checks after restart: {totals.checks}\n"
        f"acknowledged blocks checked: {totals.checked}\n"
        f"lost: {totals.lost}\n"
        f"corrupt served: {totals.corrupt_served}\n"
        f"blocks served: {totals.served}\n"
        f"dropped unserved (failed CRC): {totals.dropped}\n"
        f"writer failures: {totals.failures}\n"
        f"seconds: {time.monotonic() - started:.1f}\n"
        f"result: {'ok' if ok else 'FAILED'}",
        file=out,
    )
    return 0 if ok else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cycles", type=int, default=100, help="writers to start and kill")
    p.add_argument("--seed", type=int, default=None, help="of the kill instants (default: random)")
    p.add_argument("--dir", default=None, help="work directory (default: a fresh temp dir)")
    p.add_argument("--block-bytes", type=int, default=4000)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--compact-bytes", type=int, default=2048, help="log size before compacting")
    p.add_argument("--max-puts", type=int, default=300, help="most acknowledged puts per cycle")
    p.add_argument("--writers", type=int, default=16, help="puts in flight per writer process")
    p.add_argument("--early-kill-fraction", type=float, default=0.1)
    p.add_argument("--writer-timeout", type=float, default=60.0, help="seconds per cycle")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--required", help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("cycles", "block_bytes", "slots", "max_puts", "writers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.compact_bytes < 0:
        p.error(f"--compact-bytes must be >= 0, got {args.compact_bytes}")
    if not 0.0 <= args.early_kill_fraction <= 1.0:
        p.error(f"--early-kill-fraction must be in [0, 1], got {args.early_kill_fraction}")
    if args.writer_timeout <= 0:
        p.error(f"--writer-timeout must be > 0, got {args.writer_timeout}")
    if args.child and (args.dir is None or args.required is None):
        p.error("--child needs --dir and --required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The tier's log lines go to stderr: stdout is the report (and, for a
    # writer, the pipe the parent reads).
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    if args.child:
        required = {int(x) for x in Path(args.required).read_text().split()}
        asyncio.run(writer_main(args, required))
        return 0
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**32)
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        return run(args, sys.stdout)
    work = tempfile.mkdtemp(prefix="ssd-crash-stress-")
    args.dir = work
    try:
        return run(args, sys.stdout)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
