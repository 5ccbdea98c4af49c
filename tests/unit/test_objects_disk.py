"""A node's objects on disk: the journal of checked shards (torn tails and
stale records dropped), registrations, copies without a manifest; and the
files of a copy (scan, hashing, shards landing in place)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mooncaked.objects.disk import Journal, ObjectsDir, Registration, stamps_of
from mooncaked.objects.files import ObjectFiles, build_manifest, scan
from mooncaked.objects.manifest import Manifest


def make(tmp_path: Path, data: bytes, shard_bytes: int = 4096) -> tuple[Manifest, Path]:
    src = tmp_path / "src" / "blob.bin"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_bytes(data)
    manifest, files = build_manifest(
        "blob", 5, "me", scan(src), shard_bytes=shard_bytes, algorithm="sha256"
    )
    files.close()
    return manifest, src


def test_the_journal_keeps_checked_shards_and_cuts_a_torn_tail(tmp_path: Path) -> None:
    m, _ = make(tmp_path, os.urandom(5 * 4096))
    path = tmp_path / "journal"
    journal, held = Journal.open(path, m)
    assert list(held) == []
    for i in (3, 0, 4):
        journal.append(i)
    journal.close()
    journal, held = Journal.open(path, m)
    assert list(held) == [0, 3, 4]
    journal.close()
    # The process died mid-append: half a record.
    good = path.read_bytes()
    path.write_bytes(good + good[:20])
    journal, held = Journal.open(path, m)
    assert list(held) == [0, 3, 4]
    assert path.stat().st_size == len(good)
    journal.append(1)
    journal.close()
    # A record for another version of the object (another checksum) is not held.
    other, _ = make(tmp_path / "other", os.urandom(5 * 4096))
    journal, held = Journal.open(path, other)
    assert list(held) == []
    journal.close()
    journal, held = Journal.open(path, m)
    assert list(held) == [0, 1, 3, 4]
    journal.close()
    # A garbled record: it and everything after it are dropped.
    raw = bytearray(path.read_bytes())
    raw[44 + 40] ^= 0xFF  # the tag of the second record
    path.write_bytes(bytes(raw))
    journal, held = Journal.open(path, m)
    assert list(held) == [3]
    journal.close()


def test_registrations_and_copies_in_the_data_dir(tmp_path: Path) -> None:
    m, src = make(tmp_path, os.urandom(3 * 4096 + 5))
    disk = ObjectsDir(tmp_path / "objects")
    reg = Registration(m, str(src), stamps_of([src]))
    disk.save_registrations([reg])
    assert disk.registrations() == [reg]
    disk.new_copy(m)
    assert disk.copies() == [m]
    # A copy whose manifest never made it to disk is dropped at start-up.
    broken = disk.copies_root / "0123456789abcdef"
    broken.mkdir()
    (broken / "manifest.json").write_text("{")
    assert disk.copies() == [m]
    assert not broken.exists()
    disk.remove_copy(m)
    assert disk.copies() == []


def test_a_copy_lands_shards_in_place_and_checks_them(tmp_path: Path) -> None:
    data = os.urandom(2 * 4096 + 100)
    m, _ = make(tmp_path, data)
    assert m.num_shards == 3 and m.size == len(data)
    copy = ObjectFiles.create(m, tmp_path / "copy")
    assert copy.path == tmp_path / "copy" / "blob.bin"
    assert copy.path.stat().st_size == len(data)
    assert not copy.verify(1)
    with open(copy.path, "r+b") as fh:
        fh.seek(4096)
        fh.write(data[4096:8192])
    assert copy.verify(1) and not copy.verify(0)
    copy.sync(1)
    copy.close()


def test_a_directory_is_one_object_of_its_files_in_order(tmp_path: Path) -> None:
    root = tmp_path / "model"
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_bytes(b"{}")
    (root / "empty.txt").write_bytes(b"")
    (root / "sub" / "w.bin").write_bytes(os.urandom(5000))
    (root / ".cache").mkdir()
    (root / ".cache" / "x").write_bytes(b"skipped")
    scanned = scan(root)
    assert scanned.root == "model" and scanned.is_dir
    assert [(f.path, f.size, f.offset) for f in scanned.files] == [
        ("config.json", 2, 0),
        ("empty.txt", 0, 2),
        ("sub/w.bin", 5000, 2),
    ]
    m, files = build_manifest("d", 1, "me", scanned, shard_bytes=4096, algorithm="blake2b")
    files.close()
    assert Manifest.from_dict(m.to_dict()) == m
    copy = ObjectFiles.create(m, tmp_path / "copy")
    assert copy.path == tmp_path / "copy" / "model"
    assert (copy.path / "sub" / "w.bin").stat().st_size == 5000
    copy.close()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        scan(tmp_path / "empty")
