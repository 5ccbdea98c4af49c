"""Reduced precision on the CPU: ``model.dtype`` honoured, parity with transformers.

bfloat16 is compared with transformers running the same checkpoint in
bfloat16. The two differ only in rounding (fused q/k/v and gate/up matmuls,
another summation order), so the bound is a few bf16 steps at the logits'
size: |logit| < 4 in these models, where one bf16 step is 1/64.
``BF16_TOL`` = 0.125 is 8 steps; a wrong weight, RoPE or cache read is off
by whole units.

Greedy decoding runs through the paged bf16 K/V cache, one decode step at a
time, and each step's logits are checked against transformers' over the
same sequence. Where the two disagree on the next token it must be a near
tie in transformers' own logits (within the tolerance), never a real
difference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mooncaked.config import ModelConfig
from mooncaked.engine.loader import (
    LoadedModel,
    cpu_flags,
    cpu_has_bf16,
    load_model,
    resolve_dtype,
)
from mooncaked.engine.plan import StepPlan, chunk_of
from mooncaked.engine.runner import ModelRunner
from mooncaked.request import Request, SamplingParams
from tests.hf_fixtures import VOCAB_SIZE, make_hf_model

BLOCK = 16
BF16_TOL = 0.125
CPU = torch.device("cpu")


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, VOCAB_SIZE, (n,), generator=g).tolist()


def _hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def greedy_logits(loaded: LoadedModel, prompt: list[int], new_tokens: int) -> torch.Tensor:
    """Our logits [len(prompt) + new_tokens - 1, vocab]: one prefill, then greedy
    decode steps through the paged cache, each step's single row appended."""
    runner = ModelRunner(loaded, num_blocks=16, block_size=BLOCK)
    table = list(range((len(prompt) + new_tokens + BLOCK - 1) // BLOCK))
    req = Request("g", prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens))
    (logits,) = runner.forward_logits(StepPlan([chunk_of(req, prompt, 0, table, True)]))
    rows = [logits]
    ids = list(prompt)
    for _ in range(new_tokens - 1):
        ids.append(int(rows[-1][-1].argmax()))
        (step,) = runner.forward_logits(
            StepPlan([chunk_of(req, [ids[-1]], len(ids) - 1, table, True)])
        )
        rows.append(step)
    return torch.cat(rows)


def check_greedy_parity(ours: torch.Tensor, theirs: torch.Tensor, tol: float) -> int:
    """Number of positions where the top-1 tokens differ; each one must be a near tie."""
    mine, best = ours.argmax(-1), theirs.argmax(-1)
    differ = (mine != best).nonzero().flatten().tolist()
    for pos in differ:
        margin = float(theirs[pos, best[pos]] - theirs[pos, mine[pos]])
        assert margin <= tol, f"position {pos}: top-1 differs by a logit margin of {margin:.3f}"
    return len(differ)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def bf16_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = tmp_path_factory.mktemp(f"{request.param}_bf16")
    hf = make_hf_model(request.param, d, seed=7).to(torch.bfloat16)
    return hf, load_model(ModelConfig(path=str(d), dtype="bfloat16"))


def test_bfloat16_is_honoured_on_the_cpu(bf16_case: Any) -> None:
    _hf, loaded = bf16_case
    assert loaded.dtype == torch.bfloat16 and loaded.device.type == "cpu"
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    runner = ModelRunner(loaded, num_blocks=4, block_size=BLOCK)
    assert runner.kv_buffer.dtype == torch.bfloat16
    # Another precision, other K/V bytes: other block hashes.
    assert loaded.model_id.endswith("#bfloat16")


def test_bfloat16_logits_and_greedy_match_hf_in_bfloat16(bf16_case: Any) -> None:
    hf, loaded = bf16_case
    prompt, new_tokens = _prompt(3, 21), 24
    ours = greedy_logits(loaded, prompt, new_tokens)
    ids = prompt + ours[len(prompt) - 1 :].argmax(-1).tolist()[: new_tokens - 1]
    theirs = _hf_logits(hf, ids)
    torch.testing.assert_close(ours, theirs, atol=BF16_TOL, rtol=0)
    assert check_greedy_parity(ours, theirs, BF16_TOL) <= 2


def test_float32_stays_the_cpu_default_without_bf16_instructions() -> None:
    assert resolve_dtype("float32", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype("float16", CPU) == torch.float16
    expected = torch.bfloat16 if cpu_has_bf16() else torch.float32
    assert resolve_dtype("auto", CPU) == expected
    assert load_model(ModelConfig()).model_id == "builtin:tiny@0"
    with pytest.raises(ValueError, match="'float8'"):
        resolve_dtype("float8", CPU)


def test_bf16_instructions_are_read_from_cpu_flags() -> None:
    x86 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"
    old = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n"
    assert cpu_has_bf16(cpu_flags(x86)) and cpu_has_bf16(cpu_flags(arm))
    assert not cpu_has_bf16(cpu_flags(old))
    assert cpu_flags("no flags here") == frozenset()


def test_unknown_dtype_in_config_is_named(tmp_path: Path) -> None:
    from mooncaked.config import ConfigError, load_config

    path = tmp_path / "c.toml"
    path.write_text('[model]\ndtype = "float8"\n')
    with pytest.raises(ConfigError, match="dtype"):
        load_config(path)
