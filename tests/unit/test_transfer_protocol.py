"""Wire protocol: the mutual HMAC handshake and the scatter/gather helpers."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from mooncaked.transfer import protocol as p

SECRET = b"unit-test-secret"


def _pair_run(
    server: Callable[[socket.socket], Any], client: Callable[[socket.socket], Any]
) -> tuple[Any, Any]:
    """Run server and client ends over a real socket pair; return (server, client)
    results, each either a value or the exception it raised."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    out: dict[str, Any] = {}

    def run(name: str, fn: Callable[[socket.socket], Any], sock: socket.socket) -> None:
        try:
            out[name] = fn(sock)
        except Exception as exc:
            out[name] = exc
        finally:
            sock.close()

    t = threading.Thread(target=run, args=("server", server, a))
    t.start()
    run("client", client, b)
    t.join(5)
    return out["server"], out["client"]


def test_handshake_authenticates_both_ends() -> None:
    info = {"node_id": "srv", "instance": "abc"}
    server, client = _pair_run(
        lambda s: p.server_handshake(s, SECRET, info),
        lambda s: p.client_handshake(s, SECRET, "cli", p.Channel.STREAM),
    )
    assert server == ("cli", p.Channel.STREAM)
    assert client == info


def test_wrong_secret_is_refused_with_a_reason() -> None:
    server, client = _pair_run(
        lambda s: p.server_handshake(s, SECRET, {"node_id": "srv"}),
        lambda s: p.client_handshake(s, b"another-secret!", "cli", p.Channel.STREAM),
    )
    assert isinstance(server, p.AuthError)
    assert isinstance(client, p.AuthError)
    assert "wrong cluster secret" in str(client)


def test_client_drops_a_server_that_cannot_prove_the_secret() -> None:
    def impostor(sock: socket.socket) -> None:
        # Plays the server's part without the secret: accepts anyone.
        nonce = os.urandom(p.NONCE_BYTES)
        sock.sendall(p.HELLO.pack(p.MAGIC, p.VERSION, nonce))
        raw = p.recv_exact(sock, p.AUTH.size)
        p.recv_exact(sock, p.AUTH.unpack(raw)[-1])
        body = b'{"node_id": "srv"}'
        sock.sendall(p.ACCEPT.pack(p.ACCEPTED, bytes(p.MAC_BYTES), len(body)) + body)

    _, client = _pair_run(
        impostor, lambda s: p.client_handshake(s, SECRET, "cli", p.Channel.STREAM)
    )
    assert isinstance(client, p.AuthError)
    assert "failed to prove the cluster secret" in str(client)


def test_version_mismatch_is_explained() -> None:
    def old_client(sock: socket.socket) -> Any:
        p.recv_exact(sock, p.HELLO.size)
        sock.sendall(p.AUTH.pack(p.MAGIC, p.VERSION + 1, 1, bytes(32), bytes(32), 3) + b"cli")
        status, _, size = p.ACCEPT.unpack(p.recv_exact(sock, p.ACCEPT.size))
        return status, bytes(p.recv_exact(sock, size))

    server, client = _pair_run(lambda s: p.server_handshake(s, SECRET, {}), old_client)
    assert isinstance(server, p.AuthError)
    assert client[0] == p.REFUSED
    assert b"protocol version" in client[1]


def test_send_views_and_recv_into_views_move_exact_bytes() -> None:
    rng = __import__("random").Random(3)
    sizes = [0, 1, 7, 4096, 65536, 1 << 20, 3, 0, 250_000]
    sizes += [rng.randrange(1, 5000) for _ in range(700)]  # more than one iovec batch
    src = [os.urandom(n) for n in sizes]
    dst = [bytearray(n) for n in sizes]

    def sender(sock: socket.socket) -> None:
        p.send_views(sock, src)

    def receiver(sock: socket.socket) -> None:
        p.recv_into_views(sock, [memoryview(d) for d in dst])

    server, client = _pair_run(sender, receiver)
    assert server is None and client is None
    assert [bytes(d) for d in dst] == src


def test_recv_into_views_reports_a_closed_peer() -> None:
    server, client = _pair_run(
        lambda s: s.sendall(b"abc"),
        lambda s: p.recv_into_views(s, [memoryview(bytearray(10))]),
    )
    assert server is None
    assert isinstance(client, ConnectionResetError)


def test_frame_records_are_fixed_size() -> None:
    # The server reads exactly count * size bytes before any payload.
    assert p.FRAME.size == 16
    assert p.OP_RECORD.size == 24
    assert p.STATUS_RECORD.size == 16
    rec = p.OP_RECORD.pack(p.OpCode.WRITE, 7, 2**40, 123)
    assert p.OP_RECORD.unpack(rec) == (p.OpCode.WRITE, 7, 2**40, 123)


def test_control_frames_round_trip_and_refuse_oversize() -> None:
    body = {"names": ["pool", "kv.0"]}
    server, client = _pair_run(
        lambda s: p.recv_control(s, p.FrameKind.LOOKUP),
        lambda s: p.send_control(s, p.FrameKind.LOOKUP, body),
    )
    assert server == body and client is None

    server, _ = _pair_run(
        lambda s: p.recv_control(s, p.FrameKind.LOOKUP),
        lambda s: s.sendall(p.FRAME.pack(p.FrameKind.LOOKUP, 0, 0, p.MAX_CONTROL_BYTES + 1)),
    )
    assert isinstance(server, p.ProtocolError)
