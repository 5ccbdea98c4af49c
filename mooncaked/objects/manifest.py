"""What a named object is: its manifest, its shards, and which of them a node holds.

An object is a file or a directory of files, read as one stream of bytes (the
files in order, each at its ``offset``) cut into shards of ``shard_bytes``
(the last one shorter). Each shard has a checksum; the object's ``digest``
is the hash of the shard checksums in order, with the size and the shard
size (a one-level hash tree), so a copy checked shard by shard is checked
whole, and a manifest whose checksums were tampered with does not match its
digest. ``version`` orders manifests of one name: the origin (the node that
registered it) stamps it from its wall clock, later registrations higher.

``ShardSet`` is which shards one node holds, sent as a bitmap in hex.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from mooncaked.config import CHECKSUMS, check_object_name

# Most files one object may have (a model directory has a few dozen).
MAX_FILES = 4096
# Most shards one object may have: 64 TiB at 64 MiB shards.
MAX_SHARDS = 1 << 20
_DIGEST_TAG = b"mooncaked.object.v1"
_SIZES = struct.Struct("<QQ")


def new_hasher(algorithm: str) -> Any:
    """A fresh hash object of a shard checksum ``algorithm`` (32-byte digests)."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake2b":
        return hashlib.blake2b(digest_size=32)
    raise ValueError(f"unknown shard checksum {algorithm!r}; expected one of {list(CHECKSUMS)}")


def digest_of(algorithm: str, size: int, shard_bytes: int, checksums: Iterable[bytes]) -> bytes:
    """The object's digest: its shard checksums in order, hashed with its sizes."""
    h = new_hasher(algorithm)
    h.update(_DIGEST_TAG)
    h.update(_SIZES.pack(size, shard_bytes))
    for c in checksums:
        h.update(c)
    return bytes(h.digest())


def num_shards_of(size: int, shard_bytes: int) -> int:
    return -(-size // shard_bytes)


def check_relative_path(path: str) -> str:
    """A file's path inside an object: relative, '/'-separated, no '.' or '..' parts."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"a file of an object needs a plain relative path, got {path!r}")
    if "\x00" in path or len(path) > 1024:
        raise ValueError(f"a file of an object needs a path of at most 1024 characters: {path!r}")
    return path


@dataclass(frozen=True, slots=True)
class ObjectFile:
    # Relative to the object's root directory ('/'-separated); for an object
    # that is one file, the file's own name.
    path: str
    size: int
    # Where the file starts in the object's stream of bytes.
    offset: int


@dataclass(frozen=True, slots=True)
class Piece:
    """The part of one shard that lies in one file."""

    file_index: int
    offset: int  # in the file
    length: int


@dataclass(frozen=True, slots=True)
class Manifest:
    name: str
    version: int
    # The node that registered it: the coordinator of its fetches.
    origin: str
    # The file's or the directory's own name, kept by every copy (a model's
    # served name and identity derive from it).
    root: str
    is_dir: bool
    files: tuple[ObjectFile, ...]
    size: int
    shard_bytes: int
    algorithm: str
    checksums: tuple[bytes, ...]
    digest: bytes

    @property
    def num_shards(self) -> int:
        return len(self.checksums)

    @property
    def ref(self) -> tuple[str, int]:
        """What names this manifest in the cluster: (name, version)."""
        return (self.name, self.version)

    @property
    def key(self) -> str:
        """A short name of (name, version), safe in paths and segment names."""
        raw = f"{self.name}\0{self.version}".encode()
        return hashlib.blake2b(raw, digest_size=8).hexdigest()

    def segment(self, file_index: int) -> str:
        """The transfer segment file ``file_index`` of every copy is registered as."""
        return f"obj.{self.key}.{file_index}"

    def shard_span(self, index: int) -> tuple[int, int]:
        """[start, end) of shard ``index`` in the object's stream."""
        if not 0 <= index < self.num_shards:
            raise ValueError(f"shard {index} is outside 0..{self.num_shards - 1} of {self.name!r}")
        start = index * self.shard_bytes
        return start, min(start + self.shard_bytes, self.size)

    def shard_length(self, index: int) -> int:
        start, end = self.shard_span(index)
        return end - start

    def pieces(self, index: int) -> list[Piece]:
        """Shard ``index`` file by file, in order (files of no bytes have none)."""
        start, end = self.shard_span(index)
        out: list[Piece] = []
        for i, f in enumerate(self.files):
            lo, hi = max(start, f.offset), min(end, f.offset + f.size)
            if lo < hi:
                out.append(Piece(i, lo - f.offset, hi - lo))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "origin": self.origin,
            "root": self.root,
            "dir": self.is_dir,
            "files": [[f.path, f.size] for f in self.files],
            "size": self.size,
            "shard_bytes": self.shard_bytes,
            "algorithm": self.algorithm,
            "checksums": [c.hex() for c in self.checksums],
            "digest": self.digest.hex(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        """ValueError naming the field that is wrong, or saying the digest does not match."""
        name = _str(data, "name")
        check_object_name(name)
        algorithm = _str(data, "algorithm")
        if algorithm not in CHECKSUMS:
            raise ValueError(f"'algorithm' must be one of {list(CHECKSUMS)}, got {algorithm!r}")
        files, size = _files(data.get("files"))
        shard_bytes = _int(data, "shard_bytes", 1)
        if num_shards_of(size, shard_bytes) > MAX_SHARDS:
            raise ValueError(
                f"{size} bytes in shards of {shard_bytes} are more than {MAX_SHARDS} shards"
            )
        sums = data.get("checksums")
        if not isinstance(sums, list) or len(sums) != num_shards_of(size, shard_bytes):
            raise ValueError(
                f"'checksums' must list one checksum per shard "
                f"({num_shards_of(size, shard_bytes)}), got {_count(sums)}"
            )
        manifest = cls(
            name=name,
            version=_int(data, "version", 1),
            origin=_str(data, "origin"),
            root=_root(data.get("root")),
            is_dir=_flag(data, "dir"),
            files=files,
            size=size,
            shard_bytes=shard_bytes,
            algorithm=algorithm,
            checksums=tuple(_hex32(c, "checksums") for c in sums),
            digest=_hex32(data.get("digest"), "digest"),
        )
        if _int(data, "size", 0) != size:
            raise ValueError(f"'size' {data['size']} is not the sum of its files' sizes {size}")
        if not manifest.is_dir and len(files) != 1:
            raise ValueError(f"an object that is one file lists {len(files)} files")
        expected = digest_of(algorithm, size, shard_bytes, manifest.checksums)
        if expected != manifest.digest:
            raise ValueError(f"the digest of {name!r} does not match its shard checksums")
        return manifest


class ShardSet:
    """Which shards of an object a node holds."""

    __slots__ = ("_bits", "num_shards")

    def __init__(self, num_shards: int, indices: Iterable[int] = ()) -> None:
        self.num_shards = num_shards
        self._bits = bytearray((num_shards + 7) // 8)
        for i in indices:
            self.add(i)

    @classmethod
    def full(cls, num_shards: int) -> ShardSet:
        return cls(num_shards, range(num_shards))

    def add(self, index: int) -> None:
        if not 0 <= index < self.num_shards:
            raise ValueError(f"shard {index} is outside 0..{self.num_shards - 1}")
        self._bits[index >> 3] |= 1 << (index & 7)

    def discard(self, index: int) -> None:
        if 0 <= index < self.num_shards:
            self._bits[index >> 3] &= ~(1 << (index & 7)) & 0xFF

    def __contains__(self, index: object) -> bool:
        if not isinstance(index, int) or not 0 <= index < self.num_shards:
            return False
        return bool(self._bits[index >> 3] & (1 << (index & 7)))

    def __iter__(self) -> Iterator[int]:
        return (i for i in range(self.num_shards) if i in self)

    def __len__(self) -> int:
        return sum(bin(b).count("1") for b in self._bits)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ShardSet)
            and other.num_shards == self.num_shards
            and other._bits == self._bits
        )

    def __hash__(self) -> int:
        return hash((self.num_shards, bytes(self._bits)))

    def __repr__(self) -> str:
        return f"ShardSet({self.num_shards}, {list(self)})"

    @property
    def complete(self) -> bool:
        return len(self) == self.num_shards

    def missing(self) -> list[int]:
        return [i for i in range(self.num_shards) if i not in self]

    def copy(self) -> ShardSet:
        out = ShardSet(self.num_shards)
        out._bits[:] = self._bits
        return out

    def hex(self) -> str:
        return self._bits.hex()

    @classmethod
    def from_hex(cls, raw: Any, num_shards: int, name: str = "have") -> ShardSet:
        """A bitmap of ``num_shards`` bits from hex; ValueError naming ``name``."""
        want = (num_shards + 7) // 8
        try:
            bits = bytes.fromhex(raw) if isinstance(raw, str) else None
        except ValueError:
            bits = None
        if bits is None or len(bits) != want:
            raise ValueError(f"{name!r} must be a bitmap of {num_shards} shards in hex")
        out = cls(num_shards)
        out._bits[:] = bits
        spare = num_shards & 7
        if spare and bits and bits[-1] >> spare:
            raise ValueError(f"{name!r} names shards beyond the last one ({num_shards - 1})")
        return out


def _str(data: Mapping[str, Any], key: str) -> str:
    v = data.get(key)
    if not isinstance(v, str) or not v or len(v) > 1024:
        raise ValueError(f"{key!r} must be a non-empty string, got {v!r:.60}")
    return v


def _int(data: Mapping[str, Any], key: str, lo: int) -> int:
    v = data.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or v > 2**62:
        raise ValueError(f"{key!r} must be an integer >= {lo}, got {v!r:.60}")
    return v


def _flag(data: Mapping[str, Any], key: str) -> bool:
    v = data.get(key)
    if not isinstance(v, bool):
        raise ValueError(f"{key!r} must be true or false, got {v!r:.60}")
    return v


def _count(v: Any) -> str:
    return f"{len(v)}" if isinstance(v, list) else repr(v)[:60]


def _hex32(raw: Any, name: str) -> bytes:
    try:
        out = bytes.fromhex(raw) if isinstance(raw, str) else b""
    except ValueError:
        out = b""
    if len(out) != 32:
        raise ValueError(f"{name!r} must hold 32-byte hashes in hex, got {raw!r:.70}")
    return out


def _root(raw: Any) -> str:
    if not isinstance(raw, str) or "/" in raw:
        raise ValueError(f"'root' must be a plain file or directory name, got {raw!r:.60}")
    return check_relative_path(raw)


def _files(raw: Any) -> tuple[tuple[ObjectFile, ...], int]:
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_FILES:
        raise ValueError(f"'files' must list 1..{MAX_FILES} [path, size] pairs")
    files: list[ObjectFile] = []
    offset = 0
    seen: set[str] = set()
    for item in raw:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or isinstance(item[1], bool)
            or not isinstance(item[1], int)
            or item[1] < 0
        ):
            raise ValueError(f"'files' must list [path, size] pairs, got {item!r:.80}")
        path = check_relative_path(item[0])
        if path in seen:
            raise ValueError(f"'files' lists {path!r} twice")
        seen.add(path)
        files.append(ObjectFile(path, item[1], offset))
        offset += item[1]
    return tuple(files), offset


class StreamChecker:
    """Checks an object's bytes as they stream past (a download), shard by
    shard; ValueError at the first shard that fails its check."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._index = 0
        self._filled = 0
        self._hash = new_hasher(manifest.algorithm)

    def update(self, data: bytes) -> None:
        m = self.manifest
        view = memoryview(data)
        while view:
            if self._index >= m.num_shards:
                raise ValueError(f"the node sent more than the {m.size} bytes of {m.name!r}")
            take = min(len(view), m.shard_length(self._index) - self._filled)
            self._hash.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == m.shard_length(self._index):
                if self._hash.digest() != m.checksums[self._index]:
                    raise ValueError(f"shard {self._index} of {m.name!r} failed its check")
                self._index += 1
                self._filled = 0
                self._hash = new_hasher(m.algorithm)

    def finish(self) -> None:
        if self._index != self.manifest.num_shards:
            raise ValueError(
                f"the node sent {self._index} of the {self.manifest.num_shards} shards "
                f"of {self.manifest.name!r}"
            )
