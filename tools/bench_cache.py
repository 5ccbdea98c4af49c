"""Benchmark of the KV block cache's host tiers, each against a plain baseline.

    python tools/bench_cache.py                  # everything, default sizes
    python tools/bench_cache.py --quick          # smaller sizes, fewer repeats
    python tools/bench_cache.py --skip-mooncake  # without the Mooncake Store anchor
    python tools/bench_cache.py --sections 4     # only the TTFT per tier

Sections, each printed side by side with its baseline and the ratio:

1. DRAM tier: blocks from a (CPU) device KV cache into DRAM slots and back,
   through ``TieredStore.offload`` / ``load`` and through the bare
   ``gather_blocks`` / ``scatter_blocks``, vs a plain memcpy of the same bytes.
2. SSD tier: ``SsdTier.put`` (+ fdatasync) and ``get`` (page cache dropped,
   CRC checked) vs plain ``pwrite`` (+ fdatasync) and ``pread`` of the same
   bytes in the same block-sized pieces; and SSD -> DRAM -> device through
   ``TieredStore.load``.
3. 1 MiB put/get: our DRAM tier vs Mooncake Store (``mooncake_master`` plus
   ``MooncakeDistributedStore``, TCP protocol, loopback), run in the anchor
   venv that ``tools/mooncake_anchor.sh`` installs.
4. TTFT per tier: two in-process daemons (a holder with DRAM and SSD tiers, a
   reader that lists it as a peer) on loopback. Each round takes a fresh
   prompt of ``--ttft-tokens`` whose first 90% is a shared prefix and times a
   one-token completion served with the prefix from each tier: computed
   (cold), the device prefix cache, DRAM (device cache reset first), SSD
   (device cache reset, DRAM cleared, slab file evicted from the page cache),
   and a peer's DRAM (a reader pulls it over shared memory, another over
   TCP); each against the cold run of the same prompt length.

Every figure is the median of ``--repeats`` runs, ours and the baseline run in
turn. The machine is shared: compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mooncakectl.bench.anchors import anchor_process_env, anchor_values, anchor_venv, stop
from mooncakectl.local.plan import free_port
from mooncaked.cache.dram import BlockLayout, gather_blocks, scatter_blocks
from mooncaked.cache.ssd import SsdTier
from mooncaked.cache.store import DeviceBlocks, TieredStore
from mooncaked.config import StoreConfig

GB = 1e9
MiB = 1 << 20


@dataclass(slots=True)
class Row:
    what: str
    nbytes: int
    ours_s: float
    base_name: str
    base_s: float

    def line(self) -> str:
        ours = self.nbytes / self.ours_s / GB
        base = self.nbytes / self.base_s / GB
        return (
            f"{self.what:<34} {self.nbytes / MiB:>7.0f} MiB {ours:>8.2f} GB/s   "
            f"{self.base_name:<30} {base:>8.2f} GB/s   x{ours / base:>5.2f}"
        )


HEADER = (
    f"{'what':<34} {'bytes':>11} {'ours':>13}   {'baseline':<30} {'':>13}   ratio\n" + "-" * 112
)


def hashes_for(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest() for i in range(n)]


async def pairs(
    repeats: int,
    ours: Callable[[], Awaitable[float]],
    base: Callable[[], Awaitable[float]],
) -> tuple[float, float]:
    """Median seconds of ours and of the baseline, run in turn."""
    a: list[float] = []
    b: list[float] = []
    for _ in range(repeats):
        a.append(await ours())
        b.append(await base())
    return statistics.median(a), statistics.median(b)


async def timed_all(ops: Callable[[], Awaitable[list[bool]]], failed: str) -> float:
    """Seconds ``ops()`` took; RuntimeError ``failed`` unless every op succeeded."""
    t0 = time.perf_counter()
    ok = await ops()
    dt = time.perf_counter() - t0
    if not all(ok):
        raise RuntimeError(failed)
    return dt


def timed_sync(fn: Callable[[], Any]) -> Callable[[], Awaitable[float]]:
    async def run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return run


def make_kv(layout: BlockLayout, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    kv = []
    for i in range(layout.num_layers):
        k = torch.empty(shape, dtype=layout.dtype).fill_(i)
        v = torch.empty(shape, dtype=layout.dtype).fill_(-i)
        kv.append((k, v))
    return kv


# -- 1. DRAM -------------------------------------------------------------------


async def bench_dram(layout: BlockLayout, n: int, repeats: int) -> list[Row]:
    nbytes = n * layout.block_bytes
    kv = make_kv(layout, 2 * n)
    # Scattered block ids, as a long-running engine's block tables are.
    g = torch.Generator().manual_seed(0)
    src_ids = torch.randperm(2 * n, generator=g)[:n].tolist()
    dst_ids = torch.randperm(2 * n, generator=g)[:n].tolist()
    kv_dst = make_kv(layout, 2 * n)
    plain_src = torch.ones(nbytes, dtype=torch.uint8)
    plain_dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)

    def memcpy() -> None:
        plain_dst.copy_(plain_src)

    store = TieredStore(layout, StoreConfig(dram_bytes=nbytes, ssd_path=""), pin_memory=False)
    await store.start()
    store.dram.slots.fill_(0)  # touch the pages once, as a running daemon has
    hashes = hashes_for("dram", n)
    rows: list[Row] = []
    try:

        async def offload() -> float:
            store.dram.clear()
            t0 = time.perf_counter()
            fut = store.offload(hashes, DeviceBlocks(kv, src_ids))
            if fut is None or await fut != n:
                raise RuntimeError("offload did not store every block")
            return time.perf_counter() - t0

        ours, base = await pairs(repeats, offload, timed_sync(memcpy))
        rows.append(Row("DRAM put: store.offload", nbytes, ours, "memcpy", base))

        async def load() -> float:
            t0 = time.perf_counter()
            if await store.load(hashes, DeviceBlocks(kv_dst, dst_ids)) != n:
                raise RuntimeError("load did not find every block")
            return time.perf_counter() - t0

        ours, base = await pairs(repeats, load, timed_sync(memcpy))
        rows.append(Row("DRAM get: store.load", nbytes, ours, "memcpy", base))
        if not all(
            torch.equal(k[src_ids], k2[dst_ids]) for (k, _), (k2, _) in zip(kv, kv_dst, strict=True)
        ):
            raise RuntimeError("loaded blocks differ from the offloaded ones")

        slots = list(range(n))
        ours, base = await pairs(
            repeats,
            timed_sync(lambda: gather_blocks(kv, src_ids, store.dram.slots, slots)),
            timed_sync(memcpy),
        )
        rows.append(Row("  gather_blocks (scattered ids)", nbytes, ours, "memcpy", base))
        ours, base = await pairs(
            repeats,
            timed_sync(lambda: gather_blocks(kv, list(range(n)), store.dram.slots, slots)),
            timed_sync(memcpy),
        )
        rows.append(Row("  gather_blocks (contiguous ids)", nbytes, ours, "memcpy", base))
        ours, base = await pairs(
            repeats,
            timed_sync(lambda: scatter_blocks(kv_dst, dst_ids, store.dram.slots, slots)),
            timed_sync(memcpy),
        )
        rows.append(Row("  scatter_blocks (scattered ids)", nbytes, ours, "memcpy", base))
    finally:
        await store.close()
    return rows


# -- 2. SSD --------------------------------------------------------------------


def drop_cache(path: Path) -> None:
    """Write back, then evict a file's pages so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def bench_ssd(layout: BlockLayout, n: int, repeats: int, workdir: Path) -> list[Row]:
    bb = layout.block_bytes
    nbytes = n * bb
    src = torch.randint(0, 256, (n, bb), dtype=torch.uint8)
    out = torch.empty((n, bb), dtype=torch.uint8)
    plain = workdir / "plain.bin"
    loop = asyncio.get_running_loop()

    def plain_write() -> None:
        fd = os.open(plain, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for i in range(n):
                mv = memoryview(src[i].numpy())
                done = 0
                while done < bb:
                    done += os.pwrite(fd, mv[done:], i * bb + done)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def plain_read() -> None:
        fd = os.open(plain, os.O_RDONLY)
        try:
            for i in range(n):
                mv = memoryview(out[i].numpy())
                got = 0
                while got < bb:
                    got += os.preadv(fd, [mv[got:]], i * bb + got)
        finally:
            os.close(fd)

    async def plain_write_timed() -> float:
        t0 = time.perf_counter()
        await loop.run_in_executor(None, plain_write)
        return time.perf_counter() - t0

    async def plain_read_timed() -> float:
        drop_cache(plain)
        t0 = time.perf_counter()
        await loop.run_in_executor(None, plain_read)
        return time.perf_counter() - t0

    ssd_dir = workdir / "ssd"
    tier = SsdTier(ssd_dir, bb, n, io_threads=4)
    await tier.open()
    hashes = hashes_for("ssd", n)
    rows: list[Row] = []
    try:

        async def put_all() -> list[bool]:
            ok = await asyncio.gather(*(tier.put(h, src[i]) for i, h in enumerate(hashes)))
            await tier.sync()
            return ok

        async def put() -> float:
            await tier.clear()
            return await timed_all(put_all, "SSD put refused a block")

        ours, base = await pairs(repeats, put, plain_write_timed)
        rows.append(Row("SSD put (+fdatasync)", nbytes, ours, "plain pwrite (+fdatasync)", base))

        async def get_all() -> list[bool]:
            return await asyncio.gather(*(tier.get(h, out[i]) for i, h in enumerate(hashes)))

        async def get() -> float:
            drop_cache(ssd_dir / "slab.bin")
            return await timed_all(get_all, "SSD get failed a block")

        ours, base = await pairs(repeats, get, plain_read_timed)
        rows.append(Row("SSD get (cold, CRC checked)", nbytes, ours, "plain pread (cold)", base))
        if not torch.equal(out, src):
            raise RuntimeError("SSD get returned other bytes")
    finally:
        await tier.close()

    # SSD -> DRAM -> device through the store, blocks only on the SSD.
    store_dir = workdir / "store"
    cfg = StoreConfig(
        dram_bytes=nbytes,
        ssd_path=str(store_dir),
        ssd_bytes=n * SsdTier.stride_for(bb),
        ssd_write_queue=max(64, n),
    )
    store = TieredStore(layout, cfg, pin_memory=False)
    await store.start()
    try:
        kv = make_kv(layout, n)
        fut = store.offload(hashes, DeviceBlocks(kv, list(range(n))))
        if fut is None or await fut != n:
            raise RuntimeError("offload did not store every block")
        await store.flush()
        kv_dst = make_kv(layout, n)

        async def load() -> float:
            store.dram.clear()
            drop_cache(store_dir / "slab.bin")
            t0 = time.perf_counter()
            if await store.load(hashes, DeviceBlocks(kv_dst, list(range(n)))) != n:
                raise RuntimeError("load from SSD came up short")
            return time.perf_counter() - t0

        ours, base = await pairs(repeats, load, plain_read_timed)
        rows.append(Row("SSD->device: store.load (cold)", nbytes, ours, "plain pread (cold)", base))
    finally:
        await store.close()
    return rows


# -- 3. 1 MiB put/get vs Mooncake Store ----------------------------------------

ONE_MIB_LAYOUT = BlockLayout(16, 16, 8, 128, torch.bfloat16)  # exactly 1 MiB per block

MOONCAKE_CHILD = r"""
import ctypes, json, os, statistics, sys, time
from mooncake.store import MooncakeDistributedStore
port, n, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
size = 1 << 20
s = MooncakeDistributedStore()
# Room for every round: a removed key stays until its read lease ends, and a
# full segment would evict keys before they are read back.
rc = s.setup("127.0.0.1", "P2PHANDSHAKE", (repeats + 2) * n * size, 2 * n * size,
             "tcp", "", f"127.0.0.1:{port}")
if rc != 0:
    print(json.dumps({"error": f"setup returned {rc}"})); sys.exit(0)
src = bytearray(os.urandom(n * size)); dst = bytearray(n * size)
sa = ctypes.addressof((ctypes.c_char * len(src)).from_buffer(src))
da = ctypes.addressof((ctypes.c_char * len(dst)).from_buffer(dst))
if s.register_buffer(sa, len(src)) or s.register_buffer(da, len(dst)):
    print(json.dumps({"error": "register_buffer failed"})); sys.exit(0)
puts, gets = [], []
for r in range(repeats + 1):  # the first round warms the segment's pages
    keys = [f"r{r}-{i}" for i in range(n)]
    t0 = time.perf_counter()
    for i, k in enumerate(keys):
        rc = s.put_from(k, sa + i * size, size)
        if rc != 0:
            print(json.dumps({"error": f"put_from returned {rc}"})); sys.exit(0)
    t1 = time.perf_counter()
    for i, k in enumerate(keys):
        rc = s.get_into(k, da + i * size, size)
        if rc != size:
            print(json.dumps({"error": f"get_into returned {rc}"})); sys.exit(0)
    t2 = time.perf_counter()
    if src != dst:
        print(json.dumps({"error": "get_into returned other bytes"})); sys.exit(0)
    for k in keys:
        s.remove(k)
    if r:
        puts.append(t1 - t0); gets.append(t2 - t1)
s.close()
print(json.dumps({"put_s": statistics.median(puts), "get_s": statistics.median(gets)}))
"""


def anchor_env() -> tuple[dict[str, str] | None, str]:
    """Environment to run the Mooncake anchor, or None and why not."""
    values, why = anchor_values()
    if values is None:
        return None, why
    python = Path(values.get("MOONCAKE_ANCHOR_VENV", str(anchor_venv()))) / "bin" / "python"
    master = python.parent / "mooncake_master"
    if not python.exists() or not master.exists():
        return None, f"{python} or {master} is missing: rerun tools/mooncake_anchor.sh"
    env = anchor_process_env(values)
    env["MOONCAKE_PYTHON"] = str(python)
    env["MOONCAKE_MASTER"] = str(master)
    return env, ""


def wait_port(port: int, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return True
        time.sleep(0.1)
    return False


def run_mooncake(n: int, repeats: int, memcpy: bool) -> tuple[dict[str, Any] | None, str]:
    import json

    env, why = anchor_env()
    if env is None:
        return None, why
    # On one host the Store copies local segments with memcpy unless told not
    # to; MC_STORE_MEMCPY=0 makes it go through its TCP transport.
    env["MC_STORE_MEMCPY"] = "1" if memcpy else "0"
    port = free_port()
    master = subprocess.Popen(
        [env["MOONCAKE_MASTER"], f"-rpc_port={port}", f"-metrics_port={free_port()}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        if not wait_port(port, 30):
            return None, "mooncake_master did not listen within 30 s"
        try:
            done = subprocess.run(
                [env["MOONCAKE_PYTHON"], "-c", MOONCAKE_CHILD, str(port), str(n), str(repeats)],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
        except subprocess.TimeoutExpired:
            return None, "the Mooncake Store client ran past 300 s"
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return None, f"the Mooncake Store client exited {done.returncode}: {' | '.join(tail)}"
        result = json.loads(lines[-1])
        if "error" in result:
            return None, str(result["error"])
        return result, ""
    finally:
        stop(master, 10)


async def bench_one_mib(n: int, repeats: int) -> tuple[float, float]:
    """Median seconds for n sequential 1 MiB puts and gets through our DRAM tier."""
    layout = ONE_MIB_LAYOUT
    store = TieredStore(
        layout, StoreConfig(dram_bytes=n * layout.block_bytes, ssd_path=""), pin_memory=False
    )
    await store.start()
    src = torch.randint(0, 256, (n, layout.block_bytes), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    store.dram.slots.fill_(0)
    puts: list[float] = []
    gets: list[float] = []
    try:
        for r in range(repeats + 1):
            hashes = hashes_for(f"1mib-{r}", n)
            t0 = time.perf_counter()
            for i, h in enumerate(hashes):
                fut = store.offload([h], src[i : i + 1])
                if fut is None or await fut != 1:
                    raise RuntimeError("1 MiB offload failed")
            t1 = time.perf_counter()
            for i, h in enumerate(hashes):
                if await store.load([h], dst[i : i + 1]) != 1:
                    raise RuntimeError("1 MiB load failed")
            t2 = time.perf_counter()
            if not torch.equal(src, dst):
                raise RuntimeError("1 MiB load returned other bytes")
            store.dram.clear()
            if r:
                puts.append(t1 - t0)
                gets.append(t2 - t1)
    finally:
        await store.close()
    return statistics.median(puts), statistics.median(gets)


def one_mib_line(what: str, n: int, put_s: float, get_s: float) -> str:
    nbytes = n * MiB
    return (
        f"{what:<44} put {nbytes / put_s / GB:>6.2f} GB/s {put_s / n * 1e6:>8.0f} us/op   "
        f"get {nbytes / get_s / GB:>6.2f} GB/s {get_s / n * 1e6:>8.0f} us/op"
    )


# -- 4. TTFT per tier -------------------------------------------------------------

# (what serves the prefix, which node is asked)
TTFT_CASES = (
    ("recompute (cold)", "holder"),
    ("device prefix cache", "holder"),
    ("DRAM (device reset)", "holder"),
    ("SSD (device reset, DRAM cleared)", "holder"),
    ("peer DRAM over shm", "shm"),
    ("peer DRAM over tcp", "tcp"),
)


async def bench_ttft(args: argparse.Namespace, workdir: Path) -> None:
    import aiohttp

    from mooncaked.config import Config, LogConfig, with_overrides
    from mooncaked.daemon import Node
    from mooncaked.log import configure_logging

    configure_logging(LogConfig(level="warning", format="console"), "bench")
    block = 16
    total = args.ttft_tokens
    prefix_len = (total * 9 // 10) // block * block
    base = with_overrides(
        Config(),
        server={"port": 0},
        model={"path": args.ttft_model},
        kv={"block_size": block, "num_blocks": 4 * (total // block + 2)},
        log={"level": "warning", "format": "console"},
    )
    holder = Node(
        with_overrides(
            base,
            store={
                "dram_bytes": 512 * MiB,
                "ssd_path": str(workdir / "ttft-ssd"),
                "ssd_bytes": 2048 * MiB,
                "ssd_write_queue": 4096,
            },
        )
    )
    await holder.start()
    readers: dict[str, Node] = {}
    try:
        for transport in ("shm", "tcp"):
            readers[transport] = Node(
                with_overrides(
                    base,
                    store={"dram_bytes": 512 * MiB, "peers": [holder.url]},
                    transfer={"transports": [transport] if transport == "tcp" else ["shm", "tcp"]},
                )
            )
            await readers[transport].start()
        engine = holder.engine
        hstore = holder.store
        if engine is None or hstore is None:
            raise RuntimeError("the holder came up without its engine or store")
        vocab = engine.loaded.arch.vocab_size
        print(
            f"model {args.ttft_model}, prompt {total} tokens, cached prefix {prefix_len} "
            f"({100 * prefix_len / total:.0f}%), block {hstore.block_bytes / 1024:.0f} KiB, "
            f"median of {args.repeats}",
            flush=True,
        )
        times: dict[str, list[float]] = {name: [] for name, _ in TTFT_CASES}
        cached: dict[str, set[int]] = {name: set() for name, _ in TTFT_CASES}
        g = torch.Generator().manual_seed(1234)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:

            async def ttft(node: Node, ids: list[int]) -> tuple[float, int]:
                body = {"prompt": ids, "max_tokens": 1, "temperature": 0}
                t0 = time.perf_counter()
                async with http.post(node.url + "/v1/completions", json=body) as r:
                    out = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"completion failed: {out}")
                took = time.perf_counter() - t0
                return took, int(out["usage"]["prompt_tokens_details"]["cached_tokens"])

            def tokens(n: int) -> list[int]:
                return torch.randint(1, vocab, (n,), generator=g).tolist()

            # Untimed rounds: first-call costs (allocations, kernels) out of the way.
            for _ in range(2):
                for node in (holder, *readers.values()):
                    await ttft(node, tokens(total))
            slab = workdir / "ttft-ssd" / "slab.bin"
            for _ in range(args.repeats):
                prefix = tokens(prefix_len)
                for name, where in TTFT_CASES:
                    node = readers.get(where, holder)
                    await hstore.flush()
                    if name.startswith("DRAM") or name.startswith("SSD"):
                        engine.reset_prefix_cache()
                    if name.startswith("SSD"):
                        hstore.dram.clear()
                        # From the disk, not from the page cache.
                        drop_cache(slab)
                    took, hit = await ttft(node, prefix + tokens(total - prefix_len))
                    times[name].append(took)
                    cached[name].add(hit)
        cold = statistics.median(times[TTFT_CASES[0][0]])
        print(f"{'prefix served from':<34} {'TTFT':>10}   {'cached tokens':>13}   vs recompute")
        print("-" * 78)
        for name, _ in TTFT_CASES:
            med = statistics.median(times[name])
            hits = ",".join(str(h) for h in sorted(cached[name]))
            print(
                f"{name:<34} {med * 1000:>8.1f}ms   {hits:>13}   x{cold / med:>5.2f} faster",
                flush=True,
            )
        for transport, reader in readers.items():
            fetch = reader.peer_fetcher.stats() if reader.peer_fetcher else None
            moved = reader.transfer.metrics() if reader.transfer else None
            if fetch is not None and moved is not None:
                print(
                    f"reader ({transport}): peer fetches {fetch.ok} ok, {fetch.failed} failed, "
                    f"{fetch.blocks} blocks; bytes by transport {moved.bytes_by_transport}"
                )
    finally:
        for reader in readers.values():
            await reader.stop()
        await holder.stop()


# -- main ----------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, 3 repeats")
    p.add_argument("--repeats", type=int, default=0, help="runs per figure (default 5, quick 3)")
    p.add_argument("--dram-blocks", type=int, default=0, help="blocks per DRAM run (default 128)")
    p.add_argument("--ssd-blocks", type=int, default=0, help="blocks per SSD run (default 64)")
    p.add_argument("--one-mib-ops", type=int, default=0, help="1 MiB ops per run (default 64)")
    p.add_argument("--dir", default="", help="where SSD files go (default: a temp dir)")
    p.add_argument("--skip-mooncake", action="store_true", help="skip the Mooncake Store anchor")
    p.add_argument(
        "--sections", default="1,2,3,4,5", help="which sections to run, e.g. 5 or 1,2 (default all)"
    )
    p.add_argument("--ttft-model", default="builtin:tiny", help="model of section 4")
    p.add_argument(
        "--ttft-tokens", type=int, default=0, help="prompt tokens in section 4 (default 2048)"
    )
    args = p.parse_args(argv)
    try:
        args.sections = {int(x) for x in args.sections.split(",") if x.strip()}
    except ValueError:
        p.error(f"--sections must be numbers 1-5 separated by commas, got {args.sections!r}")
    args.ttft_tokens = args.ttft_tokens or (1024 if args.quick else 2048)
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.dram_blocks = args.dram_blocks or (16 if args.quick else 128)
    args.ssd_blocks = args.ssd_blocks or (8 if args.quick else 64)
    args.one_mib_ops = args.one_mib_ops or (16 if args.quick else 64)
    return args


async def main_async(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    # A Llama-3-8B block: 32 layers, 8 KV heads of 128, bf16, 16 tokens = 2 MiB.
    layout = BlockLayout(32, 16, 8, 128, torch.bfloat16)
    print(
        f"# block: {layout.num_layers} layers x K,V x {layout.block_size} tokens x "
        f"{layout.num_kv_heads} heads x {layout.head_dim} ({layout.dtype}) = "
        f"{layout.block_bytes / MiB:.1f} MiB; median of {args.repeats}; "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )
    if 1 in args.sections:
        print("\n## 1. DRAM tier vs memcpy\n" + HEADER, flush=True)
        for row in await bench_dram(layout, args.dram_blocks, args.repeats):
            print(row.line(), flush=True)

    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-cache-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        if 2 in args.sections:
            print("\n## 2. SSD tier vs plain file I/O\n" + HEADER, flush=True)
            for row in await bench_ssd(layout, args.ssd_blocks, args.repeats, workdir):
                print(row.line(), flush=True)
        if 3 in args.sections:
            await section_one_mib(args)
        if 4 in args.sections:
            print("\n## 4. TTFT of a prompt with a 90% prefix hit, per tier", flush=True)
            await bench_ttft(args, workdir)
        if 5 in args.sections:
            from bench_peer_read import peer_read_section

            await peer_read_section(args.repeats * 4)
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


async def section_one_mib(args: argparse.Namespace) -> None:
    n = args.one_mib_ops
    print(f"\n## 3. 1 MiB put/get, {n} sequential ops, vs Mooncake Store (loopback)", flush=True)
    put_s, get_s = await bench_one_mib(n, args.repeats)
    print(one_mib_line("ours: DRAM tier (offload / load)", n, put_s, get_s), flush=True)
    if args.skip_mooncake:
        print("mooncake: skipped (--skip-mooncake)")
        return
    for memcpy, label in ((True, "local memcpy path"), (False, "MC_STORE_MEMCPY=0, TCP")):
        result, why = await asyncio.to_thread(run_mooncake, n, args.repeats, memcpy)
        what = f"Mooncake Store put_from/get_into ({label})"
        if result is None:
            print(f"{what}: not run: {why}", flush=True)
            continue
        print(one_mib_line(what, n, result["put_s"], result["get_s"]), flush=True)
        print(
            f"{'':<44} ours/Mooncake: put x{result['put_s'] / put_s:.2f}, "
            f"get x{result['get_s'] / get_s:.2f}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
