"""The mooncaked process: signals, drain, exit status, config errors, logs."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

WAIT_S = 30.0


def greedy(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A streamed greedy completion's body that runs its ``max_tokens`` in full."""
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }


def open_stream(
    port: int, body: dict[str, Any]
) -> tuple[http.client.HTTPConnection, Iterator[dict[str, Any]]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps(body),
        headers={"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()

    def events() -> Iterator[dict[str, Any]]:
        while True:
            line = resp.readline()
            if not line:
                raise AssertionError("the stream ended without [DONE]")
            text = line.decode().strip()
            if not text:
                continue
            if text == "data: [DONE]":
                return
            yield json.loads(text[len("data: ") :])

    return conn, events()


def status_of(req: str | urllib.request.Request) -> int | None:
    """HTTP status of a call; None when the connection is refused (server closed)."""
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError):
        return None


def get_status(url: str) -> int | None:
    return status_of(url)


def post_status(url: str, body: dict[str, Any]) -> int | None:
    return status_of(
        urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
    )


def wait_draining(url: str) -> bool:
    """True once /ready says 503; False if the server closed first."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        status = get_status(url + "/ready")
        if status == 503:
            return True
        if status is None:
            return False
        time.sleep(0.01)
    raise AssertionError("the daemon did not start draining")


@pytest.mark.slow
def test_sigterm_drains_in_flight_then_exits_0(daemon_factory: Callable[..., Any]) -> None:
    d = daemon_factory()
    # Long enough that the drain is still waiting for it when /ready is asked.
    conn, events = open_stream(
        d.port, greedy("drain me", 400, stream_options={"include_usage": True})
    )
    first = next(events)
    d.signal(signal.SIGTERM)
    assert wait_draining(d.url), "the 400-token request should still be running"
    # Refused for new work while the old one runs on; still alive.
    assert post_status(d.url + "/v1/completions", {"prompt": "late"}) == 503
    assert get_status(d.url + "/health") == 200
    rest = list(events)
    conn.close()
    usage = rest[-1]["usage"]
    assert usage["completion_tokens"] == 400
    assert [e["choices"][0]["finish_reason"] for e in (first, *rest) if e["choices"]][
        -1
    ] == "length"
    assert d.proc.wait(WAIT_S) == 0

    # Logs: JSON (stderr is not a terminal), one object a line, node id bound.
    records = [json.loads(line) for line in d.stderr().splitlines() if line.strip()]
    node_id = f"{socket.gethostname()}-{d.port}"
    assert all(r["node"] == node_id for r in records), records[:3]
    events_logged = [r["event"] for r in records]
    assert "signal: draining" in events_logged and "drained" in events_logged
    assert any(r["event"] == "mooncaked listening" and r["url"] == d.url for r in records)


@pytest.mark.slow
def test_second_signal_forces_exit(daemon_factory: Callable[..., Any]) -> None:
    d = daemon_factory()
    conn, events = open_stream(d.port, greedy("a long one", 3000))
    next(events)
    d.signal(signal.SIGTERM)
    assert wait_draining(d.url), "the 3000-token request should still be running"
    d.signal(signal.SIGTERM)
    assert d.proc.wait(WAIT_S) == 3
    conn.close()


def run_mooncaked(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mooncaked", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


@pytest.mark.parametrize(
    ("toml", "extra", "words"),
    [
        ("[server]\nprot = 8000\n", (), ["server.prot", "unknown key"]),
        ("[kv]\nblock_size = 12\n", (), ["kv.block_size", "power of two"]),
        ('[scheduler]\nmax_num_seqs = "many"\n', (), ["scheduler.max_num_seqs", "integer"]),
        ("[server\nport = 1\n", (), ["not valid TOML"]),
        ("[gpu]\nx = 1\n", (), ["unknown section [gpu]"]),
        ("", ("--port", "70000"), ["server.port", "command line"]),
        ("", ("--role", "router"), ["node.role", "router"]),
    ],
)
def test_bad_config_exits_2_naming_key_and_file(
    tmp_path: Path, toml: str, extra: tuple[str, ...], words: list[str]
) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(toml)
    proc = run_mooncaked("--config", str(cfg), *extra, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mooncaked: config error: ")
    assert str(cfg) in lines[0]
    for w in words:
        assert w in lines[0], lines[0]


def test_missing_config_file_exits_2(tmp_path: Path) -> None:
    proc = run_mooncaked("--config", str(tmp_path / "nope.toml"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "nope.toml" in proc.stderr and "cannot read" in proc.stderr


def test_port_in_use_fails_start_up_with_1(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_mooncaked("--port", str(port), "--log-format", "json", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    failed = [json.loads(line) for line in proc.stderr.splitlines() if "start-up failed" in line]
    assert failed and failed[-1]["level"] == "error"
