"""The serving side of the transfer endpoint.

Accepts on a tcp listener (data streams, lookups) and, when shared memory is
enabled, on an abstract unix socket (shared-memory fds for peers on this
host). Each accepted connection is authenticated, then served by a thread of
its own doing blocking I/O: WRITE payloads are received straight into the
target segment and READs are sent straight from it. Every op is checked
against its segment first (range, and the access rights: a WRITE lands only
in a segment peers may write, and in a GRANTED one only inside a live grant
to the connection's authenticated peer); a bad op is answered with a status,
its payload is swallowed unwritten, and the connection keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog

from mooncaked.tasks import TaskSet
from mooncaked.transfer import protocol as p
from mooncaked.transfer.access import Access, GrantTable
from mooncaked.transfer.batch import TransferMetrics
from mooncaked.transfer.segment import Segment, SegmentTable
from mooncaked.transfer.threads import ThreadGroup

log = structlog.get_logger(__name__)

# Most connections served at once; beyond it new ones are closed at accept.
MAX_CONNECTIONS = 1024
_SCRATCH_BYTES = 1024 * 1024

# SHM_OPEN reply: status, registry slot, segment length, registry slots.
SHM_REPLY = struct.Struct("<HxxIQI")


@dataclass(slots=True)
class _Frame:
    """One data frame being served: its status records, the views its payload
    lands in and its reply is sent from, and what it adds to the counters."""

    statuses: bytearray
    write_views: list[memoryview] = field(default_factory=list)
    read_views: list[memoryview] = field(default_factory=list)
    commits: list[Callable[[], None]] = field(default_factory=list)
    write_total: int = 0
    read_total: int = 0
    errors: int = 0
    # The first op refused by access rights, logged once per frame.
    refused: tuple[Segment, str, int, int] | None = None
    num_refused: int = 0


def tune_socket(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class TransferServer:
    def __init__(
        self,
        table: SegmentTable,
        grants: GrantTable,
        secret: bytes,
        metrics: TransferMetrics,
        info: Callable[[], dict[str, Any]],
        shm_fds: Callable[[Segment], tuple[int, int, int] | None] | None = None,
        rdma_region: Callable[[Segment], tuple[int, int] | None] | None = None,
        rdma_accept: Callable[[str, Any], Any] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``info`` gives the handshake info; ``shm_fds`` maps a shared segment to
        (its fd, registry fd, registry slot), or None if it cannot be shared;
        ``rdma_region`` gives a segment's (addr, rkey); ``rdma_accept`` connects a
        QP for a peer's RDMA_CONNECT body and returns the reply body;
        ``on_failure`` hears of an accept loop that died (the node cannot serve
        transfers any more)."""
        self._table = table
        self._grants = grants
        self._secret = secret
        self._metrics = metrics
        self._info = info
        self._shm_fds = shm_fds
        self._rdma_region = rdma_region
        self._rdma_accept = rdma_accept
        self._listeners: list[socket.socket] = []
        self._accept_tasks = TaskSet("xfer-accept", on_failure=on_failure)
        self._threads = ThreadGroup("xfer-serve")
        self._conns: set[socket.socket] = set()
        self._closing = False
        self.address = ""
        self.unix_address = ""

    async def start(self, host: str, port: int, unix_name: str | None) -> None:
        try:
            tcp = socket.create_server((host, port), backlog=256, reuse_port=False)
            tcp.setblocking(False)
            self._listeners.append(tcp)
            bound_host, bound_port = tcp.getsockname()[:2]
            self.address = f"{bound_host}:{bound_port}"
            self._accept_tasks.spawn(self._accept_loop(tcp, p.Channel.STREAM), "xfer-accept-tcp")
            if unix_name is not None:
                unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                # Abstract namespace: no file to clean up, reachable only from
                # this host's network namespace; the handshake still applies.
                unix.bind("\0" + unix_name)
                unix.listen(64)
                unix.setblocking(False)
                self._listeners.append(unix)
                self.unix_address = unix_name
                self._accept_tasks.spawn(self._accept_loop(unix, p.Channel.SHM), "xfer-accept-unix")
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        self._closing = True
        self._accept_tasks.cancel()
        await self._accept_tasks.wait()
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()
        self.drop_connections()
        await self._threads.join_async(5.0)

    def drop_connections(self) -> int:
        """Cut every served connection (peers reconnect); returns how many."""
        conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        return len(conns)

    @property
    def num_connections(self) -> int:
        return len(self._conns)

    async def _accept_loop(self, listener: socket.socket, channel: p.Channel) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:
                if self._closing:
                    return
                log.warning("transfer accept failed", error=str(exc))
                continue
            if len(self._conns) >= MAX_CONNECTIONS:
                log.warning("transfer connection limit reached; refusing", limit=MAX_CONNECTIONS)
                conn.close()
                continue
            conn.setblocking(True)
            tune_socket(conn)
            self._conns.add(conn)
            self._threads.start(f"conn-{conn.fileno()}", lambda c=conn: self._serve(c, channel))

    # -- per-connection thread --------------------------------------------

    def _serve(self, conn: socket.socket, channel: p.Channel) -> None:
        peer = "?"
        try:
            conn.settimeout(p.HANDSHAKE_TIMEOUT_S)
            try:
                peer, got_channel = p.server_handshake(conn, self._secret, self._info())
            except p.AuthError as exc:
                self._metrics.add("handshakes_refused", 1)
                log.warning("transfer handshake refused", reason=str(exc))
                return
            if got_channel is not channel:
                log.warning("transfer channel kind mismatch", peer=peer, channel=got_channel.name)
                return
            conn.settimeout(None)
            scratch = memoryview(bytearray(_SCRATCH_BYTES))
            while not self._closing:
                kind, count, _reserved, payload = p.FRAME.unpack(p.recv_exact(conn, p.FRAME.size))
                if kind == p.FrameKind.DATA and channel is p.Channel.STREAM:
                    self._serve_data(conn, peer, count, payload, scratch)
                elif kind == p.FrameKind.LOOKUP:
                    self._serve_lookup(conn, peer, payload)
                elif kind == p.FrameKind.SHM_OPEN and channel is p.Channel.SHM:
                    self._serve_shm_open(conn, peer, payload)
                elif kind == p.FrameKind.RDMA_CONNECT and self._rdma_accept is not None:
                    if payload > p.MAX_CONTROL_BYTES:
                        raise p.ProtocolError(f"rdma connect of {payload} bytes")
                    body = orjson.loads(bytes(p.recv_exact(conn, payload)))
                    p.send_control(conn, p.FrameKind.RDMA_CONNECT, self._rdma_accept(peer, body))
                else:
                    raise p.ProtocolError(f"unexpected frame kind {kind} on {channel.name}")
        except (ConnectionError, TimeoutError, OSError) as exc:
            if not self._closing and not isinstance(exc, ConnectionResetError):
                log.info("transfer connection closed", peer=peer, reason=str(exc))
        except p.ProtocolError as exc:
            log.warning("transfer peer broke the protocol", peer=peer, reason=str(exc))
        finally:
            self._conns.discard(conn)
            conn.close()

    def _offers_shm(self, seg: Segment) -> bool:
        """Hand peers a shared-memory mapping (the segment's fd) of ``seg``?

        Never for a GRANTED segment: the fd maps the whole segment writable in
        the peer's process for as long as it keeps it, and nothing here can
        take it back, so it would outlive the grant that let the peer write.
        Peers write those segments over tcp, each op checked against the live
        grants.
        """
        return seg.access is not Access.GRANTED

    def _offers_rdma(self, seg: Segment, peer: str) -> bool:
        """Hand ``peer`` the RDMA key of ``seg``? A GRANTED segment's key only to
        a peer holding a live grant (the key is good until the region is
        deregistered: like an fd, it outlives the grant)."""
        return seg.access is not Access.GRANTED or self._grants.has_live(seg.name, peer)

    def _serve_lookup(self, conn: socket.socket, peer: str, size: int) -> None:
        if size > p.MAX_CONTROL_BYTES:
            raise p.ProtocolError(f"lookup of {size} bytes")
        body = orjson.loads(bytes(p.recv_exact(conn, size)))
        names = body.get("names") if isinstance(body, dict) else None
        if not isinstance(names, list):
            raise p.ProtocolError("lookup without names")
        entries: list[dict[str, Any] | None] = []
        for name in names:
            seg = self._table.get(name) if isinstance(name, str) else None
            if seg is None:
                entries.append(None)
                continue
            entries.append(
                {
                    "name": seg.name,
                    "id": seg.seg_id,
                    "length": seg.length,
                    "location": seg.location,
                    "access": seg.access.value,
                    "shm": self._offers_shm(seg) and seg.is_shared and self._shm_fds is not None,
                    "rdma": (
                        self._rdma_region(seg)
                        if self._rdma_region is not None and self._offers_rdma(seg, peer)
                        else None
                    ),
                }
            )
        p.send_control(conn, p.FrameKind.LOOKUP, {"segments": entries})

    def _serve_shm_open(self, conn: socket.socket, peer: str, size: int) -> None:
        if size > p.MAX_CONTROL_BYTES:
            raise p.ProtocolError(f"shm open of {size} bytes")
        body = orjson.loads(bytes(p.recv_exact(conn, size)))
        seg_id = body.get("id") if isinstance(body, dict) else None
        seg = self._table.by_id(seg_id) if isinstance(seg_id, int) else None
        if seg is not None and not self._offers_shm(seg):
            self._forbidden(peer, seg, "shm open", 0, seg.length)
            conn.sendall(SHM_REPLY.pack(p.Status.FORBIDDEN, 0, 0, 0))
            return
        fds = self._shm_fds(seg) if (seg is not None and self._shm_fds is not None) else None
        if seg is None or fds is None:
            conn.sendall(SHM_REPLY.pack(p.Status.UNKNOWN_SEGMENT, 0, 0, 0))
            return
        seg_fd, registry_fd, slot = fds
        socket.send_fds(
            conn, [SHM_REPLY.pack(p.Status.OK, slot, seg.length, 0)], [seg_fd, registry_fd]
        )

    def _forbidden(
        self, peer: str, seg: Segment, what: str, offset: int, length: int, count: int = 1
    ) -> None:
        self._metrics.add("served_forbidden", count)
        log.warning(
            "transfer op refused by segment access",
            peer=peer,
            segment=seg.name,
            access=seg.access.value,
            op=what,
            offset=offset,
            length=length,
            ops_refused=count,
        )

    def _allowed(self, seg: Segment, peer: str, op: int, offset: int, length: int) -> bool:
        access = seg.access
        if op == p.OpCode.READ:
            return access.peers_read
        if access is Access.GRANTED:
            return self._grants.allows(seg.name, peer, offset, length)
        return access.peers_write

    def _serve_data(
        self, conn: socket.socket, peer: str, count: int, payload: int, scratch: memoryview
    ) -> None:
        if count == 0 or count > p.MAX_FRAME_OPS:
            raise p.ProtocolError(f"data frame with {count} ops")
        raw = p.recv_exact(conn, count * p.OP_RECORD.size)
        frame = _Frame(bytearray(p.FRAME.size + count * p.STATUS_RECORD.size))
        p.FRAME.pack_into(frame.statuses, 0, p.FrameKind.DATA, count, 0, 0)
        for i, (op, seg_id, offset, length) in enumerate(p.OP_RECORD.iter_unpack(raw)):
            status, aux = self._serve_op(frame, peer, op, seg_id, offset, length, scratch)
            if status is not p.Status.OK:
                frame.errors += 1
            p.STATUS_RECORD.pack_into(
                frame.statuses, p.FRAME.size + i * p.STATUS_RECORD.size, status, aux
            )
        if frame.write_total != payload:
            raise p.ProtocolError(
                f"frame announces {payload} payload bytes, ops need {frame.write_total}"
            )
        if frame.refused is not None:
            self._forbidden(peer, *frame.refused, count=frame.num_refused)
        if frame.write_views:
            p.recv_into_views(conn, frame.write_views)
        for commit in frame.commits:
            commit()
        p.FRAME.pack_into(frame.statuses, 0, p.FrameKind.DATA, count, 0, frame.read_total)
        p.send_views(conn, [frame.statuses, *frame.read_views])
        m = self._metrics
        with m.lock:
            m.served_ops += count
            m.served_errors += frame.errors
            m.served_bytes_read += frame.read_total
            m.served_bytes_written += frame.write_total

    def _serve_op(
        self,
        frame: _Frame,
        peer: str,
        op: int,
        seg_id: int,
        offset: int,
        length: int,
        scratch: memoryview,
    ) -> tuple[p.Status, int]:
        """Check one op of a data frame and add its views to ``frame``; its status
        record (status, aux: the segment's length when out of range)."""
        if length > p.MAX_RECORD_BYTES:
            raise p.ProtocolError(f"op of {length} bytes exceeds {p.MAX_RECORD_BYTES}")
        status = p.Status.OK
        aux = 0
        seg = self._table.by_id(seg_id)
        if op != p.OpCode.READ and op != p.OpCode.WRITE:
            raise p.ProtocolError(f"unknown op code {op}")
        if seg is None:
            status = p.Status.UNKNOWN_SEGMENT
        elif offset + length > seg.length:
            status = p.Status.OUT_OF_RANGE
            aux = seg.length
        elif not self._allowed(seg, peer, op, offset, length):
            status = p.Status.FORBIDDEN
            if frame.refused is None:
                frame.refused = (seg, p.OpCode(op).name, offset, length)
            frame.num_refused += 1
        if op == p.OpCode.WRITE:
            frame.write_total += length
            if status is p.Status.OK:
                try:
                    view, commit = seg.destination(offset, length)  # type: ignore[union-attr]
                except ValueError:
                    # Unregistered between the lookup and here (view released).
                    status = p.Status.UNKNOWN_SEGMENT
                else:
                    frame.write_views.append(view)
                    if commit is not None:
                        frame.commits.append(commit)
            if status is not p.Status.OK:
                # Keep the stream in step: swallow the refused payload.
                left = length
                while left:
                    chunk = min(left, len(scratch))
                    frame.write_views.append(scratch[:chunk])
                    left -= chunk
        elif status is p.Status.OK:
            try:
                frame.read_views.append(seg.source(offset, length))  # type: ignore[union-attr]
                frame.read_total += length
            except ValueError:
                status = p.Status.UNKNOWN_SEGMENT
            except Exception as exc:
                log.warning("reading a device segment failed", error=str(exc))
                status = p.Status.DEVICE_ERROR
        return status, aux
