"""The engine benchmark's inputs (``mooncakectl.bench.engine_bench``, for
tools/bench_engine.py): the trace-shaped output lengths, the workload, the anchor."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from mooncakectl.bench import engine_bench as bench
from mooncakectl.bench.engine_bench import AnchorError
from tests.conftest import REPO_ROOT


def test_built_in_quantiles_follow_the_trace_fixture() -> None:
    # The fixture is the trace's first 200 requests: its median output length
    # lies near the built-in distribution's (both around 350 tokens).
    lines = (REPO_ROOT / "tests/fixtures/conversation_trace_head200.jsonl").read_text()
    head = [json.loads(line)["output_length"] for line in lines.splitlines() if line]
    quantiles = bench.TRACE_OUTPUT_QUANTILES
    assert len(quantiles) == 64 and list(quantiles) == sorted(quantiles)
    assert max(head) <= bench.TRACE_MAX_OUTPUT
    assert abs(statistics.median(head) - statistics.median(quantiles)) < 60


def test_output_lengths_are_scaled_to_the_longest() -> None:
    lengths = bench.trace_output_lengths(2000, 256, random.Random(0))
    assert min(lengths) >= 1 and max(lengths) <= 256 * 1249 // 2000 + 1
    # Scaled by 256 / 2000: the trace's median (~350) becomes ~45.
    assert 35 <= statistics.median(lengths) <= 55
    # Variable: short and long outputs both occur.
    assert min(lengths) <= 2 and max(lengths) >= 100


def test_workload_is_reproducible() -> None:
    a = bench.make_workload(16, 8, 40, 128, seed=3, vocab=384)
    b = bench.make_workload(16, 8, 40, 128, seed=3, vocab=384)
    assert a.prompts == b.prompts and a.output_lens == b.output_lens
    assert all(8 <= len(p) <= 40 and all(32 <= t < 384 for t in p) for p in a.prompts)
    assert a.num_output_tokens == sum(a.output_lens)


def test_llamacpp_anchor_file_is_read(tmp_path: Path) -> None:
    tool = tmp_path / "llama-bench"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    env = tmp_path / "anchor.env"
    env.write_text(
        f"LLAMACPP_ANCHOR_DIR={tmp_path}\n"
        'LLAMACPP_VERSION="llama-cpp-python 0.3.36, llama.cpp abc123"\n'
        f"LLAMACPP_BENCH={tool}\nLLAMACPP_QUANTIZE={tool}\n"
    )
    anchor = bench.read_anchor(str(env))
    assert anchor.bench == tool and anchor.models == tmp_path / "models"
    assert anchor.version == "llama-cpp-python 0.3.36, llama.cpp abc123"


def test_llamacpp_anchor_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(AnchorError, match="cannot read the anchor file"):
        bench.read_anchor(str(tmp_path / "missing.env"))
    env = tmp_path / "anchor.env"
    env.write_text(f"LLAMACPP_ANCHOR_DIR={tmp_path}\nLLAMACPP_BENCH={tmp_path}/nope\n")
    with pytest.raises(AnchorError, match="LLAMACPP_QUANTIZE"):
        bench.read_anchor(str(env))
    env.write_text(
        f"LLAMACPP_ANCHOR_DIR={tmp_path}\nLLAMACPP_BENCH={tmp_path}/nope\n"
        f"LLAMACPP_QUANTIZE={tmp_path}/nope\n"
    )
    with pytest.raises(AnchorError, match="not an executable"):
        bench.read_anchor(str(env))


def test_every_precision_has_a_llamacpp_type() -> None:
    assert set(bench.LLAMACPP_TYPES) == set(bench.PRECISIONS)
