"""The files of one copy of an object, mapped into memory and registered with
the transfer engine, and the scan that makes a manifest of a path.

A copy's files are mapped shared (``SharedBuffer`` over the file's fd): the
page cache is the memory peers read, over shm on this host (they map a
read-only fd of the file) or over tcp, with nothing copied in between. An
origin's files (``ObjectFiles.origin``) are mapped read-only, so neither a
peer nor this process can write them; a fetched copy's
(``ObjectFiles.create``) are writable here and registered ``Access.READ``, so
peers only read them. Shards land in place; each is hashed from the mapping
and ``fsync``-ed before it counts as held.

A registered file must not shrink while it is registered: reading a mapped
page past the end of a file kills the process (SIGBUS). Mooncake's P2P Store
asks the same of its registered files.

Every method here blocks (file I/O, hashing): callers run them in a thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mooncaked.objects.manifest import (
    Manifest,
    ObjectFile,
    check_relative_path,
    digest_of,
    new_hasher,
    num_shards_of,
)
from mooncaked.transfer import Access, SharedBuffer, TransferEngine, TransferOp


@dataclass(frozen=True, slots=True)
class Scanned:
    """A path to register: its own name, whether it is a directory, its files."""

    root: str
    is_dir: bool
    # Paths relative to ``path`` ('/'-separated) with their sizes, in stream order.
    files: tuple[ObjectFile, ...]
    path: Path

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def file_path(self, f: ObjectFile) -> Path:
        return self.path / f.path if self.is_dir else self.path


def scan(path: Path) -> Scanned:
    """The files of ``path`` (a file, or a directory walked in sorted order;
    names starting with '.' skipped, links followed); ValueError if there are none."""
    path = Path(os.path.abspath(path))
    if path.is_file():
        return Scanned(path.name, False, (ObjectFile(path.name, path.stat().st_size, 0),), path)
    if not path.is_dir():
        raise ValueError(f"{path} is neither a file nor a directory")
    files: list[ObjectFile] = []
    offset = 0
    for rel in _walk(path):
        size = (path / rel).stat().st_size
        files.append(ObjectFile(check_relative_path(rel), size, offset))
        offset += size
    if not files:
        raise ValueError(f"directory {path} holds no files to share")
    return Scanned(path.name, True, tuple(files), path)


def _walk(root: Path) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if name.startswith(".") or not os.path.isfile(full):
                continue
            yield name if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{name}"


class ObjectFiles:
    """The mapped files of one copy (file ``i`` is ``manifest.files[i]``)."""

    __slots__ = ("_buffers", "_registered", "manifest", "path", "paths", "writable")

    def __init__(
        self,
        manifest: Manifest,
        path: Path,
        paths: list[Path],
        buffers: list[SharedBuffer | None],
        *,
        writable: bool,
    ) -> None:
        self.manifest = manifest
        # The copy's file, or its directory; ``paths``: each file's.
        self.path = path
        self.paths = paths
        self.writable = writable
        # None for a file of no bytes: nothing to map or to read.
        self._buffers = buffers
        self._registered: list[str] = []

    @classmethod
    def origin(cls, manifest: Manifest, scanned: Scanned) -> ObjectFiles:
        """An origin's own files, mapped read-only; ValueError if one changed size."""
        paths = [scanned.file_path(f) for f in scanned.files]
        buffers: list[SharedBuffer | None] = []
        try:
            for f, p in zip(manifest.files, paths, strict=True):
                buffers.append(_map(p, f.size, writable=False))
        except BaseException:
            _close_all(buffers)
            raise
        return cls(manifest, scanned.path, paths, buffers, writable=False)

    @classmethod
    def create(cls, manifest: Manifest, root: Path) -> ObjectFiles:
        """A copy's files under ``root`` (made, at their full size, if missing), writable."""
        base = root / manifest.root
        paths = [base / f.path if manifest.is_dir else base for f in manifest.files]
        buffers: list[SharedBuffer | None] = []
        try:
            for f, p in zip(manifest.files, paths, strict=True):
                p.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    if os.fstat(fd).st_size > f.size:
                        os.ftruncate(fd, f.size)
                    if f.size:
                        # Every block allocated now: a full disk is an error
                        # here, not a SIGBUS when a shard lands in the mapping.
                        os.posix_fallocate(fd, 0, f.size)
                finally:
                    os.close(fd)
                buffers.append(_map(p, f.size, writable=True))
        except BaseException:
            _close_all(buffers)
            raise
        return cls(manifest, base, paths, buffers, writable=True)

    # -- the transfer engine ----------------------------------------------------

    def register(self, engine: TransferEngine) -> None:
        """Registers every non-empty file as its segment, read-only to peers."""
        for i, buffer in enumerate(self._buffers):
            if buffer is None:
                continue
            name = self.manifest.segment(i)
            engine.register(name, buffer, Access.READ)
            self._registered.append(name)

    def unregister(self, engine: TransferEngine) -> None:
        """Withdraws the segments (SegmentError while a local batch uses one)."""
        while self._registered:
            engine.unregister(self._registered[-1])
            self._registered.pop()

    def read_ops(self, shard: int, holder: str) -> list[TransferOp]:
        """The reads that copy shard ``shard`` from ``holder``'s copy into this one:
        both copies lay the object out alike, so offsets are the same."""
        m = self.manifest
        return [
            TransferOp.read(
                m.segment(p.file_index),
                p.offset,
                holder,
                m.segment(p.file_index),
                p.offset,
                p.length,
            )
            for p in m.pieces(shard)
        ]

    # -- bytes ------------------------------------------------------------------

    def checksum(self, shard: int) -> bytes:
        """The checksum of shard ``shard`` as this copy holds it."""
        h = new_hasher(self.manifest.algorithm)
        for p in self.manifest.pieces(shard):
            buffer = self._buffers[p.file_index]
            if buffer is None:
                raise RuntimeError(f"file {p.file_index} of {self.manifest.name!r} is not mapped")
            h.update(buffer.view[p.offset : p.offset + p.length])
        return bytes(h.digest())

    def verify(self, shard: int) -> bool:
        return self.checksum(shard) == self.manifest.checksums[shard]

    def sync(self, shard: int) -> None:
        """Shard ``shard`` on disk (its pages written back: fsync of its files)."""
        for p in self.manifest.pieces(shard):
            buffer = self._buffers[p.file_index]
            if buffer is not None:
                os.fsync(buffer.fd)

    def close(self) -> None:
        """Unmaps every file (after ``unregister``)."""
        if self._registered:
            raise RuntimeError(f"{self.manifest.name!r} is still registered; unregister it first")
        _close_all(self._buffers)
        self._buffers = [None] * len(self._buffers)


def build_manifest(
    name: str,
    version: int,
    origin: str,
    scanned: Scanned,
    *,
    shard_bytes: int,
    algorithm: str,
) -> tuple[Manifest, ObjectFiles]:
    """Hashes ``scanned`` shard by shard (from read-only mappings of its files)
    into a manifest; returns it with the mapped files, ready to register."""
    size = scanned.size
    draft = Manifest(
        name=name,
        version=version,
        origin=origin,
        root=scanned.root,
        is_dir=scanned.is_dir,
        files=scanned.files,
        size=size,
        shard_bytes=shard_bytes,
        algorithm=algorithm,
        checksums=(b"",) * num_shards_of(size, shard_bytes),
        digest=b"",
    )
    files = ObjectFiles.origin(draft, scanned)
    try:
        sums = tuple(files.checksum(i) for i in range(draft.num_shards))
    except BaseException:
        files.close()
        raise
    manifest = dataclasses.replace(
        draft, checksums=sums, digest=digest_of(algorithm, size, shard_bytes, sums)
    )
    files.manifest = manifest
    return manifest, files


def _map(path: Path, size: int, *, writable: bool) -> SharedBuffer | None:
    if size == 0:
        return None
    fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise ValueError(f"{path} holds {actual} bytes, the object says {size}")
        return SharedBuffer(fd, size, owns_fd=False, writable=writable)
    finally:
        os.close(fd)


def _close_all(buffers: list[SharedBuffer | None]) -> None:
    for b in buffers:
        if b is not None:
            with contextlib.suppress(Exception):
                b.close()
