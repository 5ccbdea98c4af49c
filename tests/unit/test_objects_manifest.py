"""Manifests: shards cut across files, digests that bind the checksums, the
shard bitmaps nodes exchange, and names."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import pytest

from mooncaked.config import check_object_name
from mooncaked.objects.manifest import Manifest, ObjectFile, Piece, ShardSet, digest_of


def manifest(sizes: list[int], shard_bytes: int, algorithm: str = "sha256") -> Manifest:
    files, offset = [], 0
    for i, size in enumerate(sizes):
        files.append(ObjectFile(f"f{i}", size, offset))
        offset += size
    n = -(-offset // shard_bytes)
    sums = tuple(hashlib.sha256(bytes([i])).digest() for i in range(n))
    return Manifest(
        name="m",
        version=7,
        origin="node-a",
        root="model",
        is_dir=len(sizes) > 1,
        files=tuple(files),
        size=offset,
        shard_bytes=shard_bytes,
        algorithm=algorithm,
        checksums=sums,
        digest=digest_of(algorithm, offset, shard_bytes, sums),
    )


def test_shards_are_cut_over_the_files_in_order() -> None:
    m = manifest([10, 0, 25, 5], shard_bytes=16)
    assert m.num_shards == 3
    assert [m.shard_span(i) for i in range(3)] == [(0, 16), (16, 32), (32, 40)]
    # The empty file has no piece; a shard may span files.
    assert m.pieces(0) == [Piece(0, 0, 10), Piece(2, 0, 6)]
    assert m.pieces(1) == [Piece(2, 6, 16)]
    assert m.pieces(2) == [Piece(2, 22, 3), Piece(3, 0, 5)]
    assert m.shard_length(2) == 8
    with pytest.raises(ValueError, match=r"shard 3 is outside 0\.\.2"):
        m.shard_span(3)
    assert m.segment(1) == f"obj.{m.key}.1"
    # Keyed by name and version only: every copy of it names its segments alike.
    assert manifest([40], 16).key == m.key
    assert dataclasses.replace(m, version=8).key != m.key


def test_a_manifest_round_trips_and_its_digest_binds_its_checksums() -> None:
    m = manifest([10, 0, 25, 5], shard_bytes=16, algorithm="blake2b")
    assert Manifest.from_dict(m.to_dict()) == m
    tampered = m.to_dict()
    tampered["checksums"][1] = hashlib.sha256(b"other").hexdigest()
    with pytest.raises(ValueError, match="digest of 'm' does not match"):
        Manifest.from_dict(tampered)
    for key, value, match in [
        ("checksums", [], "one checksum per shard \\(3\\), got 0"),
        ("size", 41, "'size' 41 is not the sum"),
        ("algorithm", "md5", "'algorithm' must be one of"),
        ("name", "a/../b", "an object name"),
        ("files", [["../etc/passwd", 1]], "plain relative path"),
        ("files", [["a", 1], ["a", 2]], "lists 'a' twice"),
        ("root", "a/b", "'root' must be a plain"),
        ("version", 0, "'version' must be an integer >= 1"),
    ]:
        bad: dict[str, Any] = {**m.to_dict(), key: value}
        with pytest.raises(ValueError, match=match):
            Manifest.from_dict(bad)
    one = manifest([40], 16).to_dict()
    with pytest.raises(ValueError, match="one file lists 2 files"):
        Manifest.from_dict({**one, "files": [["a", 20], ["b", 20]]})


def test_shard_sets_go_as_hex_bitmaps() -> None:
    s = ShardSet(10, [0, 3, 9])
    assert list(s) == [0, 3, 9] and len(s) == 3 and 3 in s and 4 not in s and 10 not in s
    assert s.hex() == "0902"
    assert ShardSet.from_hex("0902", 10) == s
    assert s.missing() == [1, 2, 4, 5, 6, 7, 8]
    assert not s.complete and ShardSet.full(10).complete
    s.discard(3)
    assert list(s) == [0, 9]
    with pytest.raises(ValueError, match=r"shard 10 is outside 0\.\.9"):
        s.add(10)
    with pytest.raises(ValueError, match="beyond the last one"):
        ShardSet.from_hex("0906", 10)
    with pytest.raises(ValueError, match="bitmap of 10 shards"):
        ShardSet.from_hex("09", 10)
    with pytest.raises(ValueError, match="bitmap of 10 shards"):
        ShardSet.from_hex("zz02", 10)


def test_object_names() -> None:
    for good in ("smollm2", "models/SmolLM2-135M.Q8_0.gguf", "a/b/c", "0"):
        assert check_object_name(good) == good
    for bad in ("", "/a", "a/", "a//b", "a/../b", ".hidden", "a b", "a\n", "x" * 201):
        with pytest.raises(ValueError, match="an object name"):
            check_object_name(bad)
