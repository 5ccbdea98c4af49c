"""Wire format of the transfer endpoint: handshake, frames, blocking socket helpers.

Every connection (tcp stream, unix shm channel) opens with a mutual HMAC
challenge-response over the cluster secret:

    server -> HELLO   magic "MCXF", version, server nonce (32 B)
    client -> AUTH    magic, version, channel kind, client nonce (32 B),
                      HMAC(secret, "client" | server nonce | client nonce | node id),
                      node id
    server -> ACCEPT  status, HMAC(secret, "server" | client nonce | server nonce | info),
                      info (JSON: node id, instance, host identity, endpoints)

A client that fails the check gets a REFUSED status and a closed socket; a
server that cannot prove the secret is dropped by the client. After that the
connection carries frames, one request then its response:

    request   FrameHeader(kind, count, payload) + count OpRecords + WRITE payloads
    response  FrameHeader(kind, count, payload) + count StatusRecords + READ payloads

Payloads follow the records in record order and only for ops that passed
their checks, so the receiver always knows where each byte goes before it
arrives: WRITE bytes are received straight into the target segment, READ
bytes straight into the initiator's buffer.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Sequence

import orjson

MAGIC = b"MCXF"
VERSION = 1
NONCE_BYTES = 32
MAC_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0
MAX_NODE_ID_BYTES = 255
MAX_INFO_BYTES = 64 * 1024

# A frame carries at most this many ops: two iovecs per op must stay well
# under IOV_MAX (1024).
MAX_FRAME_OPS = 256
# One op record moves at most this much; larger ops are sliced by the sender.
MAX_RECORD_BYTES = 64 * 1024 * 1024
# Control payloads (lookups) are small.
MAX_CONTROL_BYTES = 1024 * 1024

HELLO = struct.Struct("<4sH2x32s")  # magic, version, server nonce
AUTH = struct.Struct("<4sHH32s32sH")  # magic, version, channel, client nonce, mac, id length
ACCEPT = struct.Struct("<B3x32sI")  # status, mac, info length / reason length
FRAME = struct.Struct("<BxHIQ")  # kind, count, reserved, payload bytes
OP_RECORD = struct.Struct("<BxxxIQQ")  # op, segment id, offset, length
STATUS_RECORD = struct.Struct("<HxxxxxxQ")  # status, aux (segment length when out of range)

ACCEPTED = 0
REFUSED = 1


class Channel(enum.IntEnum):
    STREAM = 1  # tcp data stream
    SHM = 2  # unix socket: shared memory fds


class FrameKind(enum.IntEnum):
    DATA = 1
    LOOKUP = 2
    SHM_OPEN = 3
    RDMA_CONNECT = 4


class OpCode(enum.IntEnum):
    READ = 1
    WRITE = 2


class Status(enum.IntEnum):
    OK = 0
    UNKNOWN_SEGMENT = 1
    OUT_OF_RANGE = 2
    BAD_OP = 3
    DEVICE_ERROR = 4
    # The segment's access rights (or no live grant) do not allow the op.
    FORBIDDEN = 5


class ProtocolError(ConnectionError):
    """The peer broke the wire format; the connection is dropped."""


class AuthError(ConnectionError):
    """The handshake failed: wrong cluster secret, or not our protocol."""


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    h = hmac.new(secret, label, hashlib.sha256)
    for part in parts:
        h.update(struct.pack("<I", len(part)))
        h.update(part)
    return h.digest()


# ---------------------------------------------------------------------------
# Blocking socket helpers (the data path runs in threads; syscalls drop the GIL)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return buf


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    total = len(view)
    while got < total:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionResetError("peer closed the connection")
        got += n


_IOV_CHUNK = 512


def recv_into_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill each view in order from the socket, many per syscall (scatter read)."""
    pending = [v for v in views if len(v)]
    i = 0
    while i < len(pending):
        batch = pending[i : i + _IOV_CHUNK]
        n = sock.recvmsg_into(batch)[0]
        if n == 0:
            raise ConnectionResetError("peer closed the connection")
        i = _advance(pending, i, n)


def send_views(sock: socket.socket, views: Sequence[bytes | bytearray | memoryview]) -> None:
    """Send the buffers in order, many per syscall (gather write), without copying."""
    pending: list[memoryview] = [memoryview(v) for v in views if len(v)]
    i = 0
    while i < len(pending):
        i = _advance(pending, i, sock.sendmsg(pending[i : i + _IOV_CHUNK]))


def _advance(pending: list[memoryview], i: int, n: int) -> int:
    """After ``n`` bytes moved from ``pending[i:]``: past the views moved whole,
    a partly moved one trimmed to its rest; the index of the next view."""
    while n and i < len(pending):
        size = len(pending[i])
        if n >= size:
            n -= size
            i += 1
        else:
            pending[i] = pending[i][n:]
            n = 0
    return i


def drain(sock: socket.socket, n: int, scratch: memoryview) -> None:
    """Read and drop n bytes (the payload of a refused WRITE)."""
    while n:
        chunk = scratch[: min(n, len(scratch))]
        recv_into_exact(sock, chunk)
        n -= len(chunk)


# ---------------------------------------------------------------------------
# Handshake


def server_handshake(
    sock: socket.socket, secret: bytes, info: dict[str, object]
) -> tuple[str, Channel]:
    """Authenticate a client; returns its node id and channel kind.

    Raises AuthError after telling the client why it was refused.
    """
    server_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(HELLO.pack(MAGIC, VERSION, server_nonce))
    raw = recv_exact(sock, AUTH.size)
    magic, version, channel, client_nonce, mac, id_len = AUTH.unpack(raw)
    if magic != MAGIC:
        raise AuthError("not a mooncaked transfer client")
    if version != VERSION:
        _refuse(sock, f"protocol version {version} is not supported (want {VERSION})")
        raise AuthError(f"client speaks protocol version {version}")
    if id_len == 0 or id_len > MAX_NODE_ID_BYTES or channel not in (1, 2):
        _refuse(sock, "malformed handshake")
        raise AuthError("malformed handshake")
    node_id_raw = bytes(recv_exact(sock, id_len))
    expected = _mac(secret, b"mooncaked-xfer-client", server_nonce, client_nonce, node_id_raw)
    if not hmac.compare_digest(mac, expected):
        _refuse(sock, "authentication failed: wrong cluster secret")
        raise AuthError("authentication failed: wrong cluster secret")
    info_raw = orjson.dumps(info)
    reply = _mac(secret, b"mooncaked-xfer-server", client_nonce, server_nonce, info_raw)
    sock.sendall(ACCEPT.pack(ACCEPTED, reply, len(info_raw)) + info_raw)
    return node_id_raw.decode("utf-8", "replace"), Channel(channel)


def _refuse(sock: socket.socket, reason: str) -> None:
    raw = reason.encode()
    try:
        sock.sendall(ACCEPT.pack(REFUSED, bytes(MAC_BYTES), len(raw)) + raw)
    except OSError:
        pass


def client_handshake(
    sock: socket.socket, secret: bytes, node_id: str, channel: Channel
) -> dict[str, object]:
    """Authenticate to a server and authenticate it back; returns its info."""
    magic, version, server_nonce = HELLO.unpack(recv_exact(sock, HELLO.size))
    if magic != MAGIC:
        raise AuthError("peer is not a mooncaked transfer endpoint")
    if version != VERSION:
        raise AuthError(f"peer speaks protocol version {version}, we speak {VERSION}")
    client_nonce = os.urandom(NONCE_BYTES)
    node_id_raw = node_id.encode()
    mac = _mac(secret, b"mooncaked-xfer-client", server_nonce, client_nonce, node_id_raw)
    sock.sendall(
        AUTH.pack(MAGIC, VERSION, int(channel), client_nonce, mac, len(node_id_raw)) + node_id_raw
    )
    status, reply, size = ACCEPT.unpack(recv_exact(sock, ACCEPT.size))
    if size > MAX_INFO_BYTES:
        raise AuthError("peer sent an oversized handshake")
    body = bytes(recv_exact(sock, size))
    if status != ACCEPTED:
        raise AuthError(f"peer refused the handshake: {body.decode('utf-8', 'replace')}")
    expected = _mac(secret, b"mooncaked-xfer-server", client_nonce, server_nonce, body)
    if not hmac.compare_digest(reply, expected):
        raise AuthError("peer failed to prove the cluster secret")
    info = orjson.loads(body)
    if not isinstance(info, dict):
        raise AuthError("peer sent a malformed handshake")
    return info


# ---------------------------------------------------------------------------
# Control frames (lookups): JSON both ways


def send_control(sock: socket.socket, kind: FrameKind, body: object) -> None:
    raw = orjson.dumps(body)
    sock.sendall(FRAME.pack(int(kind), 0, 0, len(raw)) + raw)


def recv_control(sock: socket.socket, kind: FrameKind) -> object:
    got_kind, _count, _reserved, size = FRAME.unpack(recv_exact(sock, FRAME.size))
    if got_kind != kind or size > MAX_CONTROL_BYTES:
        raise ProtocolError(f"expected a {kind.name} reply, got kind {got_kind} of {size} bytes")
    return orjson.loads(bytes(recv_exact(sock, size)))
