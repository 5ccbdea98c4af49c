"""`mooncakectl up --cpp`: a pipelined prefill group of detached daemons on
the builtin model, serving the same greedy text as one node alone."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from mooncakectl.local.plan import free_port

# Four daemons started and stopped through mooncakectl.
pytestmark = pytest.mark.slow

# Small pools so the nodes start fast; chunks small enough that a prompt of
# a few hundred tokens crosses the stages in several.
BASE_TOML = """\
[kv]
num_blocks = 512

[pipeline]
chunk_tokens = 96
"""


def ctl(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mooncakectl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def complete(url: str, prompt: str | list[int]) -> tuple[str, str | None]:
    """Greedy text of 16 tokens (EOS ignored) and the node that ran the prefill."""
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    req = urllib.request.Request(
        url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
        return doc["choices"][0]["text"], resp.headers.get("x-mooncaked-prefill-node")


def test_up_cpp_serves_what_one_node_serves(tmp_path: Path) -> None:
    base = tmp_path / "base.toml"
    base.write_text(BASE_TOML)
    rng = random.Random(0)
    prompts: list[str | list[int]] = [
        "Once upon a time",
        [rng.randrange(32, 256) for _ in range(300)],
    ]
    group_dir, single_dir = str(tmp_path / "group"), str(tmp_path / "single")
    model = ("--model", "builtin:tiny", "--config", str(base))
    started = ctl(
        "up", "--prefill", "2", "--decode", "1", "--cpp", "2", *model, "--run-dir", group_dir
    )
    try:
        assert started.returncode == 0, started.stderr
        lines = started.stdout.splitlines()
        entry = lines[0].removeprefix("cluster ready: entry ")
        # Each stage with its group and its half of the builtin model's 4 layers.
        assert "cpp-0 stage 0/2, layers 0-1 of 4" in lines[1] and "prefill-0" in lines[1]
        assert "cpp-0 stage 1/2, layers 2-3 of 4" in lines[2] and "prefill-1" in lines[2]
        assert "decode-0" in lines[3] and "stage" not in lines[3]
        got = [complete(entry, p) for p in prompts]
    finally:
        stopped = ctl("down", "--run-dir", group_dir)
    assert stopped.returncode == 0, stopped.stderr
    port = free_port()
    started = ctl("up", "--port", str(port), *model, "--run-dir", single_dir)
    try:
        assert started.returncode == 0, started.stderr
        want = [complete(f"http://127.0.0.1:{port}", p) for p in prompts]
    finally:
        ctl("down", "--run-dir", single_dir)
    # The group's head ran every prefill, and the text is the single node's.
    assert [node for _, node in got] == ["prefill-0", "prefill-0"]
    assert [text for text, _ in got] == [text for text, _ in want]
    assert all(len(text) > 0 for text, _ in want)
