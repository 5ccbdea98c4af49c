"""Registered memory: segments, and the descriptors other nodes address them by.

A segment is a named, contiguous byte range a peer may read or write, and the
only memory of a node a peer can reach: every remote op is checked against
the segment it names before a byte moves. A segment wraps

- host memory: a bytearray, a writable memoryview/mmap/numpy array, a
  contiguous CPU torch tensor;
- shared memory: a :class:`SharedBuffer` (memfd, or a file mapped shared,
  read-only if it was mapped so) or a
  ``multiprocessing.shared_memory.SharedMemory``; peers on the same host map
  these and copy without a socket;
- device memory: a contiguous CUDA tensor, reached through a pinned host
  bounce buffer per slice.

Names are unique per node; ids are unique per engine incarnation and never
reused, so a peer holding a stale id (the segment was unregistered, or the
node restarted) gets "unknown segment" instead of another segment's bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from mooncaked.transfer.access import Access, parse_access

# Transports a descriptor can list.
TRANSPORTS = ("shm", "rdma", "tcp")


class SegmentError(ValueError):
    """A segment cannot be registered, found or used as asked."""


def _view_address(view: memoryview) -> int:
    """Address of the first byte of a contiguous byte view."""
    if len(view) == 0:
        return 0
    if view.readonly:
        # ctypes wants a writable buffer; numpy reads the address of any.
        return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def read_only_fd(fd: int) -> int:
    """A new read-only file description of ``fd``'s file (shared memory).

    Passed to a peer instead of ``fd`` itself, it can only be mapped
    PROT_READ: the kernel, not the peer's good manners, keeps it from writing.
    """
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


# memcpy between raw addresses; ctypes drops the GIL for the call, so copies
# in worker threads run in parallel with the event loop.
memmove = ctypes.memmove


class SharedBuffer:
    """Anonymous shared memory (memfd), mappable by a peer given its fd.

    The fd travels to a peer on the same host over the authenticated unix
    channel (SCM_RIGHTS), so no name in /dev/shm can leak or be guessed, and
    the memory is freed by the kernel when the last process lets go. The file
    is the daemon user's only (mode 0600), so no other user can open it
    through /proc either.

    A regular file's fd maps the same way (``SharedBuffer(fd, size,
    owns_fd=False)``): the page cache is the shared memory. Mapped with
    ``writable=False`` it can be registered all the same; it is then served to
    peers and never written, by them or by this process.
    """

    __slots__ = ("_fd", "_map", "address", "nbytes", "view", "writable")

    def __init__(
        self, fd: int, nbytes: int, *, owns_fd: bool = True, writable: bool = True
    ) -> None:
        if nbytes <= 0:
            raise SegmentError(f"a shared buffer needs a positive size, got {nbytes}")
        if not owns_fd:
            fd = os.dup(fd)
        self._fd = fd
        self.nbytes = nbytes
        self.writable = writable
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._map: mmap.mmap | None = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
        self.view = memoryview(self._map)
        self.address = _view_address(self.view)

    @classmethod
    def create(cls, nbytes: int, tag: str = "segment") -> SharedBuffer:
        if nbytes <= 0:
            raise SegmentError(f"a shared buffer needs a positive size, got {nbytes}")
        fd = os.memfd_create(f"mooncaked-{tag}", os.MFD_CLOEXEC)
        try:
            # memfds are born 0777: only the daemon's user may reopen this one.
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, nbytes)
            return cls(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, nbytes: int, *, writable: bool = True) -> SharedBuffer:
        """Map an fd received from a peer; it must hold at least ``nbytes``.
        ``writable=False`` maps it read-only (the only way a read-only fd maps)."""
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise SegmentError(f"shared memory holds {size} bytes, descriptor says {nbytes}")
        return cls(fd, nbytes, owns_fd=True, writable=writable)

    @property
    def fd(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._map is None:
            return
        self.view.release()
        try:
            self._map.close()
        except BufferError:
            # Someone still holds a view (a tensor made with frombuffer, a
            # slice in flight): the mapping goes when the last view does.
            pass
        self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(frozen=True, slots=True)
class SegmentDescriptor:
    """What another node needs to address a segment: plain data for gossip."""

    node_id: str
    name: str
    length: int
    location: str  # "cpu" or "cuda:N"
    transports: tuple[str, ...]
    # host:port of the node's transfer endpoint; shm and rdma are negotiated
    # over the authenticated connection made there.
    address: str
    # What peers may do with it (a hint for them: the owner enforces it).
    access: Access = Access.READ

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "name": self.name,
            "length": self.length,
            "location": self.location,
            "transports": list(self.transports),
            "address": self.address,
            "access": self.access.value,
        }

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SegmentDescriptor:
        try:
            node_id, name, length = data["node_id"], data["name"], data["length"]
            location, transports, address = data["location"], data["transports"], data["address"]
        except (KeyError, TypeError) as exc:
            raise SegmentError(f"segment descriptor lacks {exc}") from None
        if not (isinstance(node_id, str) and node_id and isinstance(name, str) and name):
            raise SegmentError("segment descriptor needs non-empty node_id and name")
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise SegmentError(f"segment descriptor length must be an int >= 0, got {length!r}")
        if not isinstance(transports, list) or any(t not in TRANSPORTS for t in transports):
            raise SegmentError(f"segment descriptor transports must be a subset of {TRANSPORTS}")
        if not isinstance(location, str) or not isinstance(address, str):
            raise SegmentError("segment descriptor location and address must be strings")
        try:
            access = parse_access(data.get("access", Access.READ.value))
        except ValueError as exc:
            raise SegmentError(f"segment descriptor: {exc}") from None
        return cls(node_id, name, length, location, tuple(transports), address, access)

    @classmethod
    def from_bytes(cls, raw: bytes) -> SegmentDescriptor:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise SegmentError(f"segment descriptor is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise SegmentError("segment descriptor must be a JSON object")
        return cls.from_dict(data)


@dataclass(slots=True, eq=False)
class Segment:
    """A registered local segment.

    Host segments expose ``view`` (the registered bytes, zero-copy) and
    ``address``; device segments have neither and stage through pinned host
    memory in :meth:`source` and :meth:`destination`.
    """

    name: str
    seg_id: int
    length: int
    location: str
    view: memoryview | None
    address: int
    # Keeps the registered object alive as long as the segment is.
    owner: Any = field(repr=False)
    # What peers may do with it; checked on every path they reach it by.
    access: Access = Access.READ
    # The memfd that peers on this host map; -1 if not shared memory.
    shm_fd: int = -1
    # A read-only description of shm_fd, what peers get of a segment they
    # may not write; -1 if none.
    shm_ro_fd: int = -1
    # shm_fd was opened by us (for a SharedMemory) and is ours to close.
    owns_fd: bool = False
    # A SharedBuffer the engine allocated and must close on unregister.
    owned: SharedBuffer | None = field(default=None, repr=False)
    # CUDA tensor as flat bytes, for device segments.
    device_bytes: Any = field(default=None, repr=False)
    # Local batches using this segment; unregister refuses while > 0.
    busy: int = 0
    _busy_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def is_host(self) -> bool:
        return self.view is not None

    @property
    def read_only(self) -> bool:
        """Memory this process may not write (a read-only ``SharedBuffer``, such
        as a file mapped read-only): peers read it, nothing lands in it."""
        return self.view is not None and self.view.readonly

    @property
    def is_shared(self) -> bool:
        return self.shm_fd >= 0

    def peer_fd(self) -> int:
        """The fd a peer on this host gets: read-only unless peers may write."""
        return self.shm_fd if self.access.peers_write else self.shm_ro_fd

    def check_range(self, offset: int, length: int) -> str | None:
        """Why [offset, offset+length) is not inside this segment, or None."""
        if offset < 0 or length < 0:
            return f"negative offset or length ({offset}, {length}) for segment {self.name!r}"
        if offset + length > self.length:
            return (
                f"range [{offset}, {offset + length}) is outside segment {self.name!r} "
                f"of {self.length} bytes"
            )
        return None

    def acquire(self) -> None:
        with self._busy_lock:
            self.busy += 1

    def release(self) -> None:
        with self._busy_lock:
            self.busy -= 1

    def source(self, offset: int, length: int) -> memoryview:
        """Bytes to send from [offset, offset+length): the registered memory itself
        for host segments, a pinned copy for device segments."""
        if self.view is not None:
            return self.view[offset : offset + length]
        import torch

        staging = torch.empty(length, dtype=torch.uint8, pin_memory=True)
        staging.copy_(self.device_bytes[offset : offset + length])
        return memoryview(staging.numpy())

    def destination(self, offset: int, length: int) -> tuple[memoryview, Callable[[], None] | None]:
        """Where to land bytes for [offset, offset+length), and what to call once
        they are all there (None for host segments: they land in place)."""
        if self.view is not None:
            return self.view[offset : offset + length], None
        import torch

        staging = torch.empty(length, dtype=torch.uint8, pin_memory=True)
        target = self.device_bytes[offset : offset + length]

        def commit() -> None:
            target.copy_(staging)
            torch.cuda.current_stream(target.device).synchronize()

        return memoryview(staging.numpy()), commit


def _host_view(buffer: Any) -> memoryview:
    try:
        view = memoryview(buffer)
    except TypeError:
        raise SegmentError(
            f"cannot register a {type(buffer).__name__}: expected a torch tensor, bytearray, "
            "writable memoryview/mmap/numpy array, SharedBuffer or SharedMemory"
        ) from None
    if view.readonly:
        # Local READs land in a segment, whatever peers may do with it.
        raise SegmentError("cannot register read-only memory: transfers land in segments")
    if not view.c_contiguous:
        raise SegmentError("cannot register non-contiguous memory")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _torch_segment_parts(tensor: Any) -> tuple[memoryview | None, Any, str]:
    """(host view or None, flat device bytes or None, location) of a tensor."""
    if not tensor.is_contiguous():
        raise SegmentError("cannot register a non-contiguous tensor; call .contiguous() first")
    flat = tensor.reshape(-1).view(__import__("torch").uint8)
    if tensor.device.type == "cpu":
        return memoryview(flat.numpy()), None, "cpu"
    if tensor.device.type == "cuda":
        index = tensor.device.index if tensor.device.index is not None else 0
        return None, flat, f"cuda:{index}"
    raise SegmentError(f"cannot register a tensor on {tensor.device}; only cpu and cuda")


class SegmentTable:
    """The node's registered segments, by name and by id.

    Mutated on the event loop; read by serving threads (plain dict lookups,
    atomic under the GIL).
    """

    def __init__(self) -> None:
        self._by_name: dict[str, Segment] = {}
        self._by_id: dict[int, Segment] = {}
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._by_name)

    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str) -> Segment | None:
        return self._by_name.get(name)

    def by_id(self, seg_id: int) -> Segment | None:
        return self._by_id.get(seg_id)

    def register(self, name: str, buffer: Any, access: Access = Access.READ) -> Segment:
        if not isinstance(access, Access):
            raise SegmentError(f"segment access must be an Access, got {access!r}")
        if not name or len(name.encode()) > 255:
            raise SegmentError(f"segment name must be 1..255 bytes, got {name!r}")
        if name in self._by_name:
            raise SegmentError(f"segment {name!r} is already registered; unregister it first")
        seg_id = self._next_id
        owner: Any = buffer
        shm_fd = -1
        device_bytes = None
        location = "cpu"
        torch = sys.modules.get("torch")
        if isinstance(buffer, SharedBuffer):
            view: memoryview | None = buffer.view
            shm_fd = buffer.fd
        elif torch is not None and isinstance(buffer, torch.Tensor):
            view, device_bytes, location = _torch_segment_parts(buffer)
        elif type(buffer).__name__ == "SharedMemory" and hasattr(buffer, "buf"):
            view = _host_view(buffer.buf)
            try:
                shm_fd = os.open(f"/dev/shm/{buffer.name.lstrip('/')}", os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                shm_fd = -1  # still usable over tcp
        else:
            view = _host_view(buffer)
        length = len(view) if view is not None else int(device_bytes.numel())
        if length == 0:
            raise SegmentError(f"cannot register empty segment {name!r}")
        address = _view_address(view) if view is not None else 0
        shm_ro_fd = -1
        if shm_fd >= 0 and not access.peers_write:
            try:
                shm_ro_fd = read_only_fd(shm_fd)
            except OSError:
                if not isinstance(buffer, SharedBuffer):
                    os.close(shm_fd)
                shm_fd = -1  # still reachable over tcp, never writably mapped
        segment = Segment(
            name=name,
            seg_id=seg_id,
            length=length,
            location=location,
            view=view,
            address=address,
            owner=owner,
            access=access,
            shm_fd=shm_fd,
            shm_ro_fd=shm_ro_fd,
            owns_fd=shm_fd >= 0 and not isinstance(buffer, SharedBuffer),
            device_bytes=device_bytes,
        )
        self._next_id += 1
        self._by_name[name] = segment
        self._by_id[seg_id] = segment
        return segment

    def removable(self, name: str) -> Segment:
        """The segment ``unregister`` would take away; SegmentError if it is not
        registered or a local batch still holds it."""
        segment = self._by_name.get(name)
        if segment is None:
            raise SegmentError(f"segment {name!r} is not registered")
        if segment.busy:
            raise SegmentError(
                f"segment {name!r} has {segment.busy} local batch(es) in flight; "
                "await or cancel them before unregistering"
            )
        return segment

    def unregister(self, name: str) -> Segment:
        segment = self.removable(name)
        del self._by_name[name]
        del self._by_id[segment.seg_id]
        if segment.shm_ro_fd >= 0:
            os.close(segment.shm_ro_fd)
            segment.shm_ro_fd = -1
        if segment.owns_fd:
            os.close(segment.shm_fd)
        if segment.view is not None:
            # Let go of our export so the caller can close or free its buffer.
            # A slice a serving thread still holds keeps the memory alive
            # until it is done; a view the caller took from ours keeps ours.
            with contextlib.suppress(BufferError):
                segment.view.release()
        if segment.owned is not None:
            segment.owned.close()
        return segment

    def clear(self) -> None:
        for name in list(self._by_name):
            segment = self._by_name[name]
            segment.busy = 0
            self.unregister(name)
