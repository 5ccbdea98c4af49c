"""systemd's notify protocol around a real daemon process: READY=1 once
serving, WATCHDOG=1 pings while healthy, STOPPING=1 on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TEST_TOML, _env

# A daemon's whole life under a notify socket, watchdog pings included.
pytestmark = pytest.mark.slow


def recv_until(sock: socket.socket, want: str, timeout_s: float) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            msg = sock.recv(4096).decode()
        except TimeoutError:
            break
        got.append(msg)
        if want in msg.splitlines():
            return got
    raise AssertionError(f"no {want} within {timeout_s} s; got {got}")


def test_ready_watchdog_and_stopping(tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    cfg = tmp_path / "m.toml"
    cfg.write_text(TEST_TOML)
    env = {**_env(), "NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mooncaked", "--config", str(cfg)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        msgs = recv_until(sock, "READY=1", 90)
        assert not any("WATCHDOG=1" in m for m in msgs), "pinged before ready"
        # 0.2 s between pings: a few arrive in two seconds.
        pings = [m for m in recv_until(sock, "WATCHDOG=1", 10)]
        pings += recv_until(sock, "WATCHDOG=1", 10)
        assert len([m for m in pings if m == "WATCHDOG=1"]) >= 2, pings
        os.kill(proc.pid, signal.SIGTERM)
        recv_until(sock, "STOPPING=1", 30)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()
