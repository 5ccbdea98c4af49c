"""``mooncakectl bench cpp``, run with tiny settings on the builtin model so it cannot rot."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from mooncakectl.cli import run
from mooncakectl.registry import Env

# Two loopback clusters, one after the other; the report has unit tests.
pytestmark = pytest.mark.slow


def test_bench_cpp_smoke(tmp_path: Path) -> None:
    out = tmp_path / "cpp.json"
    env = Env(stdout=io.StringIO(), stderr=io.StringIO(), environ={})
    status = run(
        [
            "bench", "cpp", "--model", "builtin:tiny", "--prompt-lens", "40,200", "--reps", "1",
            "--check-tokens", "6", "--suffix-tokens", "20", "--chunk-tokens", "64",
            "--json", str(out),
        ],
        env,
    )  # fmt: skip
    stdout, stderr = env.stdout.getvalue(), env.stderr.getvalue()  # type: ignore[attr-defined]
    assert status == 0, stdout + stderr[-4000:]
    doc = json.loads(out.read_text())
    single, group = doc["arrangements"]
    assert (single["name"], group["name"]) == ("1P+1D", "CPP 2")
    assert [n["stage"] for n in group["nodes"]] == [
        "cpp-0 stage 0/2, layers 0-1 of 4",
        "cpp-0 stage 1/2, layers 2-3 of 4",
        "",
    ]
    for arr in (single, group):
        samples = arr["samples"]
        # Each length fresh, then resent with its suffix.
        assert [(s["prompt_tokens"], s["reuse"]) for s in samples] == [
            (40, False), (40, True), (200, False), (200, True),
        ]  # fmt: skip
        assert all(s["prefill_node"] == "prefill-0" and s["ttft_ms"] > 0 for s in samples)
        # No hit on a fresh prompt; the whole blocks of the first pass on the second.
        assert [s["cached_tokens"] for s in samples] == [0, 32, 0, 192]
        assert all(len(s["text"]) > 0 for s in samples)
    assert [s["text"] for s in group["samples"]] == [s["text"] for s in single["samples"]]
    assert set(doc["speedup"]["CPP 2"]["fresh"]) == {"40", "200"}
    assert doc["failures"] == []
    assert "CPP 2 vs 1P+1D: fresh 2/2 same, prefix cached 2/2 same" in stdout
    assert stdout.endswith("checks: ok\n")
