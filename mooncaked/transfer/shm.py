"""Shared-memory transport for peers on the same host.

A segment backed by shared memory (memfd) can be mapped by a peer on the
same host: the peer asks for it over an authenticated unix socket and gets
the fd itself (SCM_RIGHTS), so reaching the socket and passing the handshake
is the proof that both ends share a host (and an IPC namespace). A transfer
is then a memcpy between two mappings, run in a worker thread (ctypes drops
the GIL for the copy).

Revocation: a mapping outlives the peer's registration, so the peer keeps a
small shared registry, one 8-byte slot per shared segment holding the live
segment id (0 once unregistered). Every copy checks its slot first, and a
peer whose unix socket hung up (it exited) is not used again until it is
reconnected and its segments looked up afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from dataclasses import dataclass

import orjson
import structlog

from mooncaked.transfer import protocol as p
from mooncaked.transfer.batch import OpKind, Slice
from mooncaked.transfer.segment import SharedBuffer, memmove, read_only_fd
from mooncaked.transfer.server import SHM_REPLY
from mooncaked.transfer.tcp import CONNECT_TIMEOUT_S, PeerLink, RemoteSegment

log = structlog.get_logger(__name__)

REGISTRY_SLOTS = 4096


def boot_id() -> str:
    """This host's boot id: equal ids are the cheap first hint of a shared host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class ShmRegistry:
    """Slots of live shared segment ids, in shared memory peers map read-only."""

    def __init__(self, slots: int = REGISTRY_SLOTS) -> None:
        self._buffer = SharedBuffer.create(slots * 8, tag="registry")
        # What peers get: they can only map it read-only.
        self.peer_fd = read_only_fd(self._buffer.fd)
        self._slots = self._buffer.view.cast("Q")
        self._free = list(range(slots - 1, -1, -1))
        self._slot_of: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def fd(self) -> int:
        return self._buffer.fd

    def claim(self, seg_id: int) -> int | None:
        """Give ``seg_id`` a slot; None when all are taken (the segment then
        stays reachable over tcp only)."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            self._slots[slot] = seg_id
            self._slot_of[seg_id] = slot
            return slot

    def slot_of(self, seg_id: int) -> int | None:
        return self._slot_of.get(seg_id)

    def release(self, seg_id: int) -> None:
        with self._lock:
            slot = self._slot_of.pop(seg_id, None)
            if slot is not None:
                self._slots[slot] = 0
                self._free.append(slot)

    def close(self) -> None:
        with self._lock:
            for slot in self._slot_of.values():
                self._slots[slot] = 0
            self._slot_of.clear()
            self._slots.release()
            self._buffer.close()
            os.close(self.peer_fd)


@dataclass(slots=True, eq=False)
class ShmMapping:
    remote: RemoteSegment
    buffer: SharedBuffer
    slot: int


class ShmPeer:
    """The shared-memory session with one peer on this host."""

    def __init__(self, link: PeerLink, sock: socket.socket) -> None:
        self.link = link
        self._sock = sock
        self._lock = threading.Lock()
        self._registry: SharedBuffer | None = None
        self._registry_slots: memoryview | None = None
        self._mappings: dict[int, ShmMapping] = {}
        self.instance = link.instance
        self.dead = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def connect(cls, link: PeerLink) -> ShmPeer:
        """Reach the peer's unix endpoint and authenticate; raises OSError or
        AuthError when the peer is not on this host after all."""
        name = str(link.info.get("shm") or "")
        if not name:
            raise ConnectionError(f"node {link.node_id} offers no shared memory")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect("\0" + name)
            info = p.client_handshake(sock, link.secret, link.local_node_id, p.Channel.SHM)
            if info.get("node_id") != link.node_id or info.get("instance") != link.instance:
                raise p.AuthError(f"unix endpoint {name!r} is not node {link.node_id}")
            # Blocking without a timeout between calls: alive() peeks with
            # MSG_DONTWAIT, which a socket timeout would turn into a wait.
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        return cls(link, sock)

    def alive(self) -> bool:
        """False once the peer hung up (it exited or restarted)."""
        if self.dead:
            return False
        if self._loop is not None:
            return True  # the loop tells us when it hangs up
        return self._probe()

    def _probe(self) -> bool:
        try:
            data = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return bool(data)

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Learn of a hang-up from the event loop instead of a syscall per batch.

        The peer never speaks unasked on this socket, so outside ``open()``
        (call ``unwatch()`` around it) it turns readable only at EOF.
        """
        if self._loop is None and not self.dead:
            self._loop = loop
            loop.add_reader(self._sock.fileno(), self._on_readable)

    def unwatch(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._loop = None

    def _on_readable(self) -> None:
        # EOF, an error, or bytes nobody asked for: this session is over.
        self.dead = True
        self.unwatch()

    def mapping(self, remote: RemoteSegment) -> ShmMapping | None:
        return self._mappings.get(remote.seg_id)

    def open(self, remote: RemoteSegment) -> ShmMapping | None:
        """Map a remote shared segment (blocking); None if the peer declines."""
        with self._lock:
            found = self._mappings.get(remote.seg_id)
            if found is not None:
                return found
            raw = orjson.dumps({"id": remote.seg_id})
            self._sock.settimeout(CONNECT_TIMEOUT_S)
            try:
                self._sock.sendall(p.FRAME.pack(p.FrameKind.SHM_OPEN, 0, 0, len(raw)) + raw)
                data, fds, _flags, _addr = socket.recv_fds(self._sock, SHM_REPLY.size, 2)
            finally:
                self._sock.settimeout(None)
            try:
                if not data:
                    raise ConnectionResetError("peer closed the shared-memory channel")
                while len(data) < SHM_REPLY.size:
                    more = self._sock.recv(SHM_REPLY.size - len(data), socket.MSG_WAITALL)
                    if not more:
                        raise ConnectionResetError("peer closed the shared-memory channel")
                    data += more
                status, slot, length, _ = SHM_REPLY.unpack(data)
                if status != p.Status.OK or len(fds) != 2:
                    return None
                if length != remote.length:
                    raise p.ProtocolError(
                        f"shared segment is {length} bytes, lookup said {remote.length}"
                    )
                # A segment peers may not write comes as a read-only fd.
                buffer = SharedBuffer.attach(fds[0], length, writable=remote.access.peers_write)
                fds[0] = -1
                if self._registry is None:
                    self._registry = SharedBuffer.attach(
                        fds[1], os.fstat(fds[1]).st_size, writable=False
                    )
                    fds[1] = -1
                    self._registry_slots = self._registry.view.cast("Q")
                mapping = ShmMapping(remote, buffer, slot)
                self._mappings[remote.seg_id] = mapping
                return mapping
            finally:
                for fd in fds:
                    if fd >= 0:
                        os.close(fd)

    def forget(self, mapping: ShmMapping) -> None:
        """Drop a mapping (not unmap: a copy may still use it; GC unmaps)."""
        with self._lock:
            if self._mappings.get(mapping.remote.seg_id) is mapping:
                del self._mappings[mapping.remote.seg_id]

    def check_live(self, mapping: ShmMapping) -> str | None:
        """Why ops on ``mapping`` must fail now (the peer unregistered the
        segment), forgetting it so the next batch looks the name up; or None."""
        if self.is_live(mapping):
            return None
        self.forget(mapping)
        self.link.invalidate(mapping.remote.name)
        return f"segment {mapping.remote.name!r} is not registered on node {self.link.node_id}"

    def is_live(self, mapping: ShmMapping) -> bool:
        slots = self._registry_slots
        return (
            slots is not None
            and mapping.slot < len(slots)
            and slots[mapping.slot] == mapping.remote.seg_id
        )

    def copy(self, slices: list[Slice]) -> None:
        """Run the copies (worker thread) and report each slice to its batch."""
        node = self.link.node_id
        done: list[Slice] = []
        mapping: ShmMapping | None = None
        for s in slices:
            if not s.live:
                s.batch.slice_dropped(s)
                continue
            if mapping is None or mapping.remote.name != s.remote_name:
                remote = self.link.cached(s.remote_name)
                mapping = self._mappings.get(remote.seg_id) if remote is not None else None
            if mapping is None or not self.is_live(mapping):
                s.batch.slice_failed(
                    s, f"segment {s.remote_name!r} is not registered on node {node}"
                )
                if mapping is not None:
                    # The next batch looks the name up again.
                    self.forget(mapping)
                    self.link.invalidate(s.remote_name)
                mapping = None
                continue
            if s.kind is OpKind.WRITE and not mapping.buffer.writable:
                s.batch.slice_failed(
                    s, f"segment {s.remote_name!r} on node {node} is read-only to this node"
                )
                continue
            if s.remote_offset + s.length > mapping.buffer.nbytes:
                s.batch.slice_failed(
                    s,
                    f"range [{s.remote_offset}, {s.remote_offset + s.length}) is outside "
                    f"segment {s.remote_name!r} of {mapping.buffer.nbytes} bytes on node {node}",
                )
                continue
            remote_address = mapping.buffer.address + s.remote_offset
            local = s.local
            if local.view is not None:
                # Host memory (the common case), inline: this loop is per op.
                if s.kind is OpKind.READ:
                    memmove(local.address + s.local_offset, remote_address, s.length)
                else:
                    memmove(remote_address, local.address + s.local_offset, s.length)
            else:
                try:
                    copy_slice(s, remote_address)
                except Exception as exc:
                    s.batch.slice_failed(s, f"shared-memory copy failed: {exc!r}")
                    continue
            if done and done[-1].batch is not s.batch:
                done[-1].batch.slices_done(done)
                done = []
            done.append(s)
        if done:
            done[-1].batch.slices_done(done)

    def close(self) -> None:
        self.unwatch()
        self.dead = True
        with self._lock:
            with contextlib.suppress(OSError):
                self._sock.close()
            # Mappings are dropped, not closed: a copy in flight may still hold
            # one, and the kernel unmaps when the last reference goes.
            self._mappings.clear()
            self._registry_slots = None
            self._registry = None


def copy_slice(s: Slice, remote_address: int) -> None:
    """memcpy one slice between local memory and a mapped (or local) address."""
    local = s.local
    if local.is_host:
        local_address = local.address + s.local_offset
        if s.kind is OpKind.READ:
            memmove(local_address, remote_address, s.length)
        else:
            memmove(remote_address, local_address, s.length)
        return
    from mooncaked.transfer.segment import _view_address

    if s.kind is OpKind.READ:
        view, commit = local.destination(s.local_offset, s.length)
        memmove(_view_address(view), remote_address, s.length)
        if commit is not None:
            commit()
    else:
        src = local.source(s.local_offset, s.length)
        memmove(remote_address, _view_address(src), s.length)
