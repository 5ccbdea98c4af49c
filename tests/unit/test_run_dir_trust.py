"""``mooncakectl up``/``down`` do not trust a run directory others could have written:
a planted ``nodes.json`` signals nothing that is not the daemon ``up`` started,
and the secret never goes into a file another user can read."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncakectl.cli import run
from mooncakectl.local.plan import free_port
from mooncakectl.registry import Env
from mooncakectl.rundir import (
    STATE_FILE,
    UntrustedPath,
    identity,
    not_our_daemon,
    open_run_dir,
    process_info,
    read_state,
    write_private,
)


def ctl(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = run(list(argv), Env(stdout=out, stderr=err, environ={}))
    return status, out.getvalue(), err.getvalue()


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A process of this user that is not a daemon: what a planted pid names."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def plant(run_dir: Path, nodes: list[dict[str, object]], mode: int = 0o600) -> None:
    path = run_dir / STATE_FILE
    path.write_text(json.dumps({"nodes": nodes}))
    path.chmod(mode)


def test_down_does_not_signal_a_planted_pid(
    tmp_path: Path, bystander: subprocess.Popen[bytes]
) -> None:
    plant(tmp_path, [{"pid": bystander.pid, "url": "http://127.0.0.1:1"}])
    status, out, err = ctl("down", "--run-dir", str(tmp_path), "--wait", "1")
    assert bystander.poll() is None, "down killed a process that is not a daemon"
    assert f"not signalling pid {bystander.pid}" in err
    assert "nothing to stop" in out and status == 0


def test_down_does_not_signal_a_reused_pid(
    tmp_path: Path, bystander: subprocess.Popen[bytes]
) -> None:
    # Recorded as up records a daemon, but the process's start time differs:
    # the pid now belongs to a later process.
    record = {"pid": bystander.pid, "url": "u", **identity(bystander.pid, "/x/mooncaked.toml")}
    record["start_ticks"] = int(record["start_ticks"]) - 1
    assert "reused" in str(not_our_daemon(record))
    plant(tmp_path, [record])
    ctl("down", "--run-dir", str(tmp_path), "--wait", "1")
    assert bystander.poll() is None


def test_a_recorded_daemon_is_recognised(tmp_path: Path) -> None:
    config = tmp_path / "mooncaked.toml"
    # A process whose command line is the one up starts (it never runs a daemon).
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(120)",
            "-m",
            "mooncaked",
            "--config",
            str(config),
        ]
    )
    try:
        # Popen returns once the child left the parent's memory (vfork), a
        # moment before the kernel fills in its new command line.
        deadline = time.monotonic() + 10.0
        while not (info := process_info(proc.pid)) or not info.argv:
            assert time.monotonic() < deadline, "the child's command line never appeared"
            time.sleep(0.01)
        record = {"pid": proc.pid, **identity(proc.pid, str(config))}
        assert not_our_daemon(record) is None
        assert "not the mooncaked" in str(not_our_daemon({**record, "config": "/other.toml"}))
    finally:
        proc.kill()
        proc.wait()
    assert not_our_daemon(record) == "it is not running"


def test_run_dir_writable_by_others_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "run"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UntrustedPath, match="writable by other users"):
        open_run_dir(shared)
    status, _, err = ctl("down", "--run-dir", str(shared))
    assert status == 2 and "writable by other users" in err
    # A fresh one is created for this user alone.
    mine = open_run_dir(tmp_path / "fresh")
    assert (mine.stat().st_mode & 0o777) == 0o700


def test_nodes_file_writable_by_others_or_a_link_is_refused(tmp_path: Path) -> None:
    plant(tmp_path, [{"pid": 1}], mode=0o666)
    with pytest.raises(UntrustedPath, match="writable by other users"):
        read_state(tmp_path)
    (tmp_path / STATE_FILE).unlink()
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"nodes": [{"pid": 1}]}))
    (tmp_path / STATE_FILE).symlink_to(target)
    with pytest.raises(UntrustedPath):
        read_state(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file another user's")
def test_run_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UntrustedPath, match="belongs to uid 65534"):
        open_run_dir(theirs)


def test_up_refuses_to_write_the_secret_into_a_readable_file(tmp_path: Path) -> None:
    port = free_port()
    planted = tmp_path / f"mooncaked-{port}.toml"
    planted.write_text("# someone else's\n")
    planted.chmod(0o644)
    status, _, err = ctl("up", "--port", str(port), "--run-dir", str(tmp_path))
    assert status == 2, err
    assert "refusing to write a secret" in err and "readable or writable by other users" in err
    assert planted.read_text() == "# someone else's\n"
    assert not (tmp_path / STATE_FILE).exists()


def test_write_private_creates_0600_and_refuses_links(tmp_path: Path) -> None:
    path = tmp_path / "secret.toml"
    write_private(path, "k = 1\n")
    assert (path.stat().st_mode & 0o777) == 0o600 and path.read_text() == "k = 1\n"
    link = tmp_path / "link.toml"
    link.symlink_to(tmp_path / "victim")
    with pytest.raises(UntrustedPath):
        write_private(link, "secret")
    assert not (tmp_path / "victim").exists()
