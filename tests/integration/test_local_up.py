"""`mooncakectl up` / `down`: a real detached daemon, started, used and drained."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mooncakectl", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_up_streams_a_completion_and_down_drains(tmp_path: Path) -> None:
    port = free_port()
    run_dir = str(tmp_path)
    started = ctl(
        "up", "--port", str(port), "--run-dir", run_dir, "--prompt", "Hello", "--max-tokens", "12"
    )
    try:
        assert started.returncode == 0, started.stderr
        lines = started.stdout.splitlines()
        assert lines[0].startswith(f"mooncaked ready at http://127.0.0.1:{port}")
        assert lines[1] == "> Hello"
        assert len(lines[2]) > 0  # the streamed completion
        again = ctl("up", "--port", str(port), "--run-dir", run_dir)
        assert again.returncode == 1
        assert "already running" in again.stderr
        status = ctl("--url", f"http://127.0.0.1:{port}", "--json", "status")
        assert status.returncode == 0 and '"ready": true' in status.stdout
    finally:
        stopped = ctl("down", "--run-dir", run_dir)
    assert stopped.returncode == 0, stopped.stderr
    assert f"stopped http://127.0.0.1:{port}" in stopped.stdout
    assert ctl("--url", f"http://127.0.0.1:{port}", "status").returncode == 3
    assert ctl("down", "--run-dir", run_dir).stdout.strip() == "nothing to stop"
