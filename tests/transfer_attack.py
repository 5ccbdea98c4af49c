"""A peer that holds the cluster secret and speaks the transfer wire format by
hand, not through our client (which refuses ops a segment's rights forbid
before they leave): the attacker of the segment access tests."""

from __future__ import annotations

import socket

from mooncaked.transfer import protocol as p
from mooncaked.transfer.tcp import parse_address


def raw_write(
    address: str, secret: bytes, node_id: str, segment: str, offset: int, data: bytes | None
) -> tuple[int, int]:
    """Authenticate as ``node_id``, WRITE ``data`` (None: zeros over the whole
    segment) at ``offset`` of ``segment`` in one frame; (status, bytes sent)."""
    host, port = parse_address(address)
    with socket.create_connection((host, port), timeout=10.0) as sock:
        p.client_handshake(sock, secret, node_id, p.Channel.STREAM)
        p.send_control(sock, p.FrameKind.LOOKUP, {"names": [segment]})
        reply = p.recv_control(sock, p.FrameKind.LOOKUP)
        entry = reply["segments"][0]  # type: ignore[index]
        if entry is None:
            raise LookupError(f"segment {segment!r} is not registered at {address}")
        if data is None:
            data = bytes(int(entry["length"]) - offset)
        record = p.OP_RECORD.pack(p.OpCode.WRITE, int(entry["id"]), offset, len(data))
        sock.sendall(p.FRAME.pack(p.FrameKind.DATA, 1, 0, len(data)) + record)
        sock.sendall(data)
        head = p.recv_exact(sock, p.FRAME.size + p.STATUS_RECORD.size)
        status, _aux = p.STATUS_RECORD.unpack_from(head, p.FRAME.size)
        # The connection still serves: a refused payload is swallowed, not
        # left to be read as the next frame.
        p.send_control(sock, p.FrameKind.LOOKUP, {"names": [segment]})
        p.recv_control(sock, p.FrameKind.LOOKUP)
        return int(status), len(data)
