"""``mooncakectl objects``: its rows and progress lines, its checks of the
command line, and the check of a download shard by shard."""

from __future__ import annotations

import hashlib
import io

import pytest

from mooncakectl.cli import run
from mooncakectl.objects_cmds import ls_rows, progress_line
from mooncakectl.registry import Env
from mooncaked.objects.manifest import Manifest, ObjectFile, StreamChecker, digest_of


def test_ls_rows_and_progress_lines() -> None:
    listing = [
        {
            "name": "smollm2",
            "version": 17,
            "size": 3 * 2**20 + 5,
            "shard_bytes": 2**20,
            "num_shards": 4,
            "origin": "a",
            "holders": {"a": {"shards": 4}, "b": {"shards": 1}},
            "local": {"state": "fetching", "progress": {"shards_done": 1}},
        }
    ]
    assert ls_rows(listing) == [
        ("smollm2", "17", "3.0 MiB", "4 x 1.0 MiB", "a", "a 4/4, b 1/4", "fetching 1/4")
    ]
    p = {
        "name": "smollm2",
        "num_shards": 4,
        "shards_done": 2,
        "bytes_done": 2**21,
        "size": 2**22,
        "elapsed_s": 1.25,
        "bytes_from": {"b": 2**20, "a": 2**20},
        "corrupt": 1,
        "failed_reads": 0,
    }
    assert progress_line(p) == (
        "smollm2: 2/4 shards (50%), 2.0 MiB of 4.0 MiB in 1.2s from a 1.0 MiB, b 1.0 MiB; "
        "1 bad shards, 0 failed reads refetched"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["objects", "get"], "'objects get' needs the object's name"),
        (["objects", "put", "x"], "'objects put' needs the path"),
        (["objects", "rm", "x", "/p"], "'objects rm' takes no path"),
        (["objects", "ls", "-o", "/p"], "only 'objects get' takes --output"),
    ],
)
def test_command_line_mistakes_are_usage_errors(argv: list[str], message: str) -> None:
    err = io.StringIO()
    status = run(["--url", "http://127.0.0.1:9", *argv], Env(io.StringIO(), err, {}))
    assert status == 2 and message in err.getvalue()


def test_a_download_is_checked_shard_by_shard() -> None:
    data = bytes(range(256)) * 40  # 10240 bytes: shards of 4096, 4096, 2048
    sums = tuple(hashlib.sha256(data[i : i + 4096]).digest() for i in range(0, len(data), 4096))
    m = Manifest(
        "x", 1, "a", "x.bin", False, (ObjectFile("x.bin", len(data), 0),), len(data), 4096,
        "sha256", sums, digest_of("sha256", len(data), 4096, sums),
    )  # fmt: skip
    checker = StreamChecker(m)
    for i in range(0, len(data), 1000):  # chunks that straddle shards
        checker.update(data[i : i + 1000])
    checker.finish()
    bad = StreamChecker(m)
    with pytest.raises(ValueError, match="shard 1 of 'x' failed its check"):
        bad.update(data[:5000] + b"\0" + data[5001:])
    short = StreamChecker(m)
    short.update(data[:4096])
    with pytest.raises(ValueError, match="sent 1 of the 3 shards"):
        short.finish()
    with pytest.raises(ValueError, match="more than the 10240 bytes"):
        StreamChecker(m).update(data + b"!")
