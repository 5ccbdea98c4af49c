"""The transfer engine across two processes on loopback, over tcp and over
shared memory: data integrity, many small ops, a connection cut mid-batch,
authentication, bounds checks, timeouts and a restarting peer.

The target is this file run as a script (``python <this file> serve``): it
starts a TransferEngine, then obeys JSON commands on stdin (allocate a
segment filled from a seed, hash a range, drop connections, ...) and answers
on stdout. Segment contents come from a seeded generator, so the test knows
what a READ must return without asking.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from mooncaked.config import TransferConfig  # noqa: E402
from mooncaked.transfer import Access, OpStatus, TransferEngine, TransferOp  # noqa: E402
from mooncaked.transfer import protocol as p  # noqa: E402

SECRET = b"two-process-test-secret"
KiB = 1024
MiB = 1024 * 1024


def pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def sha(data: Any) -> str:
    return hashlib.sha256(memoryview(data)).hexdigest()


# ---------------------------------------------------------------------------
# The target process


async def _serve(node_id: str, port: int, transports: tuple[str, ...]) -> None:
    import structlog

    # stdout is the command channel; logs go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    config = TransferConfig(port=port, transports=transports, op_timeout_s=10.0)
    engine = TransferEngine(config, node_id, SECRET)
    await engine.start()
    out = sys.stdout

    def reply(obj: dict[str, Any]) -> None:
        out.write(orjson.dumps(obj).decode() + "\n")
        out.flush()

    reply({"address": engine.address})
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            cmd = orjson.loads(line)
            op = cmd["cmd"]
            if op == "alloc":
                if cmd.get("shared", True):
                    seg = engine.allocate(cmd["name"], cmd["nbytes"], Access.READ_WRITE)
                else:
                    seg = engine.register(cmd["name"], bytearray(cmd["nbytes"]), Access.READ_WRITE)
                assert seg.view is not None
                seg.view[:] = memoryview(pattern(cmd["seed"], cmd["nbytes"]))
                reply({"ok": True, "transports": list(engine.descriptor(cmd["name"]).transports)})
            elif op == "sha":
                seg = engine.segment(cmd["name"])
                assert seg is not None and seg.view is not None
                reply({"sha": sha(seg.view[cmd["offset"] : cmd["offset"] + cmd["length"]])})
            elif op == "unregister":
                engine.unregister(cmd["name"])
                reply({"ok": True})
            elif op == "drop":
                engine.disconnect()
                reply({"ok": True})
            elif op == "metrics":
                m = engine.metrics()
                reply({"handshakes_refused": m.handshakes_refused, "served_ops": m.served_ops})
            elif op == "quit":
                break
    finally:
        await engine.close()
        reply({"closed": True})


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "serve":
    asyncio.run(_serve(sys.argv[2], int(sys.argv[3]), tuple(sys.argv[4].split(","))))
    sys.exit(0)


# ---------------------------------------------------------------------------
# Test-side handles


class Target:
    def __init__(self, proc: asyncio.subprocess.Process, address: str) -> None:
        self.proc = proc
        self.address = address

    @classmethod
    async def start(
        cls, node_id: str = "target", port: int = 0, transports: str = "shm,tcp"
    ) -> Target:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "serve",
            node_id,
            str(port),
            transports,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if not line:
            raise RuntimeError("target process exited before it was ready")
        return cls(proc, orjson.loads(line)["address"])

    async def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(orjson.dumps(cmd) + b"\n")
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), 30)
        if not line:
            raise RuntimeError("target process died")
        return orjson.loads(line)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(Exception):
                await self.call(cmd="quit")
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()

    async def kill(self) -> None:
        self.proc.kill()
        await self.proc.wait()


class Proxy:
    """A loopback tcp forwarder that can cut or stall every connection once a
    number of bytes went through, to break a transfer mid-batch on purpose."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.forwarded = 0
        self.cut_after: int | None = None
        self.stall_after: int | None = None
        self.cuts = 0
        self.address = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = f"{host}:{port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        self._writers.update((writer, up_writer))
        stalled = asyncio.Event()

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await src.read(256 * KiB):
                    if self.stall_after is not None and self.forwarded >= self.stall_after:
                        await stalled.wait()  # never set: the bytes go nowhere
                    dst.write(data)
                    await dst.drain()
                    self.forwarded += len(data)
                    if self.cut_after is not None and self.forwarded >= self.cut_after:
                        self.cut_after = None
                        self.cuts += 1
                        self.cut_all()
            with contextlib.suppress(OSError):
                dst.close()

        for coro in (pump(reader, up_writer), pump(up_reader, writer)):
            task = asyncio.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def cut_all(self) -> None:
        for w in list(self._writers):
            sock = w.get_extra_info("socket")
            with contextlib.suppress(OSError):
                # RST rather than FIN: a killed connection, not a polite close.
                sock.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
            w.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.cut_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def initiator(
    node_id: str = "initiator", secret: bytes = SECRET, **config: Any
) -> AsyncIterator[TransferEngine]:
    engine = TransferEngine(TransferConfig(**config), node_id, secret)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.close()


@pytest.fixture
async def target() -> AsyncIterator[Target]:
    t = await Target.start()
    try:
        yield t
    finally:
        await t.stop()


def _transports(kind: str) -> dict[str, Any]:
    return {"transports": ("shm", "tcp") if kind == "shm" else ("tcp",)}


@contextlib.asynccontextmanager
async def peered(
    target: Target, kind: str, local_bytes: int
) -> AsyncIterator[tuple[TransferEngine, np.ndarray]]:
    """An initiator over ``kind`` with the target as its peer, and the bytes of
    its local buffer ``buf``."""
    async with initiator(**_transports(kind)) as engine:
        engine.add_peer("target", target.address)
        local = engine.allocate("buf", local_bytes)
        yield engine, np.frombuffer(local.view, dtype=np.uint8)


# ---------------------------------------------------------------------------
# Tests

SIZES = [64 * KiB, 64 * KiB + 7, MiB, 5 * MiB + 4093, 64 * MiB]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["tcp", "shm"])
async def test_random_data_round_trips_from_64k_to_64m(target: Target, kind: str) -> None:
    total = sum(SIZES)
    remote_len = total + MiB
    await target.call(cmd="alloc", name="pool", nbytes=remote_len, seed=11)
    expected = pattern(11, remote_len)
    async with peered(target, kind, 2 * total) as (engine, view):
        # READ each size from a distinct remote offset into a distinct local one.
        reads = []
        r_off, l_off = 3, 0
        for size in SIZES:
            reads.append(TransferOp.read("buf", l_off, "target", "pool", r_off, size))
            r_off += size
            l_off += size
        batch = await engine.submit(reads)
        assert await batch.wait(), batch.failures()
        assert {batch.transport(i) for i in range(len(reads))} == {kind}
        for op in reads:
            got = view[op.local_offset : op.local_offset + op.length]
            want = expected[op.remote_offset : op.remote_offset + op.length]
            assert sha(got) == sha(want), f"READ of {op.length} bytes differs"

        # WRITE fresh random bytes back over the same remote ranges, then check
        # the target's own hash of each range.
        view[total : 2 * total] = pattern(12, total)
        writes = [
            TransferOp.write(
                "buf", total + op.local_offset, "target", "pool", op.remote_offset, op.length
            )
            for op in reads
        ]
        batch = await engine.submit(writes)
        assert await batch.wait(), batch.failures()
        for op in writes:
            remote = await target.call(
                cmd="sha", name="pool", offset=op.remote_offset, length=op.length
            )
            assert remote["sha"] == sha(view[op.local_offset : op.local_offset + op.length])
        m = engine.metrics()
        assert m.bytes_read == total and m.bytes_written == total
        assert m.bytes_by_transport == {kind: 2 * total}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["tcp", "shm"])
async def test_ten_thousand_small_ops_in_one_batch(target: Target, kind: str) -> None:
    n, block = 10_000, 1 * KiB
    await target.call(cmd="alloc", name="pool", nbytes=n * block, seed=21)
    expected = pattern(21, n * block).reshape(n, block)
    perm = np.random.default_rng(5).permutation(n)
    async with peered(target, kind, n * block) as (engine, view):
        view = view.reshape(n, block)
        ops = [
            TransferOp.read("buf", int(perm[j]) * block, "target", "pool", j * block, block)
            for j in range(n)
        ]
        batch = await engine.submit(ops)
        assert await batch.wait(), batch.failures()[:3]
        assert batch.statuses.count(OpStatus.DONE) == n
        assert np.array_equal(view[perm], expected)

        # And back: write block j of ours to remote block perm[j].
        view[:] = pattern(22, n * block).reshape(n, block)
        ops = [
            TransferOp.write("buf", j * block, "target", "pool", int(perm[j]) * block, block)
            for j in range(n)
        ]
        batch = await engine.submit(ops)
        assert await batch.wait(), batch.failures()[:3]
        want = np.empty_like(view)
        want[perm] = view
        remote = await target.call(cmd="sha", name="pool", offset=0, length=n * block)
        assert remote["sha"] == sha(want)


@pytest.mark.timeout(120)
async def test_connection_killed_mid_batch_still_completes(target: Target) -> None:
    size = 48 * MiB
    half = size // 2
    await target.call(cmd="alloc", name="pool", nbytes=size + half, seed=31)
    expected = pattern(31, size)
    proxy = Proxy(target.address)
    await proxy.start()
    try:
        async with initiator(transports=("tcp",), slice_bytes=MiB, max_retries=3) as engine:
            engine.add_peer("target", proxy.address)
            local = engine.allocate("buf", 2 * size)
            view = np.frombuffer(local.view, dtype=np.uint8)
            view[size:] = pattern(32, size)
            # Cut every connection (RST) once a third of the bytes went by.
            proxy.cut_after = half
            ops = [
                TransferOp.read("buf", 0, "target", "pool", 0, half),
                TransferOp.read("buf", half, "target", "pool", half, half),
                TransferOp.write("buf", size, "target", "pool", size, half),
            ]
            batch = await engine.submit(ops)
            assert await batch.wait(), batch.failures()
            assert proxy.cuts == 1
            m = engine.metrics()
            assert m.slices_retried > 0, "the cut should have hit slices in flight"
            assert sha(view[:size]) == sha(expected)
            remote = await target.call(cmd="sha", name="pool", offset=size, length=half)
            assert remote["sha"] == sha(view[size : size + half])
    finally:
        await proxy.close()


@pytest.mark.timeout(60)
async def test_stalled_peer_times_out_op_and_engine_recovers(target: Target) -> None:
    await target.call(cmd="alloc", name="pool", nbytes=8 * MiB, seed=41)
    proxy = Proxy(target.address)
    await proxy.start()
    try:
        async with initiator(transports=("tcp",), max_retries=1) as engine:
            engine.add_peer("target", proxy.address)
            engine.allocate("buf", 8 * MiB)
            warm = await engine.submit([TransferOp.read("buf", 0, "target", "pool", 0, 4 * KiB)])
            assert await warm.wait()
            proxy.stall_after = proxy.forwarded
            batch = await engine.submit(
                [TransferOp.read("buf", 0, "target", "pool", 0, 8 * MiB)], op_timeout_s=0.5
            )
            assert not await batch.wait()
            assert batch.status(0) is OpStatus.FAILED
            assert "timed out after 0.5 s" in (batch.reason(0) or "")
            # The stalled connections were cut; new ones work once the path does.
            proxy.stall_after = None
            engine.add_peer("target", target.address)
            again = await engine.submit([TransferOp.read("buf", 0, "target", "pool", 0, 8 * MiB)])
            assert await again.wait(), again.failures()
    finally:
        await proxy.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["tcp", "shm"])
async def test_bad_ops_fail_cleanly_while_good_ones_are_served(target: Target, kind: str) -> None:
    await target.call(cmd="alloc", name="pool", nbytes=MiB, seed=51)
    expected = pattern(51, MiB)
    async with peered(target, kind, 4 * MiB) as (engine, view):
        ops = [
            TransferOp.read("buf", 0, "target", "pool", 0, 64 * KiB),
            TransferOp.read("buf", MiB, "target", "pool", MiB - 10, 64 * KiB),  # past the end
            TransferOp.read("buf", 2 * MiB, "target", "nope", 0, 64 * KiB),  # unknown
            TransferOp.write("buf", 0, "target", "pool", 2**40, 4 * KiB),  # far out
            TransferOp.read("buf", 3 * MiB, "target", "pool", 64 * KiB, 64 * KiB),
        ]
        batch = await engine.submit(ops)
        assert not await batch.wait()
        assert batch.statuses == [
            OpStatus.DONE,
            OpStatus.FAILED,
            OpStatus.FAILED,
            OpStatus.FAILED,
            OpStatus.DONE,
        ]
        assert "outside segment 'pool'" in (batch.reason(1) or "")
        assert "'nope' is not registered on node target" in (batch.reason(2) or "")
        assert "outside segment 'pool'" in (batch.reason(3) or "")
        assert sha(view[: 64 * KiB]) == sha(expected[: 64 * KiB])
        assert sha(view[3 * MiB : 3 * MiB + 64 * KiB]) == sha(expected[64 * KiB : 128 * KiB])
        assert not view[MiB : MiB + 64 * KiB].any(), "a refused READ must not land bytes"

        # A segment unregistered behind our back: our cached id is stale.
        await target.call(cmd="alloc", name="gone", nbytes=MiB, seed=52)
        first = await engine.submit([TransferOp.read("buf", 0, "target", "gone", 0, 4 * KiB)])
        assert await first.wait()
        await target.call(cmd="unregister", name="gone")
        stale = await engine.submit([TransferOp.read("buf", 0, "target", "gone", 0, 4 * KiB)])
        assert not await stale.wait()
        assert "'gone' is not registered on node target" in (stale.reason(0) or "")
        # Registered again under the same name: found again, new bytes.
        await target.call(cmd="alloc", name="gone", nbytes=MiB, seed=53)
        back = await engine.submit([TransferOp.read("buf", 0, "target", "gone", 0, MiB)])
        assert await back.wait(), back.failures()
        assert back.transport(0) == kind
        assert sha(view[:MiB]) == sha(pattern(53, MiB))

        # The target kept serving throughout.
        ok = await engine.submit([TransferOp.read("buf", 0, "target", "pool", 0, MiB)])
        assert await ok.wait()
        assert sha(view[:MiB]) == sha(expected)


@pytest.mark.timeout(60)
async def test_server_checks_every_op_itself(target: Target) -> None:
    """A peer that skips the client-side checks (a raw protocol client) still
    reaches nothing outside registered segments, and the connection goes on."""
    await target.call(cmd="alloc", name="pool", nbytes=MiB, seed=61)
    expected = pattern(61, MiB)
    host, port = target.address.rsplit(":", 1)

    def raw_client() -> tuple[list[tuple[int, int]], bytes, list[tuple[int, int]]]:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            p.client_handshake(sock, SECRET, "raw", p.Channel.STREAM)
            p.send_control(sock, p.FrameKind.LOOKUP, {"names": ["pool"]})
            seg_id = p.recv_control(sock, p.FrameKind.LOOKUP)["segments"][0]["id"]
            records = [
                (p.OpCode.READ, seg_id, MiB - 100, 200),  # crosses the end
                (p.OpCode.READ, seg_id + 1000, 0, 100),  # no such segment
                (p.OpCode.WRITE, seg_id, 2**62, 300),  # far out; payload still sent
                (p.OpCode.READ, seg_id, 4096, 1000),  # fine
            ]
            body = b"".join(p.OP_RECORD.pack(*r) for r in records)
            sock.sendall(p.FRAME.pack(p.FrameKind.DATA, len(records), 0, 300) + body + b"x" * 300)
            head = p.recv_exact(sock, p.FRAME.size + len(records) * p.STATUS_RECORD.size)
            _, _count, _, payload = p.FRAME.unpack_from(head)
            statuses = list(p.STATUS_RECORD.iter_unpack(bytes(head[p.FRAME.size :])))
            data = bytes(p.recv_exact(sock, payload))
            # The same connection serves the next frame.
            sock.sendall(
                p.FRAME.pack(p.FrameKind.DATA, 1, 0, 0)
                + p.OP_RECORD.pack(p.OpCode.READ, seg_id, 0, 16)
            )
            head2 = p.recv_exact(sock, p.FRAME.size + p.STATUS_RECORD.size)
            statuses2 = list(p.STATUS_RECORD.iter_unpack(bytes(head2[p.FRAME.size :])))
            data += bytes(p.recv_exact(sock, 16))
            return statuses, data, statuses2

    statuses, data, statuses2 = await asyncio.to_thread(raw_client)
    assert statuses == [
        (p.Status.OUT_OF_RANGE, MiB),
        (p.Status.UNKNOWN_SEGMENT, 0),
        (p.Status.OUT_OF_RANGE, MiB),
        (p.Status.OK, 0),
    ]
    assert statuses2 == [(p.Status.OK, 0)]
    assert data == expected[4096:5096].tobytes() + expected[:16].tobytes()
    remote = await target.call(cmd="sha", name="pool", offset=0, length=MiB)
    assert remote["sha"] == sha(expected), "a refused WRITE must not land bytes"


@pytest.mark.timeout(60)
async def test_unauthenticated_peer_is_refused(target: Target) -> None:
    await target.call(cmd="alloc", name="pool", nbytes=MiB, seed=71)
    async with initiator("intruder", secret=b"not-the-cluster-secret", transports=("tcp",)) as bad:
        bad.add_peer("target", target.address)
        bad.allocate("buf", MiB)
        batch = await bad.submit([TransferOp.read("buf", 0, "target", "pool", 0, 4 * KiB)])
        assert not await batch.wait()
        reason = batch.reason(0) or ""
        assert "authentication failed: wrong cluster secret" in reason, reason

    # A client that speaks garbage is dropped too.
    host, port = target.address.rsplit(":", 1)

    def garbage() -> bytes:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            p.recv_exact(sock, p.HELLO.size)
            sock.sendall(os.urandom(p.AUTH.size + 16))
            chunks = []
            try:
                while chunk := sock.recv(4096):
                    chunks.append(chunk)
            except ConnectionResetError:
                pass  # closed with our junk unread: a reset, not a FIN
            return b"".join(chunks)

    assert await asyncio.to_thread(garbage) == b"", "no reply to a bad handshake"
    metrics = await target.call(cmd="metrics")
    assert metrics["handshakes_refused"] == 2

    # A peer with the secret is served as before.
    async with initiator(transports=("tcp",)) as good:
        good.add_peer("target", target.address)
        good.allocate("buf", MiB)
        batch = await good.submit([TransferOp.read("buf", 0, "target", "pool", 0, MiB)])
        assert await batch.wait(), batch.failures()


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["tcp", "shm"])
async def test_restarted_peer_is_reconnected_on_next_batch(kind: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    targets = [await Target.start(port=port)]
    try:
        await targets[-1].call(cmd="alloc", name="pool", nbytes=MiB, seed=81)
        # No retries at all: finding the old connections dead must not cost one.
        async with initiator(max_retries=0, **_transports(kind)) as engine:
            engine.add_peer("target", targets[-1].address)
            local = engine.allocate("buf", MiB)
            view = np.frombuffer(local.view, dtype=np.uint8)

            async def read() -> Any:
                return await engine.submit([TransferOp.read("buf", 0, "target", "pool", 0, MiB)])

            async def read_from_a_new_target(seed: int) -> None:
                targets.append(await Target.start(port=port))
                await targets[-1].call(cmd="alloc", name="pool", nbytes=MiB, seed=seed)
                batch = await read()
                assert await batch.wait(), batch.failures()
                assert batch.transport(0) == kind
                assert sha(view) == sha(pattern(seed, MiB))

            batch = await read()
            assert await batch.wait() and batch.transport(0) == kind
            assert sha(view) == sha(pattern(81, MiB))

            # Restarted between two batches: the next one finds the new process.
            await targets[-1].kill()
            await read_from_a_new_target(82)

            # Down: the batch fails with a reason; back up: the next one works.
            await targets[-1].kill()
            down = await read()
            assert not await down.wait()
            assert "node target" in (down.reason(0) or "")
            await read_from_a_new_target(83)
    finally:
        for t in targets:
            await t.stop()
