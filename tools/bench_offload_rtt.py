"""One layer's round trip of attention offloading: our socket frames vs the transfer engine.

    python tools/bench_offload_rtt.py [--sizes 24576:16384,196608:131072] [--rounds 300]

A decode layer sends q/k/v to the memory node and takes the attention output
back. This times that exchange with no attention in between, on loopback,
two ways, for each ``qkv bytes:out bytes`` pair (the defaults: a batch of 16
of builtin:tiny in float32, and of a 7B-shaped model, 32 heads, 8 KV heads
x 128, in bfloat16):

    socket   what the offload client does: one persistent TCP connection,
             a LAYER frame out, an OUT frame back (a peer process echoes
             ``out`` bytes for each frame);
    transfer the transfer engine (TCP transport): a WRITE of q/k/v into the
             memory node's segment, then a READ of the output back, each
             awaited: the least a one-sided design pays, before any way of
             telling the memory node that q/k/v arrived.

It prints the median and 90th percentile microseconds of a round trip and
the ratio of the medians (transfer / socket).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import socket
import statistics
import sys
import time

import structlog

from mooncaked.config import TransferConfig
from mooncaked.engine.offload.wire import HEADER, Kind, frame, parse_header
from mooncaked.transfer import Access, TransferEngine, TransferOp

SECRET = b"bench-offload-rtt-secret"
SEGMENT = "kv"


def _quiet() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        r = sock.recv_into(view[got:])
        if r == 0:
            raise ConnectionError("closed")
        got += r
    return buf


def _echo_main(port: int, out_bytes: dict[int, int]) -> None:
    """The socket peer: answers each frame with as many bytes as its size asks."""
    with socket.create_server(("127.0.0.1", port)) as srv:
        while True:
            conn, _ = srv.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with conn:
                try:
                    while True:
                        _, layer, length = parse_header(bytes(_recv_exact(conn, HEADER.size)))
                        _recv_exact(conn, length)
                        conn.sendall(frame(Kind.OUT, bytes(out_bytes[length]), layer))
                except ConnectionError:
                    continue


def _target_main(port: int, nbytes: int) -> None:
    """The transfer peer: a segment peers may write and read, nothing else."""
    _quiet()

    async def serve() -> None:
        config = TransferConfig(host="127.0.0.1", port=port, transports=("tcp",))
        async with TransferEngine(config, "memory", SECRET) as engine:
            engine.allocate(SEGMENT, nbytes, Access.READ_WRITE)
            await asyncio.Event().wait()

    asyncio.run(serve())


def _socket_rtts(port: int, qkv: int, out: int, rounds: int) -> list[float]:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = bytes(qkv)
    times: list[float] = []
    with sock:
        for i in range(rounds + 10):
            t0 = time.perf_counter()
            sock.sendall(frame(Kind.LAYER, payload, i % 64))
            _recv_exact(sock, HEADER.size + out)
            if i >= 10:  # warm-up
                times.append(time.perf_counter() - t0)
    return times


async def _transfer_rtts(port: int, qkv: int, out: int, rounds: int) -> list[float]:
    config = TransferConfig(host="127.0.0.1", transports=("tcp",))
    async with TransferEngine(config, "compute", SECRET) as engine:
        engine.allocate(SEGMENT, qkv + out)
        engine.add_peer("memory", f"127.0.0.1:{port}")
        write = TransferOp.write(SEGMENT, 0, "memory", SEGMENT, 0, qkv)
        read = TransferOp.read(SEGMENT, qkv, "memory", SEGMENT, qkv, out)
        times: list[float] = []
        for i in range(rounds + 10):
            t0 = time.perf_counter()
            for op in (write, read):
                batch = await engine.submit([op])
                if not await batch.wait():
                    raise RuntimeError(f"transfer failed: {batch.failures()[:1]}")
            if i >= 10:
                times.append(time.perf_counter() - t0)
        return times


def _wait_port(port: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _us(times: list[float], q: float) -> float:
    return statistics.quantiles(times, n=100)[int(q * 100) - 1] * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="24576:16384,196608:131072")
    p.add_argument("--rounds", type=int, default=300)
    args = p.parse_args(argv)
    _quiet()
    pairs = [pair.split(":") for pair in args.sizes.split(",")]
    sizes = [(int(q), int(o)) for q, o in pairs]
    echo_port, target_port = _free_port(), _free_port()
    ctx = mp.get_context("spawn")
    out_for = dict(sizes)
    peers = [
        ctx.Process(target=_echo_main, args=(echo_port, out_for), daemon=True),
        ctx.Process(
            target=_target_main, args=(target_port, max(q + o for q, o in sizes)), daemon=True
        ),
    ]
    for proc in peers:
        proc.start()
    try:
        _wait_port(echo_port)
        _wait_port(target_port)
        print(f"{'qkv KiB':>8} {'out KiB':>8} {'path':<9} {'p50 us':>8} {'p90 us':>8} {'ratio':>6}")
        for qkv, out in sizes:
            sock = _socket_rtts(echo_port, qkv, out, args.rounds)
            xfer = asyncio.run(_transfer_rtts(target_port, qkv, out, args.rounds))
            base = statistics.median(sock)
            for name, times in (("socket", sock), ("transfer", xfer)):
                ratio = statistics.median(times) / base
                print(
                    f"{qkv / 1024:>8.1f} {out / 1024:>8.1f} {name:<9} {_us(times, 0.5):>8.0f} "
                    f"{_us(times, 0.9):>8.0f} {ratio:>5.2f}x",
                    flush=True,
                )
    finally:
        for proc in peers:
            proc.kill()
            proc.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
