"""A memory node's attention service: KV held here, decode attention computed here.

It loads no model: the first compute node to connect says the model's shape
(``KVShape``) and the pool is laid out for it; later ones must say the same.
Each connection is served in order: ``STEP`` lays out the step's sequences
(blocks extended, metadata built once for every layer), each ``LAYER`` writes
the new K/V into their slots and runs the engine's paged attention over them
on a worker thread, then ``OUT`` carries the result back. A failed step is
answered ``ERROR`` at its next layer and the connection stays usable; a broken
frame closes the connection. When a peer's last connection closes, its
sequences' blocks are freed: this node was their KV's only holder, so the
peer recomputes them (and uploads them again when it comes back).

With ``segments`` (a transfer segment for the pool), a prompt's KV may come
straight from a prefill node (the direct handoff): ``RESERVE`` takes blocks
and grants them to that writer alone, ``FILLED`` ends the grant and leaves
the sequence for the peer's first step to claim. A reservation its
connection leaves unfilled is given up (its blocks quarantined until the
grant's deadline); one never claimed is freed at its deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import structlog
import torch

from mooncaked.engine.attention import (
    AttentionMetadata,
    PagedKV,
    SdpaBackend,
    build_metadata,
)
from mooncaked.engine.offload.memory_kv import MemoryKV, MemorySeq
from mooncaked.engine.offload.wire import (
    HEADER,
    Kind,
    KVShape,
    Reserve,
    StepSeq,
    bytes_tensor,
    check_hello,
    decode_drop,
    decode_filled,
    decode_step,
    decode_upload,
    encode_granted,
    encode_json,
    frame,
    parse_header,
    tensor_bytes,
)
from mooncaked.handoff import KVGrant, KVLayout
from mooncaked.tasks import TaskSet

log = structlog.get_logger(__name__)

# A connection must prove itself within this long.
HELLO_TIMEOUT_S = 10.0
# A direct handoff's sequence waits this long for its peer's first step.
CLAIM_S = 60.0


class KVSegments(Protocol):
    """The pool as a transfer segment peers write under grants (the transfer
    engine, adapted by the daemon: this layer never imports it)."""

    node_id: str
    segment: str

    @property
    def address(self) -> str: ...

    def allocate(self, nbytes: int) -> torch.Tensor:
        """The pool's memory: ``nbytes`` zeroed, as uint8, in the segment."""
        ...

    def grant(self, peer: str, layout: KVLayout, block_ids: list[int], ttl_s: float) -> object:
        """Open ``block_ids`` (every layer's K and V) to ``peer``'s writes; a handle."""
        ...

    def revoke(self, handle: object) -> None: ...


@dataclass(slots=True)
class ServerStats:
    """Counters for /admin/status and the gossiped load."""

    connections: int = 0
    steps: int = 0
    layers: int = 0
    uploads: int = 0
    # Prompts a prefill node wrote here directly (no upload, no compute-node copy).
    direct: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    refused: int = 0
    errors: int = 0
    # Seconds of attention computed (the worker threads' busy time).
    busy_s: float = 0.0


@dataclass(slots=True)
class _Step:
    seqs: list[tuple[StepSeq, MemorySeq]]
    meta: AttentionMetadata | None
    num_tokens: int
    # Why the step cannot run: told at its first layer.
    error: str | None = None


@dataclass(slots=True)
class _Conn:
    peer: str = ""
    step: _Step | None = None
    # Direct handoffs this connection reserved and has not filled: their grants.
    reserved: dict[str, object] = field(default_factory=dict)


class AttentionServer:
    def __init__(
        self,
        *,
        node_id: str,
        secret: bytes,
        host: str,
        port: int,
        pool_bytes: int,
        threads: int = 2,
        segments: KVSegments | None = None,
    ) -> None:
        """``segments``: the pool in a transfer segment, for direct handoffs
        (None: only uploads fill it)."""
        self.node_id = node_id
        self._secret = secret
        self._host, self._port = host, port
        self.pool_bytes = pool_bytes
        self.kv: MemoryKV | None = None
        self._segments = segments
        self._backend: SdpaBackend | None = None
        self.stats = ServerStats()
        self._peers: Counter[str] = Counter()
        self._server: asyncio.Server | None = None
        self._tasks = TaskSet("attention-server")
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="mooncaked-attn")

    @property
    def address(self) -> str:
        if self._server is None or not self._server.sockets:
            return ""
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self._host, self._port)
        log.info("attention service listening", node=self.node_id, address=self.address)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._tasks.cancel()
            await self._tasks.wait()
            await self._server.wait_closed()
            self._server = None
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def __aenter__(self) -> AttentionServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def load(self) -> dict[str, float]:
        """KV capacity and use, sequences and peers served."""
        kv = self.kv
        if kv is not None:
            kv.sweep()
        return {
            "num_blocks": float(kv.num_blocks if kv else 0),
            "num_free_blocks": float(kv.num_free if kv else 0),
            "num_seqs": float(len(kv.seqs) if kv else 0),
            "num_tokens": float(sum(q.num_tokens for q in kv.seqs.values()) if kv else 0),
            "num_peers": float(len(self._peers)),
        }

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.spawn(self._serve(reader, writer), name="attention-conn")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn()
        try:
            if not await self._handshake(reader, writer, conn):
                return
            self._peers[conn.peer] += 1
            self.stats.connections += 1
            while True:
                kind, layer, payload = await _read_frame(reader)
                self.stats.bytes_in += len(payload) + HEADER.size
                reply = await self._handle(conn, kind, layer, payload)
                if reply is not None:
                    self.stats.bytes_out += len(reply)
                    writer.write(reply)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            if not isinstance(exc, asyncio.IncompleteReadError):
                log.info("attention connection dropped", peer=conn.peer, reason=str(exc))
        finally:
            writer.close()
            self._give_up(conn)
            if conn.peer:
                self._peers[conn.peer] -= 1
                if self._peers[conn.peer] <= 0:
                    del self._peers[conn.peer]
                    # Its KV is uploaded again if it comes back.
                    if self.kv is not None:
                        freed = self.kv.drop_peer(conn.peer)
                        log.info("compute node left", peer=conn.peer, seqs_freed=freed)

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Conn
    ) -> bool:
        nonce = os.urandom(16)
        writer.write(frame(Kind.CHALLENGE, nonce))
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            kind, _, payload = await _read_frame(reader)
        try:
            if kind is not Kind.HELLO:
                raise ValueError(f"expected HELLO, got {kind.name}")
            peer, shape = check_hello(self._secret, nonce, json.loads(payload))
            self._open_pool(shape)
        except ValueError as exc:
            self.stats.refused += 1
            log.warning("attention connection refused", reason=str(exc))
            writer.write(frame(Kind.ERROR, str(exc).encode()))
            await writer.drain()
            return False
        conn.peer = peer
        writer.write(frame(Kind.OK, encode_json({"node": self.node_id})))
        await writer.drain()
        return True

    def _open_pool(self, shape: KVShape) -> None:
        if self.kv is None:
            segs = self._segments
            self.kv = MemoryKV(
                shape, self.pool_bytes, allocate=segs.allocate if segs is not None else None
            )
            self._backend = SdpaBackend(shape.num_heads, shape.num_kv_heads, shape.head_dim)
            log.info("memory KV laid out", shape=str(shape), blocks=self.kv.num_blocks)
        elif self.kv.shape != shape:
            raise ValueError(f"this memory node holds KV of {self.kv.shape}, not {shape}")

    async def _handle(
        self, conn: _Conn, kind: Kind, layer: int, payload: bytearray
    ) -> bytes | None:
        kv = self.kv
        if kv is None:
            raise RuntimeError("a connection was served before the pool was laid out")
        if kind is Kind.STEP:
            conn.step = self._begin_step(conn.peer, kv, payload)
            return None
        if kind is Kind.UPLOAD:
            return self._upload(conn.peer, kv, payload)
        if kind is Kind.DROP:
            for key in decode_drop(payload):
                kv.drop((conn.peer, key))
            return None
        if kind is Kind.LAYER:
            return await self._layer(conn, kv, layer, payload)
        if kind is Kind.RESERVE:
            return self._reserve(conn, kv, Reserve.decode(payload))
        if kind is Kind.FILLED:
            return self._filled(conn, kv, *decode_filled(payload))
        raise ValueError(f"unexpected {kind.name} frame")

    def _reserve(self, conn: _Conn, kv: MemoryKV, ask: Reserve) -> bytes:
        segs = self._segments
        if segs is None or not segs.address:
            return frame(Kind.ERROR, b"this memory node takes no direct handoffs")
        self._revoke(conn, ask.key)
        sid = (conn.peer, ask.key)
        seq = kv.reserve(sid, ask.num_tokens, kv.clock() + ask.ttl_s)
        if seq is None:
            return frame(Kind.ERROR, b"memory node full")
        try:
            conn.reserved[ask.key] = segs.grant(ask.writer, kv.layout, seq.block_ids, ask.ttl_s)
        except ValueError as exc:
            kv.drop(sid)
            return frame(Kind.ERROR, f"cannot grant: {exc}".encode())
        grant = KVGrant(
            request_id=ask.key,
            node_id=segs.node_id,
            transfer_address=segs.address,
            segment=segs.segment,
            layout=kv.layout,
            first_block=0,
            block_ids=tuple(seq.block_ids),
            ttl_s=ask.ttl_s,
        )
        return frame(Kind.OK, encode_granted(grant))

    def _filled(self, conn: _Conn, kv: MemoryKV, key: str, num_tokens: int) -> bytes:
        if key not in conn.reserved:
            return frame(Kind.ERROR, f"no reservation of {key!r} on this connection".encode())
        self._revoke(conn, key)
        if not kv.fill((conn.peer, key), num_tokens, kv.clock() + CLAIM_S):
            return frame(Kind.ERROR, f"the reservation of {key!r} is gone".encode())
        self.stats.direct += 1
        return frame(Kind.OK)

    def _revoke(self, conn: _Conn, key: str) -> None:
        handle = conn.reserved.pop(key, None)
        if handle is not None and self._segments is not None:
            self._segments.revoke(handle)

    def _give_up(self, conn: _Conn) -> None:
        """The connection closed: its unfilled reservations' grants end, their
        blocks stay quarantined until the grants' deadlines."""
        for key in list(conn.reserved):
            self._revoke(conn, key)
            if self.kv is not None and (seq := self.kv.seqs.get((conn.peer, key))) is not None:
                if seq.filling:
                    self.kv.drop((conn.peer, key))

    def _upload(self, peer: str, kv: MemoryKV, payload: bytearray) -> bytes:
        try:
            key, n, data = decode_upload(memoryview(payload), kv.shape)
        except (ValueError, KeyError) as exc:
            return frame(Kind.ERROR, f"bad upload: {exc}".encode())
        seq = kv.open((peer, key))
        if not kv.extend(seq, n):
            kv.drop((peer, key))
            return frame(Kind.ERROR, b"memory node full")
        kv.write(seq, data)
        self.stats.uploads += 1
        return frame(Kind.OK)

    def _begin_step(self, peer: str, kv: MemoryKV, payload: bytearray) -> _Step | None:
        seqs, drop = decode_step(payload)
        for key in drop:
            kv.drop((peer, key))
        placed: list[tuple[StepSeq, MemorySeq]] = []
        for s in seqs:
            sid = (peer, s.key)
            seq = kv.open(sid) if s.start == 0 else kv.seqs.get(sid)
            if seq is not None and s.start:
                kv.claim(seq)
            if seq is None or seq.num_tokens != s.start:
                have = None if seq is None else seq.num_tokens
                return _failed(f"sequence {s.key!r}: holds {have} tokens, step starts at {s.start}")
            if not kv.extend(seq, s.start + s.n):
                return _failed("memory node full")
            placed.append((s, seq))
        meta = build_metadata(
            query_lens=[s.n for s, _ in placed],
            start_positions=[s.start for s, _ in placed],
            block_tables=[list(m.block_ids) for _, m in placed],
            block_size=kv.block_size,
            device=torch.device("cpu"),
            backend=self._backend,  # type: ignore[arg-type]
            dtype=kv.shape.torch_dtype,
        )
        self.stats.steps += 1
        return _Step(placed, meta, sum(s.n for s, _ in placed))

    async def _layer(self, conn: _Conn, kv: MemoryKV, layer: int, payload: bytearray) -> bytes:
        step = conn.step
        if step is None or step.error is not None:
            self.stats.errors += 1
            reason = "no step" if step is None else step.error
            return frame(Kind.ERROR, str(reason).encode(), layer)
        shape = kv.shape
        if layer >= shape.num_layers or len(payload) != shape.qkv_bytes(step.num_tokens):
            self.stats.errors += 1
            return frame(Kind.ERROR, f"layer {layer}: {len(payload)} bytes".encode(), layer)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        out = await loop.run_in_executor(self._executor, self._attend, kv, step, layer, payload)
        self.stats.busy_s += time.perf_counter() - t0
        self.stats.layers += 1
        if layer == shape.num_layers - 1:
            # The step's K/V are in every layer now: the next step starts after them.
            for s, seq in step.seqs:
                seq.num_tokens = s.start + s.n
            conn.step = None
        return frame(Kind.OUT, tensor_bytes(out), layer)

    def _attend(self, kv: MemoryKV, step: _Step, layer: int, payload: bytearray) -> torch.Tensor:
        shape, t = kv.shape, step.num_tokens
        h, kvh, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
        qkv = bytes_tensor(payload, shape.torch_dtype)
        q = qkv[: t * h * d].view(t, h, d)
        k = qkv[t * h * d : t * (h + kvh) * d].view(t, kvh, d)
        v = qkv[t * (h + kvh) * d :].view(t, kvh, d)
        k_cache, v_cache = kv.layer(layer)
        meta = step.meta
        if meta is None or meta.backend is None:
            raise RuntimeError("a memory node step without metadata")
        with torch.inference_mode():
            return meta.backend.forward(q, PagedKV(k, v, k_cache, v_cache), meta)


def _failed(reason: str) -> _Step:
    return _Step([], None, 0, error=reason)


async def _read_frame(reader: asyncio.StreamReader) -> tuple[Kind, int, bytearray]:
    kind, layer, length = parse_header(await reader.readexactly(HEADER.size))
    payload = bytearray(await reader.readexactly(length)) if length else bytearray()
    return kind, layer, payload
