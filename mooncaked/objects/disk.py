"""A node's objects on disk, under ``<data_dir>/objects``::

    copies/<key>/manifest.json   a fetched copy's manifest, written before any shard
    copies/<key>/journal         the shards checked so far, one record each
    copies/<key>/data/<root>     the copy's file or directory
    registered.json              what this node registered: manifests, paths, file stamps

A shard is journaled only after it was checked against its checksum and its
pages were written back (``ObjectFiles.sync``), so a shard the journal names
is on disk as it was checked. A record is the shard's index, its checksum and
a tag over both: a torn or garbled tail (the process died mid-append) is cut
off when the journal is opened, and a record naming another checksum than
the manifest's is dropped; neither shard is served, and both are fetched
again. A crash leaves at worst shards fetched and not yet journaled.

Every function here blocks: callers run them in a thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import structlog

from mooncaked.objects.manifest import Manifest, ShardSet

log = structlog.get_logger(__name__)

_RECORD = struct.Struct("<I32s8s")
_TAG_KEY = b"mooncaked.objects.journal"


def _tag(index: int, checksum: bytes) -> bytes:
    return hashlib.blake2b(
        struct.pack("<I", index) + checksum, digest_size=8, key=_TAG_KEY
    ).digest()


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or what it held before, whatever happens meanwhile."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _sync_dir(path.parent)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """The shards of one copy checked so far, appended to as each lands."""

    __slots__ = ("_fh", "_manifest", "path")

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self._manifest = manifest
        self._fh: Any = None

    @classmethod
    def open(cls, path: Path, manifest: Manifest) -> tuple[Journal, ShardSet]:
        """The journal at ``path`` (made if missing) and the shards it names;
        a torn tail is cut off, so later records start at a record's boundary."""
        journal = cls(path, manifest)
        held = ShardSet(manifest.num_shards)
        raw = path.read_bytes() if path.exists() else b""
        good = 0
        for pos in range(0, len(raw) - _RECORD.size + 1, _RECORD.size):
            index, checksum, tag = _RECORD.unpack_from(raw, pos)
            if tag != _tag(index, checksum):
                break
            good = pos + _RECORD.size
            if index < manifest.num_shards and manifest.checksums[index] == checksum:
                held.add(index)
        if good != len(raw):
            log.warning(
                "object journal: torn tail cut off",
                object=manifest.name,
                dropped_bytes=len(raw) - good,
            )
        # Kept open: one record is appended per shard.
        fh = open(path, "r+b" if path.exists() else "w+b")
        try:
            fh.truncate(good)
            fh.seek(good)
        except BaseException:
            fh.close()
            raise
        journal._fh = fh
        return journal, held

    def append(self, index: int) -> None:
        """Records shard ``index`` as checked and on disk."""
        if self._fh is None:
            raise RuntimeError(f"the journal of {self._manifest.name!r} is closed")
        checksum = self._manifest.checksums[index]
        self._fh.write(_RECORD.pack(index, checksum, _tag(index, checksum)))
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            fh.close()


@dataclass(frozen=True, slots=True)
class Registration:
    """An object this node registered: its manifest, where its files are, and
    each file's (size, mtime in ns) then, to tell whether it changed since."""

    manifest: Manifest
    path: str
    stamps: tuple[tuple[int, int], ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "manifest": self.manifest.to_dict(),
            "path": self.path,
            "stamps": [list(s) for s in self.stamps],
        }

    @classmethod
    def from_dict(cls, data: Any) -> Registration:
        if not isinstance(data, dict) or not isinstance(data.get("path"), str):
            raise ValueError("a registration needs a manifest and a path")
        stamps = data.get("stamps")
        if not isinstance(stamps, list) or not all(
            isinstance(s, list) and len(s) == 2 and all(isinstance(x, int) for x in s)
            for s in stamps
        ):
            raise ValueError("a registration's stamps must be [size, mtime_ns] pairs")
        return cls(
            Manifest.from_dict(data.get("manifest") or {}),
            data["path"],
            tuple((s[0], s[1]) for s in stamps),
        )


def stamps_of(paths: Sequence[Path]) -> tuple[tuple[int, int], ...]:
    """Each file's (size, mtime in ns) now."""
    out = []
    for p in paths:
        st = p.stat()
        out.append((st.st_size, st.st_mtime_ns))
    return tuple(out)


class ObjectsDir:
    """``<data_dir>/objects``: copies and registrations. Made when first needed:
    a node that never shares an object writes nothing there."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.copies_root = root / "copies"

    # -- copies ---------------------------------------------------------------

    def copy_dir(self, manifest: Manifest) -> Path:
        return self.copies_root / manifest.key

    def data_dir(self, manifest: Manifest) -> Path:
        return self.copy_dir(manifest) / "data"

    def journal_path(self, manifest: Manifest) -> Path:
        return self.copy_dir(manifest) / "journal"

    def new_copy(self, manifest: Manifest) -> None:
        """The copy's directory, its manifest written (before any shard)."""
        d = self.copy_dir(manifest)
        (d / "data").mkdir(parents=True, exist_ok=True)
        write_atomic(d / "manifest.json", orjson.dumps(manifest.to_dict()))

    def copies(self) -> list[Manifest]:
        """The manifests of the copies kept; a directory without a readable
        manifest is a copy whose start was cut short, and is removed."""
        out: list[Manifest] = []
        if not self.copies_root.is_dir():
            return out
        for d in sorted(self.copies_root.iterdir()):
            try:
                manifest = Manifest.from_dict(orjson.loads((d / "manifest.json").read_bytes()))
                if manifest.key != d.name:
                    raise ValueError(f"the manifest names copy {manifest.key}")
            except (OSError, ValueError) as exc:
                log.warning("object copy dropped: no usable manifest", path=str(d), error=str(exc))
                shutil.rmtree(d, ignore_errors=True)
                continue
            out.append(manifest)
        return out

    def remove_copy(self, manifest: Manifest) -> None:
        shutil.rmtree(self.copy_dir(manifest), ignore_errors=True)

    # -- registrations --------------------------------------------------------

    def registrations(self) -> list[Registration]:
        path = self.root / "registered.json"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return []
        try:
            entries = orjson.loads(raw)
        except orjson.JSONDecodeError:
            log.warning("registered objects: unreadable list ignored", path=str(path))
            return []
        out: list[Registration] = []
        for e in entries if isinstance(entries, list) else []:
            try:
                out.append(Registration.from_dict(e))
            except ValueError as exc:
                log.warning("registered object ignored", error=str(exc))
        return out

    def save_registrations(self, registrations: Sequence[Registration]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(
            self.root / "registered.json", orjson.dumps([r.to_dict() for r in registrations])
        )

    def remove_tmp(self) -> None:
        """Leftovers of an atomic write cut short."""
        with contextlib.suppress(FileNotFoundError):
            (self.root / "registered.json.tmp").unlink()
