"""Transfer engine benchmark: the counterpart of Mooncake's transfer_engine_bench.

Two processes on one host, a target that registers a buffer and serves, and an
initiator that reads (or writes) blocks of it in batches:

    python tools/transfer_bench.py target --port 17000
    python tools/transfer_bench.py initiator --target 127.0.0.1:17000 \\
        --transport tcp --op read --block-size 65536 --batch-size 128 \\
        --concurrency 2 --duration 5

``compare`` runs, in turn and several times, each of these on loopback and
prints the medians and their ratios (it starts every process itself):

    ours-tcp      our TCP transport (target + initiator processes)
    mooncake-tcp  Mooncake's own transfer_engine_bench, --protocol=tcp, when
                  tools/mooncake_anchor.sh installed it (else says why not)
    socket        a plain socket-to-socket copy of the same bytes: one
                  connection, sendall/recv_into of one block per call
    ours-shm      our shared-memory transport (target + initiator processes)
    memcpy        a plain memcpy of the same bytes, block by block

    python tools/transfer_bench.py compare --block-sizes 65536,1048576 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncakectl.bench.anchors import anchor_process_env, anchor_values, stop

# The target process imports this checkout's package, as the initiator does.
REPO_ROOT = Path(__file__).resolve().parent.parent

SECRET = b"transfer-bench-secret"
GB = 1e9  # as Mooncake's bench reports "GB/s"


def _quiet_logs() -> None:
    import structlog

    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(30),
    )


# ---------------------------------------------------------------------------
# target / initiator


async def run_target(args: argparse.Namespace) -> int:
    from mooncaked.config import TransferConfig
    from mooncaked.transfer import Access, TransferEngine

    _quiet_logs()
    config = TransferConfig(host="127.0.0.1", port=args.port, streams_per_peer=args.streams)
    engine = TransferEngine(config, "bench-target", SECRET)
    await engine.start()
    # The benchmark's clients write as well as read.
    segment = engine.allocate("bench", args.buffer_size, Access.READ_WRITE)
    assert segment.view is not None
    # Touch every page once so the first run does not pay the page faults.
    _touch(segment.view)
    print(f"target listening on {engine.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await engine.close()
    return 0


def _touch(view: memoryview) -> None:
    import numpy as np

    arr = np.frombuffer(view, dtype=np.uint8)
    arr[::4096] = 1


async def run_initiator(args: argparse.Namespace) -> dict[str, Any]:
    from mooncaked.config import TransferConfig
    from mooncaked.transfer import TransferEngine, TransferOp

    _quiet_logs()
    transports = ("tcp",) if args.transport == "tcp" else ("shm", "tcp")
    config = TransferConfig(
        host="127.0.0.1",
        transports=transports,
        streams_per_peer=args.streams,
        slice_bytes=args.slice_bytes,
    )
    span = args.block_size * args.batch_size * args.concurrency
    engine = TransferEngine(config, "bench-initiator", SECRET)
    await engine.start()
    try:
        local = engine.allocate("bench", span)
        assert local.view is not None
        _touch(local.view)
        engine.add_peer("bench-target", args.target)
        make = TransferOp.read if args.op == "read" else TransferOp.write
        batches = [
            [
                make(
                    "bench",
                    (i * args.concurrency + w) * args.block_size,
                    "bench-target",
                    "bench",
                    (i * args.concurrency + w) * args.block_size,
                    args.block_size,
                )
                for i in range(args.batch_size)
            ]
            for w in range(args.concurrency)
        ]
        # Warm up: connections, lookups, shared-memory mappings.
        for ops in batches:
            batch = await engine.submit(ops)
            if not await batch.wait():
                raise RuntimeError(f"warm-up failed: {batch.failures()[:3]}")
            used = batch.transport(0)
            if args.transport != "auto" and used != args.transport:
                raise RuntimeError(f"asked for {args.transport}, the engine chose {used}")

        moved = [0] * args.concurrency
        deadline = time.perf_counter() + args.duration

        async def worker(w: int) -> None:
            ops = batches[w]
            nbytes = args.block_size * len(ops)
            while time.perf_counter() < deadline:
                batch = await engine.submit(ops)
                if not await batch.wait():
                    raise RuntimeError(f"batch failed: {batch.failures()[:3]}")
                moved[w] += nbytes

        start = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            for w in range(args.concurrency):
                tg.create_task(worker(w))
        elapsed = time.perf_counter() - start
    finally:
        await engine.close()
    total = sum(moved)
    return {
        "gbps": total / elapsed / GB,
        "ops_per_s": total / args.block_size / elapsed,
        "bytes": total,
        "seconds": elapsed,
        "transport": used,
    }


# ---------------------------------------------------------------------------
# baselines


def run_socket_receiver(args: argparse.Namespace) -> dict[str, Any]:
    """Plain socket copy, receiving end: accept one connection, recv_into one
    block at a time into a buffer of the same span, until the sender stops."""
    span = args.block_size * args.batch_size * args.concurrency
    buf = bytearray(span)
    view = memoryview(buf)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        sender = subprocess.Popen(
            _bench_cmd("socket-send", "--port", str(port), *_load_flags(args, args.block_size))
        )
        conn, _ = server.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        got = 0
        base = inner = 0
        bs = args.block_size
        start = None
        while True:
            n = conn.recv_into(view[base + inner : base + bs])
            if n == 0:
                break
            if start is None:
                start = time.perf_counter()
            got += n
            inner += n
            if inner == bs:
                base = (base + bs) % span
                inner = 0
        elapsed = time.perf_counter() - (start or time.perf_counter())
    sender.wait(30)
    return {"gbps": got / elapsed / GB, "ops_per_s": got / args.block_size / elapsed, "bytes": got}


def run_socket_sender(args: argparse.Namespace) -> int:
    span = args.block_size * args.batch_size * args.concurrency
    buf = bytearray(os.urandom(1 << 16)) * (span >> 16) if span >= (1 << 16) else bytearray(span)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", args.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        deadline = time.perf_counter() + args.duration
        off = 0
        while time.perf_counter() < deadline:
            sock.sendall(view[off : off + args.block_size])
            off = (off + args.block_size) % span
    return 0


def run_memcpy(args: argparse.Namespace) -> dict[str, Any]:
    """memcpy of the same bytes, one block per call, between two buffers of the
    initiator's span (ctypes.memmove, the primitive the shm transport uses)."""
    import numpy as np

    span = args.block_size * args.batch_size * args.concurrency
    src = np.ones(span, dtype=np.uint8)
    dst = np.zeros(span, dtype=np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data
    nblocks = span // args.block_size
    bs = args.block_size
    memmove = ctypes.memmove
    moved = 0
    start = time.perf_counter()
    deadline = start + args.duration
    while time.perf_counter() < deadline:
        for i in range(nblocks):
            memmove(d + i * bs, s + i * bs, bs)
        moved += span
    elapsed = time.perf_counter() - start
    return {"gbps": moved / elapsed / GB, "ops_per_s": moved / bs / elapsed, "bytes": moved}


# ---------------------------------------------------------------------------
# Mooncake's own Transfer Engine (the anchor)


def _mooncake_env() -> tuple[dict[str, str] | None, str]:
    values, why = anchor_values()
    if values is None:
        return None, why
    bench = values.get("MOONCAKE_TE_BENCH", "")
    if not bench or not Path(bench).exists():
        return None, "the installed mooncake-transfer-engine wheel ships no transfer_engine_bench"
    env = anchor_process_env(values)
    env["MOONCAKE_TE_BENCH"] = bench
    return env, ""


def run_mooncake(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    bench = env["MOONCAKE_TE_BENCH"]
    span = args.block_size * args.batch_size * args.concurrency
    common = [
        "--protocol=tcp",
        "--metadata_server=P2PHANDSHAKE",
        "--use_vram=false",
        "--local_server_name=127.0.0.1",
        f"--buffer_size={span}",
    ]
    with tempfile.TemporaryFile("w+") as log:
        target = subprocess.Popen(
            [bench, "--mode=target", *common],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            port = None
            deadline = time.monotonic() + 30
            while port is None and time.monotonic() < deadline and target.poll() is None:
                time.sleep(0.1)
                log.seek(0)
                m = re.search(r"P2P handshake, listening on [^:\s]+:(\d+)", log.read())
                port = m.group(1) if m else None
            if port is None:
                log.seek(0)
                raise RuntimeError(f"Mooncake target did not start:\n{log.read()[-2000:]}")
            out = subprocess.run(
                [
                    bench,
                    "--mode=initiator",
                    *common,
                    f"--segment_id=127.0.0.1:{port}",
                    f"--operation={args.op}",
                    f"--block_size={args.block_size}",
                    f"--batch_size={args.batch_size}",
                    f"--threads={args.concurrency}",
                    f"--duration={max(1, round(args.duration))}",
                ],
                capture_output=True,
                text=True,
                env=env,
                timeout=args.duration + 60,
            )
        finally:
            os.killpg(target.pid, signal.SIGINT)
            try:
                target.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(target.pid, signal.SIGKILL)
                target.wait()
    text = out.stdout + out.stderr
    m = re.search(r"throughput ([\d.]+) GB/s", text)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"Mooncake initiator failed (rc {out.returncode}):\n{text[-2000:]}")
    gbps = float(m.group(1))
    return {"gbps": gbps, "ops_per_s": gbps * GB / args.block_size}


# ---------------------------------------------------------------------------
# compare


def _bench_cmd(*argv: str) -> list[str]:
    return [sys.executable, __file__, *argv]


def _load_flags(args: argparse.Namespace, block: int) -> list[str]:
    """The flags every measuring run shares: the load it puts on the copy."""
    return [
        "--block-size",
        str(block),
        "--batch-size",
        str(args.batch_size),
        "--concurrency",
        str(args.concurrency),
        "--duration",
        str(args.duration),
    ]


def _measured(
    what: str, argv: list[str], timeout_s: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """The JSON result a measuring run prints last."""
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ours(args: argparse.Namespace, transport: str, block: int) -> dict[str, Any]:
    span = block * args.batch_size * args.concurrency
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    target = subprocess.Popen(
        _bench_cmd(
            "target", "--port", "0", "--buffer-size", str(span), "--streams", str(args.streams)
        ),
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert target.stdout is not None
        line = target.stdout.readline()
        m = re.search(r"listening on (\S+)", line)
        if m is None:
            raise RuntimeError(f"target did not start: {line!r}")
        initiator = _bench_cmd(
            "initiator",
            *("--json", "--target", m.group(1), "--transport", transport, "--op", args.op),
            *_load_flags(args, block),
            *("--streams", str(args.streams), "--slice-bytes", str(args.slice_bytes)),
        )
        return _measured("initiator", initiator, args.duration + 120, env)
    finally:
        stop(target, 15)


def _sub(mode: str, args: argparse.Namespace, block: int) -> dict[str, Any]:
    return _measured(
        mode, _bench_cmd(mode, "--json", *_load_flags(args, block)), args.duration + 60
    )


@dataclass
class Series:
    runs: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def median(self) -> float | None:
        return statistics.median(self.runs) if self.runs else None


def run_compare(args: argparse.Namespace) -> int:
    sizes = [int(x) for x in args.block_sizes.split(",")]
    mooncake_env, why_not = _mooncake_env()
    kinds = ["ours-tcp", "mooncake-tcp", "socket", "ours-shm", "memcpy"]
    results: dict[tuple[str, int], Series] = {(k, b): Series() for k in kinds for b in sizes}
    print(
        f"# transfer_bench compare: op={args.op} batch={args.batch_size} "
        f"concurrency={args.concurrency} duration={args.duration}s rounds={args.rounds} "
        f"streams={args.streams} (loopback, two processes per run)",
        flush=True,
    )
    if mooncake_env is None:
        print(f"# mooncake-tcp: not run: {why_not}", flush=True)
        for b in sizes:
            results[("mooncake-tcp", b)].error = why_not
    for r in range(args.rounds):
        for block in sizes:
            for kind in kinds:
                series = results[(kind, block)]
                if series.error:
                    continue
                try:
                    if kind == "ours-tcp":
                        res = _ours(args, "tcp", block)
                    elif kind == "ours-shm":
                        res = _ours(args, "shm", block)
                    elif kind == "mooncake-tcp":
                        sub = argparse.Namespace(**{**vars(args), "block_size": block})
                        res = run_mooncake(sub, mooncake_env)  # type: ignore[arg-type]
                    elif kind == "socket":
                        res = _sub("socket-recv", args, block)
                    else:
                        res = _sub("memcpy", args, block)
                except Exception as exc:
                    series.error = str(exc).strip().splitlines()[-1][:300]
                    print(f"# {kind} block={block}: failed: {exc}", file=sys.stderr, flush=True)
                    continue
                series.runs.append(res["gbps"])
                print(
                    f"round {r + 1} block={block:>8} {kind:<13} {res['gbps']:6.2f} GB/s "
                    f"{res['ops_per_s']:10.0f} ops/s",
                    flush=True,
                )

    def med(kind: str, block: int) -> float | None:
        return results[(kind, block)].median

    print()
    print(f"{'block':>9} " + " ".join(f"{k:>13}" for k in kinds) + "   (median GB/s)")
    for block in sizes:
        cells = []
        for kind in kinds:
            m = med(kind, block)
            cells.append(f"{m:13.2f}" if m is not None else f"{'n/a':>13}")
        print(f"{block:>9} " + " ".join(cells))
    print()
    goals = [
        ("ours-tcp", "mooncake-tcp", {65536: 2.0, 1048576: 1.1}, "x Mooncake TE tcp"),
        ("ours-tcp", "socket", {b: 0.8 for b in sizes}, "x plain socket copy"),
        ("ours-shm", "memcpy", {b: 0.5 for b in sizes}, "x plain memcpy"),
    ]
    for num, den, want, label in goals:
        for block in sizes:
            a, b = med(num, block), med(den, block)
            goal = want.get(block)
            goal_text = (
                f" (goal >= {goal:g}: {'met' if a and b and a / b >= goal else 'MISSED'})"
                if goal
                else ""
            )
            if a is None or b is None:
                why = results[(den, block)].error or results[(num, block)].error or "no runs"
                print(f"{num} / {den} at {block}: n/a ({why})")
            else:
                print(f"{num} / {den} at {block}: {a / b:.2f}{label}{goal_text}")
    return 0


# ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="mode", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--block-size", type=int, default=65536)
        p.add_argument("--batch-size", type=int, default=128)
        p.add_argument("--concurrency", type=int, default=2, help="batches in flight (submitters)")
        p.add_argument("--duration", type=float, default=5.0, help="seconds")
        p.add_argument("--json", action="store_true", help="print one JSON line")

    t = sub.add_parser("target", help="register a buffer and serve")
    t.add_argument("--port", type=int, default=0)
    t.add_argument("--buffer-size", type=int, default=256 * 1024 * 1024)
    t.add_argument("--streams", type=int, default=4)

    i = sub.add_parser("initiator", help="read/write blocks of a target's buffer")
    common(i)
    i.add_argument("--target", required=True, help="host:port printed by the target")
    i.add_argument("--transport", choices=["tcp", "shm", "auto"], default="tcp")
    i.add_argument("--op", choices=["read", "write"], default="read")
    i.add_argument("--streams", type=int, default=4)
    i.add_argument("--slice-bytes", type=int, default=4 * 1024 * 1024)

    for name in ("socket-recv", "memcpy"):
        common(sub.add_parser(name, help="baseline"))
    s = sub.add_parser("socket-send", help="(internal) plain socket sender")
    common(s)
    s.add_argument("--port", type=int, required=True)

    c = sub.add_parser("compare", help="run everything in turn and print medians and ratios")
    c.add_argument("--block-sizes", default="65536,1048576")
    c.add_argument("--batch-size", type=int, default=128)
    c.add_argument("--concurrency", type=int, default=2)
    c.add_argument("--duration", type=float, default=5.0)
    c.add_argument("--rounds", type=int, default=5)
    c.add_argument("--op", choices=["read", "write"], default="read")
    c.add_argument("--streams", type=int, default=4)
    c.add_argument("--slice-bytes", type=int, default=4 * 1024 * 1024)
    return ap


def _report(args: argparse.Namespace, res: dict[str, Any], what: str) -> None:
    if args.json:
        print(json.dumps(res), flush=True)
    else:
        print(
            f"{what}: block={args.block_size} batch={args.batch_size} "
            f"concurrency={args.concurrency}: {res['gbps']:.2f} GB/s, {res['ops_per_s']:.0f} ops/s",
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.mode == "target":
        with contextlib.suppress(KeyboardInterrupt):
            return asyncio.run(run_target(args))
        return 0
    if args.mode == "initiator":
        res = asyncio.run(run_initiator(args))
        _report(args, res, f"ours {res['transport']} {args.op}")
        return 0
    if args.mode == "socket-recv":
        _report(args, run_socket_receiver(args), "plain socket copy")
        return 0
    if args.mode == "socket-send":
        return run_socket_sender(args)
    if args.mode == "memcpy":
        _report(args, run_memcpy(args), "memcpy")
        return 0
    return run_compare(args)


if __name__ == "__main__":
    sys.exit(main())
