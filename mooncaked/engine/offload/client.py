"""A compute node's side of attention offloading: blocking sockets in the step thread.

The step thread calls the memory node itself, once a layer: a hop through the
event loop would add a thread switch to every round trip, and those round
trips (layers x steps) are what offloading pays. One connection a
micro-batch, so one half's call is in flight while the other half computes.

The memory node is the only holder of an offloaded sequence's KV (this node
keeps no mirror: that is the memory offloading saves). Any error or a reply
later than ``timeout_s`` marks the memory node down for ``retry_s`` (every
connection closed, so no stream is left out of step, and the memory node
frees this node's sequences when they close); ``fail`` returns the keys of
every sequence it held, which the engine recomputes. A sequence whose KV is
still here (a prompt prefilled here or handed over by a prefill node) is
uploaded before its first offloaded step.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from mooncaked.engine.offload.wire import (
    HEADER,
    Kind,
    KVShape,
    OffloadError,
    StepSeq,
    bytes_tensor,
    encode_drop,
    encode_json,
    encode_step,
    encode_upload,
    frame,
    hello_mac,
    parse_header,
    tensor_bytes,
)

log = structlog.get_logger(__name__)

# A sequence's first n tokens of KV, every layer: [layers, 2, n, kv_heads, head_dim];
# None when this node does not hold them (the memory node was their only holder).
UploadSource = Callable[[str, int], torch.Tensor | None]


@dataclass(slots=True)
class ClientStats:
    steps: int = 0
    layers: int = 0
    uploads: int = 0
    # Prompts a prefill node wrote straight into a memory node (no upload).
    direct_handoffs: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    # Seconds the step thread sat waiting for replies ...
    wait_s: float = 0.0
    # ... of the seconds the layers were in flight (sent to answered): the
    # share not waited for is what micro-batching hid behind local compute.
    flight_s: float = 0.0
    failures: int = 0
    # Steps whose decodes attended here because the memory node was down.
    local_fallbacks: int = 0
    # Sequences whose KV a failure lost (recomputed by the engine).
    lost: int = 0
    # The latest failure's memory node and reason (not a counter: no metric).
    last_error: str = ""


class AttentionClient:
    def __init__(
        self,
        address: str,
        *,
        node_id: str,
        secret: bytes,
        shape: KVShape,
        num_conns: int = 1,
        timeout_s: float = 5.0,
        retry_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        stats: ClientStats | None = None,
    ) -> None:
        """``stats``: counters to add to, shared by a node's clients of
        several memory nodes (one set of counters a node reports)."""
        host, _, port = address.rpartition(":")
        self._addr = (host, int(port))
        self.address = address
        self._node_id = node_id
        self._secret = secret
        self.shape = shape
        self._num_conns = num_conns
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._clock = clock
        self._socks: list[socket.socket] = []
        self._down_until = 0.0
        self.last_error = ""
        # Tokens the memory node holds of each sequence (as of the last step).
        self._held: dict[str, int] = {}
        # Finished sequences, told with the next step; appended on the event loop.
        self._drops: list[str] = []
        self._drops_lock = threading.Lock()
        self.stats = stats if stats is not None else ClientStats()
        # When each connection's layer in flight was sent.
        self._sent_at = [0.0] * num_conns

    # -- connection --------------------------------------------------------

    def available(self) -> bool:
        """Connected, or connected now; False while the node is down."""
        if self._socks:
            return True
        if self._clock() < self._down_until:
            return False
        try:
            self._socks = [self._connect() for _ in range(self._num_conns)]
        except (OSError, OffloadError) as exc:
            self.fail(f"connect: {exc}")
            return False
        return True

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self._addr, timeout=self._timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            kind, _, nonce = _recv_frame(sock)
            if kind is not Kind.CHALLENGE:
                raise OffloadError(f"expected CHALLENGE, got {kind.name}")
            mac = hello_mac(self._secret, bytes(nonce), self._node_id, self.shape)
            hello = {"node": self._node_id, "mac": mac, "shape": _shape_dict(self.shape)}
            sock.sendall(frame(Kind.HELLO, encode_json(hello)))
            kind, _, payload = _recv_frame(sock)
            if kind is not Kind.OK:
                raise OffloadError(
                    f"memory node refused: {bytes(payload).decode(errors='replace')}"
                )
        except BaseException:
            sock.close()
            raise
        return sock

    @property
    def num_connections(self) -> int:
        return len(self._socks)

    @property
    def down(self) -> bool:
        """Failed less than ``retry_s`` ago: not to be called yet."""
        return self._clock() < self._down_until

    def holds_nothing(self) -> bool:
        """The memory node holds no sequence of ours that is still wanted:
        closing now loses nothing (the memory node frees the rest)."""
        with self._drops_lock:
            return set(self._held) <= set(self._drops)

    def fail(self, reason: str) -> list[str]:
        """The memory node is down: close everything; the keys of the
        sequences it held, whose KV is lost."""
        for sock in self._socks:
            sock.close()
        self._socks = []
        lost = list(self._held)
        self._held.clear()
        self._down_until = self._clock() + self._retry_s
        self.last_error = reason
        self.stats.last_error = f"{self.address}: {reason}"
        self.stats.failures += 1
        log.warning(
            "memory node unavailable", address=self.address, reason=reason, num_lost=len(lost)
        )
        return lost

    def close(self) -> None:
        for sock in self._socks:
            sock.close()
        self._socks = []

    def drop(self, key: str) -> None:
        """Forget a finished sequence (from any thread)."""
        with self._drops_lock:
            self._drops.append(key)

    def adopt(self, key: str, num_tokens: int) -> None:
        """The memory node holds ``key``'s first ``num_tokens`` (a prefill node
        wrote them there): its first step uploads nothing. Event loop; the
        step thread reads ``_held`` under the same lock when it matters."""
        with self._drops_lock:
            self._held[key] = num_tokens

    @property
    def num_drops(self) -> int:
        return len(self._drops)

    def take_drops(self, keep: set[str]) -> list[str]:
        """The sequences to forget with the next step, but those in ``keep``
        (the step uploads them again: their old KV goes with the upload) and
        those the memory node does not hold (a drop is told to every memory
        node's client: only the holder's matters)."""
        with self._drops_lock:
            drops, self._drops = self._drops, []
        drops = [k for k in drops if k not in keep and k in self._held]
        for key in drops:
            self._held.pop(key, None)
        return drops

    def flush(self) -> None:
        """Tell the memory node of the finished sequences now (the engine is
        idle: no step would carry them); step thread only."""
        drops = self.take_drops(set())
        # Unconnected, the memory node holds nothing of ours: nothing to tell.
        if not self._socks or not drops:
            return
        try:
            self._send(self._socks[0], frame(Kind.DROP, encode_drop(drops)))
        except OffloadError as exc:
            self.fail(str(exc))

    # -- a step ------------------------------------------------------------

    def begin(self, conn: int, seqs: list[StepSeq], source: UploadSource, drops: list[str]) -> None:
        """Upload what the memory node lacks of ``seqs``, then open the step on
        ``conn``, telling it to forget ``drops``."""
        sock = self._socks[conn]
        missing = [s for s in seqs if s.start > 0 and self._held.get(s.key) != s.start]
        for s in missing:
            kv = source(s.key, s.start)
            if kv is None:
                raise OffloadError(f"the memory node lacks the KV of {s.key!r}")
            self._send(sock, frame(Kind.UPLOAD, encode_upload(s.key, kv)))
        for s in missing:
            kind, _, payload = self._recv(sock)
            if kind is not Kind.OK:
                raise OffloadError(f"upload refused: {bytes(payload).decode(errors='replace')}")
            self._held[s.key] = s.start
        self.stats.uploads += len(missing)
        self._send(sock, frame(Kind.STEP, encode_step(seqs, drops)))
        self.stats.steps += 1

    def send_layer(
        self, conn: int, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        qkv = torch.cat((q.reshape(-1), k.reshape(-1), v.reshape(-1)))
        self._send(self._socks[conn], frame(Kind.LAYER, tensor_bytes(qkv), layer))
        self._sent_at[conn] = time.perf_counter()

    def recv_layer(self, conn: int, layer: int, num_tokens: int) -> torch.Tensor:
        """The attention output [T, heads, head_dim] of ``layer``."""
        t0 = time.perf_counter()
        kind, got, payload = self._recv(self._socks[conn])
        t1 = time.perf_counter()
        self.stats.wait_s += t1 - t0
        self.stats.flight_s += t1 - self._sent_at[conn]
        if kind is not Kind.OUT or got != layer:
            raise OffloadError(
                f"layer {layer}: {kind.name} {bytes(payload[:200]).decode(errors='replace')}"
            )
        if len(payload) != self.shape.out_bytes(num_tokens):
            raise OffloadError(f"layer {layer}: {len(payload)} bytes of output")
        self.stats.layers += 1
        s = self.shape
        return bytes_tensor(payload, s.torch_dtype).view(num_tokens, s.num_heads, s.head_dim)

    def end(self, seqs: list[StepSeq]) -> None:
        for s in seqs:
            self._held[s.key] = s.start + s.n

    # -- bytes -------------------------------------------------------------

    def _send(self, sock: socket.socket, data: bytes) -> None:
        try:
            sock.sendall(data)
        except OSError as exc:
            raise OffloadError(f"send: {exc}") from exc
        self.stats.bytes_sent += len(data)

    def _recv(self, sock: socket.socket) -> tuple[Kind, int, bytearray]:
        try:
            kind, layer, payload = _recv_frame(sock)
        except (OSError, ValueError) as exc:
            raise OffloadError(f"receive: {exc or type(exc).__name__}") from exc
        self.stats.bytes_received += len(payload) + HEADER.size
        return kind, layer, payload


def _shape_dict(shape: KVShape) -> dict[str, object]:
    return json.loads(encode_json({k: getattr(shape, k) for k in shape.__dataclass_fields__}))


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        r = sock.recv_into(view[got:])
        if r == 0:
            raise ConnectionError("memory node closed the connection")
        got += r
    return buf


def _recv_frame(sock: socket.socket) -> tuple[Kind, int, bytearray]:
    kind, layer, length = parse_header(bytes(_recv_exact(sock, HEADER.size)))
    return kind, layer, _recv_exact(sock, length) if length else bytearray()


# -- placement's choice of memory node, per request ---------------------------
# (Kept apart: the one point where a request's placement meets this client.)


def memory_node_for(placed: str | None, configured: str) -> str:
    """host:port a request's decode attention goes to: the memory node its
    placement chose (``Request.memory_node``), else ``offload.memory_node``;
    "" where neither names one ("auto" with no choice: attention runs here)."""
    if placed:
        return placed
    return "" if configured in ("", "auto") else configured
