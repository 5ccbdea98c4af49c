"""TCP transport, initiator side: persistent authenticated streams per peer.

Slices of every batch bound for a peer go into one queue; each stream is a
thread that takes up to a frame's worth of slices, sends them as one frame
(gather write, payloads straight from the registered buffers) and lands the
READ bytes straight in their destination (scatter read). Streams pull work
as they free up, so big ops spread over all of them and small ops pack into
frames. A broken stream puts its unfinished slices back on the queue (each
slice retried at most ``max_retries`` times), reconnects, and goes on.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog

from mooncaked.config import TransferConfig
from mooncaked.transfer import protocol as p
from mooncaked.transfer.access import Access, parse_access
from mooncaked.transfer.batch import Batch, OpKind, Slice, TransferMetrics
from mooncaked.transfer.server import tune_socket
from mooncaked.transfer.threads import ThreadGroup

log = structlog.get_logger(__name__)

CONNECT_TIMEOUT_S = 5.0
# A frame packs small slices up to this many bytes; one bigger slice goes alone.
FRAME_BYTES = 1024 * 1024
_BACKOFF_S = (0.05, 0.1, 0.2, 0.4, 0.8)


@dataclass(frozen=True, slots=True)
class RemoteSegment:
    name: str
    seg_id: int
    length: int
    location: str
    shm: bool
    # (addr, rkey) of its RDMA memory region, when the peer serves RDMA.
    rdma: tuple[int, int] | None = None
    access: Access = Access.READ

    def allows(self, kind: OpKind) -> bool:
        """The peer lets us do ``kind`` to it at all (a GRANTED segment's
        writes are checked against grants there)."""
        return self.access.peers_read if kind is OpKind.READ else self.access.peers_write


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"transfer address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def _rdma_region(value: Any) -> tuple[int, int] | None:
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    return None


class PeerLink:
    """One peer as seen from here: address, proven identity, segment cache, and
    a control connection for lookups.

    Used from the event loop (through ``asyncio.to_thread``) and from stream
    threads; the cache and the control socket each have a lock.
    """

    def __init__(
        self,
        node_id: str,
        address: str,
        local_node_id: str,
        secret: bytes,
        metrics: TransferMetrics,
        on_new_instance: Callable[[PeerLink], None] | None = None,
    ) -> None:
        parse_address(address)
        self.node_id = node_id
        self.address = address
        self.info: dict[str, Any] = {}
        self.local_node_id = local_node_id
        self.secret = secret
        self._metrics = metrics
        self._on_new_instance = on_new_instance
        self._segments: dict[str, RemoteSegment] = {}
        self._lock = threading.Lock()
        self._control: socket.socket | None = None
        self._control_lock = threading.Lock()
        self.closed = False

    @property
    def instance(self) -> str:
        return str(self.info.get("instance", ""))

    def set_address(self, address: str) -> None:
        parse_address(address)
        if address != self.address:
            self.address = address
            self.drop_control()

    def connect(
        self,
        channel: p.Channel = p.Channel.STREAM,
        timeout: float = CONNECT_TIMEOUT_S,
        publish: Callable[[socket.socket], None] | None = None,
    ) -> socket.socket:
        """Open and authenticate a tcp connection to the peer. ``publish`` sees
        the socket before the handshake, so another thread can cut it short."""
        host, port = parse_address(self.address)
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            if publish is not None:
                publish(sock)
            tune_socket(sock)
            info = p.client_handshake(sock, self.secret, self.local_node_id, channel)
            self._accept_info(info)
        except BaseException:
            sock.close()
            raise
        return sock

    def _accept_info(self, info: dict[str, Any]) -> None:
        if info.get("node_id") != self.node_id:
            raise p.AuthError(
                f"{self.address} is node {info.get('node_id')!r}, not {self.node_id!r}"
            )
        new_instance = bool(self.info) and info.get("instance") != self.info.get("instance")
        self.info = info
        if new_instance:
            # The peer restarted: every segment id we hold is stale.
            self.invalidate()
            log.info("transfer peer restarted", peer=self.node_id)
            if self._on_new_instance is not None:
                self._on_new_instance(self)

    def cached(self, name: str) -> RemoteSegment | None:
        return self._segments.get(name)

    def invalidate(self, name: str | None = None) -> None:
        with self._lock:
            if name is None:
                self._segments.clear()
            else:
                self._segments.pop(name, None)

    def lookup(
        self, names: Iterable[str], sock: socket.socket | None = None
    ) -> dict[str, RemoteSegment | None]:
        """Resolve segment names on the peer (blocking). Uses ``sock`` if given
        (a stream's own connection), else the control connection."""
        names = list(dict.fromkeys(names))
        if sock is not None:
            return self._lookup_on(sock, names)
        with self._control_lock:
            for attempt in range(2):
                if self._control is None:
                    self._control = self.connect()
                    self._control.settimeout(CONNECT_TIMEOUT_S)
                try:
                    return self._lookup_on(self._control, names)
                except p.AuthError:
                    self._close_control_locked()
                    raise
                except (OSError, p.ProtocolError):
                    self._close_control_locked()
                    if attempt == 1:
                        raise
        raise RuntimeError("unreachable")

    def _lookup_on(self, sock: socket.socket, names: list[str]) -> dict[str, RemoteSegment | None]:
        p.send_control(sock, p.FrameKind.LOOKUP, {"names": names})
        reply = p.recv_control(sock, p.FrameKind.LOOKUP)
        entries = reply.get("segments") if isinstance(reply, dict) else None
        if not isinstance(entries, list) or len(entries) != len(names):
            raise p.ProtocolError("malformed lookup reply")
        found: dict[str, RemoteSegment | None] = {}
        with self._lock:
            for name, entry in zip(names, entries, strict=True):
                if entry is None:
                    self._segments.pop(name, None)
                    found[name] = None
                    continue
                try:
                    access = parse_access(entry.get("access"))
                except ValueError as exc:
                    raise p.ProtocolError(f"malformed lookup reply: {exc}") from None
                seg = RemoteSegment(
                    name=name,
                    seg_id=int(entry["id"]),
                    length=int(entry["length"]),
                    location=str(entry["location"]),
                    shm=bool(entry.get("shm")),
                    rdma=_rdma_region(entry.get("rdma")),
                    access=access,
                )
                self._segments[name] = seg
                found[name] = seg
        return found

    def drop_control(self) -> None:
        with self._control_lock:
            self._close_control_locked()

    def _close_control_locked(self) -> None:
        if self._control is not None:
            with contextlib.suppress(OSError):
                self._control.close()
            self._control = None

    def close(self) -> None:
        self.closed = True
        self.drop_control()


def _hung_up(sock: socket.socket) -> bool:
    """Whether an idle connection was closed by the peer (peeks, never waits)."""
    timeout = sock.gettimeout()
    sock.settimeout(0.0)
    try:
        # EOF, or bytes nobody asked for: either way the stream is unusable.
        sock.recv(1, socket.MSG_PEEK)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.settimeout(timeout)


class _Stream:
    __slots__ = ("inflight", "sock")

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.inflight: list[Slice] = []


class TcpPeer:
    """The data streams to one peer and their shared work queue."""

    def __init__(self, link: PeerLink, config: TransferConfig, metrics: TransferMetrics) -> None:
        self.link = link
        self._config = config
        self._metrics = metrics
        self._queue: collections.deque[Slice] = collections.deque()
        self._cond = threading.Condition()
        self._streams = [_Stream() for _ in range(config.streams_per_peer)]
        self._threads = ThreadGroup(f"xfer-tcp-{link.node_id}")
        self._started = False
        self._closed = False
        self._stop = threading.Event()

    @property
    def queued(self) -> int:
        """Slices waiting for a stream. Not bounded here: each belongs to a
        batch its caller awaits, and holds references, not copies."""
        return len(self._queue)

    def submit(self, slices: list[Slice]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"tcp transport to {self.link.node_id} is closed")
            self._queue.extend(slices)
            if not self._started:
                self._started = True
                for i, stream in enumerate(self._streams):
                    self._threads.start(f"stream-{i}", lambda s=stream: self._run(s))
            self._cond.notify_all()

    def abort(self, batch: Batch) -> int:
        """Cut the streams carrying slices of ``batch`` (it timed out); the
        slices of other batches on them are retried. Returns streams cut."""
        cut = 0
        for stream in self._streams:
            sock = stream.sock
            if sock is not None and any(s.batch is batch for s in list(stream.inflight)):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                cut += 1
        return cut

    def disconnect(self) -> None:
        """Cut every stream; queued and in-flight work is retried on new ones."""
        for stream in self._streams:
            sock = stream.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    async def close(self) -> None:
        with self._cond:
            self._closed = True
            self._stop.set()
            self._cond.notify_all()
        self.disconnect()
        await self._threads.join_async(10.0)
        # Whatever is left never reached the wire.
        with self._cond:
            left = list(self._queue)
            self._queue.clear()
        for s in left:
            s.batch.slice_failed(s, f"transfer engine closed before reaching {self.link.node_id}")

    # -- stream thread ----------------------------------------------------

    def _take(self) -> tuple[list[Slice], bool] | None:
        """Block for work; returns a frame's worth of live slices and whether
        the stream sat idle first, or None on close."""
        waited = False
        with self._cond:
            while True:
                while not self._queue and not self._closed:
                    waited = True
                    self._cond.wait()
                if self._closed:
                    return None
                frame: list[Slice] = []
                nbytes = 0
                while self._queue and len(frame) < p.MAX_FRAME_OPS:
                    s = self._queue[0]
                    if not s.live:
                        self._queue.popleft()
                        s.batch.slice_dropped(s)
                        continue
                    if frame and nbytes + s.length > FRAME_BYTES:
                        break
                    self._queue.popleft()
                    frame.append(s)
                    nbytes += s.length
                if frame:
                    return frame, waited

    def _requeue(self, slices: list[Slice], reason: str) -> None:
        retry: list[Slice] = []
        for s in slices:
            if not s.live:
                s.batch.slice_dropped(s)
            elif s.attempts >= self._config.max_retries:
                s.batch.slice_failed(s, f"{reason} (gave up after {s.attempts + 1} attempts)")
            else:
                s.attempts += 1
                retry.append(s)
        if retry:
            self._metrics.add("slices_retried", len(retry))
            with self._cond:
                self._queue.extendleft(reversed(retry))
                self._cond.notify_all()

    def _fail_queued(self, reason: str) -> None:
        with self._cond:
            left = list(self._queue)
            self._queue.clear()
        for s in left:
            s.batch.slice_failed(s, reason)

    def _connect(self, stream: _Stream, frame: list[Slice]) -> str | None:
        """Connect with backoff; returns why it could not, or None.

        The frame is published as in flight while connecting, so a batch that
        times out meanwhile cuts the attempt short instead of waiting it out.
        """
        reason = ""
        attempts = self._config.max_retries + 1
        stream.inflight = frame
        try:
            for attempt in range(attempts):
                if self._stop.is_set():
                    return "transfer engine closed"
                if not any(s.live for s in frame):
                    return "no live work"
                try:
                    sock = self.link.connect(
                        timeout=min(CONNECT_TIMEOUT_S, self._config.op_timeout_s),
                        publish=lambda sock: setattr(stream, "sock", sock),
                    )
                    sock.settimeout(self._config.op_timeout_s)
                    stream.sock = sock
                    return None
                except p.AuthError as exc:
                    stream.sock = None
                    return (
                        f"cannot authenticate to node {self.link.node_id} at "
                        f"{self.link.address}: {exc}"
                    )
                except OSError as exc:
                    stream.sock = None
                    reason = (
                        f"cannot connect to node {self.link.node_id} at {self.link.address}: {exc}"
                    )
                if attempt + 1 < attempts:
                    self._stop.wait(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
            return f"{reason} ({attempts} attempts)"
        finally:
            stream.inflight = []

    def _run(self, stream: _Stream) -> None:
        while True:
            taken = self._take()
            if taken is None:
                break
            frame, waited = taken
            if stream.sock is not None and waited and _hung_up(stream.sock):
                # The peer closed this idle connection (it restarted, or an
                # idle timeout): reconnect without charging the work a retry.
                stream.sock.close()
                stream.sock = None
            if stream.sock is None:
                reason = self._connect(stream, frame)
                if reason is not None and not any(s.live for s in frame):
                    for s in frame:
                        s.batch.slice_dropped(s)
                    continue
                if reason is not None:
                    # The peer is unreachable now: fail what waits for it;
                    # the next batch tries again.
                    for s in frame:
                        s.batch.slice_failed(s, reason)
                    self._fail_queued(reason)
                    continue
                self._metrics.add("reconnects", 1)
            stream.inflight = frame
            try:
                retry = self._exchange(stream.sock, frame)  # type: ignore[arg-type]
            except (OSError, p.ProtocolError) as exc:
                if stream.sock is not None:
                    stream.sock.close()
                    stream.sock = None
                stream.inflight = []
                self._requeue(
                    frame, f"connection to node {self.link.node_id} lost mid-transfer: {exc!r}"
                )
                continue
            stream.inflight = []
            if retry:
                self._requeue(retry, f"segment vanished on node {self.link.node_id}")
        if stream.sock is not None:
            stream.sock.close()
            stream.sock = None

    def _exchange(self, sock: socket.socket, frame: list[Slice]) -> list[Slice]:
        """Send one frame and land its response; returns slices to retry."""
        ids = self._send_frame(sock, frame)
        statuses = self._land_response(sock, frame)
        return self._report(frame, ids, statuses)

    def _send_frame(self, sock: socket.socket, frame: list[Slice]) -> list[int]:
        """Send a frame's op records and WRITE payloads; the segment id of each op
        (0 where the name is unknown to the peer)."""
        link = self.link
        ids: list[int] = []
        missing = [s.remote_name for s in frame if link.cached(s.remote_name) is None]
        if missing:
            link.lookup(missing, sock)
        records = bytearray(len(frame) * p.OP_RECORD.size)
        views: list[Any] = [b"", records]
        write_total = 0
        for i, s in enumerate(frame):
            remote = link.cached(s.remote_name)
            seg_id = remote.seg_id if remote is not None else 0
            ids.append(seg_id)
            p.OP_RECORD.pack_into(
                records, i * p.OP_RECORD.size, int(s.kind), seg_id, s.remote_offset, s.length
            )
            if s.kind is OpKind.WRITE:
                views.append(s.local.source(s.local_offset, s.length))
                write_total += s.length
        views[0] = p.FRAME.pack(p.FrameKind.DATA, len(frame), 0, write_total)
        p.send_views(sock, views)
        return ids

    def _land_response(self, sock: socket.socket, frame: list[Slice]) -> list[tuple[int, int]]:
        """Receive a frame's status records and READ payloads; the (status, aux)
        of each op."""
        head = p.recv_exact(sock, p.FRAME.size + len(frame) * p.STATUS_RECORD.size)
        kind, count, _reserved, read_total = p.FRAME.unpack_from(head, 0)
        if kind != p.FrameKind.DATA or count != len(frame):
            raise p.ProtocolError(f"response of kind {kind} for {count} ops, sent {len(frame)}")
        statuses = list(p.STATUS_RECORD.iter_unpack(memoryview(head)[p.FRAME.size :]))
        dests: list[memoryview] = []
        commits: list[Callable[[], None]] = []
        expect = 0
        for s, (status, _aux) in zip(frame, statuses, strict=True):
            if s.kind is OpKind.READ and status == p.Status.OK:
                view, commit = s.local.destination(s.local_offset, s.length)
                dests.append(view)
                expect += s.length
                if commit is not None:
                    commits.append(commit)
        if expect != read_total:
            raise p.ProtocolError(f"response carries {read_total} bytes, expected {expect}")
        if dests:
            p.recv_into_views(sock, dests)
        for commit in commits:
            commit()
        return statuses

    def _report(
        self, frame: list[Slice], ids: list[int], statuses: list[tuple[int, int]]
    ) -> list[Slice]:
        """Report each slice of an answered frame to its batch; the ones to retry."""
        link = self.link
        retry: list[Slice] = []
        done: list[Slice] = []
        for s, seg_id, (status, aux) in zip(frame, ids, statuses, strict=True):
            if status == p.Status.OK:
                if done and done[-1].batch is not s.batch:
                    done[-1].batch.slices_done(done)
                    done = []
                done.append(s)
            elif status == p.Status.UNKNOWN_SEGMENT:
                if seg_id and s.attempts < self._config.max_retries:
                    # Our id may be stale (re-registered, or the peer
                    # restarted): look the name up again once.
                    link.invalidate(s.remote_name)
                    retry.append(s)
                else:
                    s.batch.slice_failed(
                        s, f"segment {s.remote_name!r} is not registered on node {link.node_id}"
                    )
            elif status == p.Status.OUT_OF_RANGE:
                s.batch.slice_failed(
                    s,
                    f"range [{s.remote_offset}, {s.remote_offset + s.length}) is outside "
                    f"segment {s.remote_name!r} of {aux} bytes on node {link.node_id}",
                )
            elif status == p.Status.FORBIDDEN:
                what = "write" if s.kind is OpKind.WRITE else "read"
                s.batch.slice_failed(
                    s,
                    f"node {link.node_id} refused to let this node {what} "
                    f"[{s.remote_offset}, {s.remote_offset + s.length}) of segment "
                    f"{s.remote_name!r}: no access right or live grant covers it",
                )
            else:
                s.batch.slice_failed(
                    s, f"node {link.node_id} could not serve the op (status {status})"
                )
        if done:
            done[-1].batch.slices_done(done)
        return retry
