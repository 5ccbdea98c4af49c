"""The KV connector against vLLM's real CPU build: vLLM instances sharing one
mooncaked node, and vLLM serving on when the node dies. Each test starts
vLLM servers (minutes): marked ``vllm``, run by tools/vllm_connector_check.sh,
skipped unless MOONCAKED_VLLM_PYTHON names vLLM's interpreter."""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("MOONCAKED_VLLM_PYTHON", "")
MODEL_DIR = Path(
    os.environ.get(
        "MOONCAKED_VLLM_MODEL_DIR", "~/.cache/mooncaked-bench/hf-SmolLM2-135M-Instruct.Q4_1"
    )
).expanduser()

pytestmark = [
    pytest.mark.vllm,
    # Up to three vLLM servers start one after another in a test (each a
    # minute or more on two cores), past the suite's per-test limit.
    pytest.mark.timeout(1200),
    pytest.mark.skipif(
        not VLLM_PYTHON or not Path(VLLM_PYTHON).exists(),
        reason="MOONCAKED_VLLM_PYTHON does not name vLLM's interpreter "
        "(tools/vllm_connector_check.sh sets it)",
    ),
    pytest.mark.skipif(
        not (MODEL_DIR / "config.json").is_file(),
        reason=f"no Hugging Face directory at {MODEL_DIR} (tools/vllm_anchor.sh makes it)",
    ),
]

_spec = importlib.util.spec_from_file_location(
    "bench_vllm_connector", ROOT / "tools/bench_vllm_connector.py"
)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_vllm_connector"] = bench
_spec.loader.exec_module(bench)

START_S = 600.0


def test_a_prompt_computed_by_one_instance_is_loaded_by_another(tmp_path: Path) -> None:
    prompt = bench.prompt_ids(512, seed=3)
    with bench.node(sys.executable, MODEL_DIR, tmp_path, START_S) as (node_url, _):
        with bench.vllm(VLLM_PYTHON, MODEL_DIR, tmp_path / "alone.log", None, START_S) as url:
            alone = bench.complete(url, prompt, 8)
        with bench.vllm(VLLM_PYTHON, MODEL_DIR, tmp_path / "a.log", node_url, START_S) as url:
            bench.complete(url, prompt, 8)
            # A's puts leave after its steps, off its path: B starts once
            # the node holds them.
            assert bench.saved_on_node(node_url, prompt, START_S)
        with bench.vllm(VLLM_PYTHON, MODEL_DIR, tmp_path / "b.log", node_url, START_S) as url:
            shared = bench.complete(url, prompt, 8)
    assert bench.loaded_bytes(tmp_path / "a.log") == []
    # B loaded every vLLM block (32 tokens) but the one holding the last
    # prompt token: 30 node blocks of 16 tokens, 30 layers x K,V x 16 x 3
    # heads x 64 x 4 bytes.
    assert bench.loaded_bytes(tmp_path / "b.log") == [30 * 30 * 2 * 16 * 3 * 64 * 4]
    assert shared.text == alone.text


def test_vllm_serves_on_when_its_node_is_killed(tmp_path: Path) -> None:
    prompt = bench.prompt_ids(256, seed=4)
    with bench.node(sys.executable, MODEL_DIR, tmp_path, START_S) as (node_url, node_proc):
        with bench.vllm(VLLM_PYTHON, MODEL_DIR, tmp_path / "a.log", node_url, START_S) as url:
            before = bench.complete(url, prompt, 8)
            os.killpg(node_proc.pid, signal.SIGKILL)
            node_proc.wait()
            # A new prompt (nothing to load, saves fail) and the same one
            # (vLLM's own prefix cache): both served.
            other = bench.complete(url, bench.prompt_ids(256, seed=5), 8)
            again = bench.complete(url, prompt, 8)
    assert other.text
    assert again.text == before.text


def test_a_mooncaked_request_and_vllm_reuse_each_others_blocks(tmp_path: Path) -> None:
    """Same HF directory, precision and block size on both engines: the same
    model id and block hashes, and rows in the node's one layout."""
    args = argparse.Namespace(
        vllm_python=VLLM_PYTHON,
        python=sys.executable,
        model_dir=MODEL_DIR,
        prompt_tokens=512,
        max_tokens=8,
        seed=5,
        start_timeout=START_S,
    )
    c = bench.cross(args, tmp_path)
    # vLLM loaded what the node computed: every vLLM block (32 tokens) but the
    # one holding the last prompt token, as node blocks of 16 tokens.
    assert c.vllm_loaded_bytes == 30 * 30 * 2 * 16 * 3 * 64 * 4
    # The node's own request found what vLLM computed and saved: every full
    # block of 16 but the last (its last token is always computed).
    assert c.node_cached_tokens == 512 - 16
    assert c.vllm_text_same and c.node_text_same
