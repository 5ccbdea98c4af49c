"""Our loader + runner against transformers, on small random Llama and Qwen2 checkpoints.

Logits must match HF's at every computed position (fp32, 1e-4) for a mixed
step plan: full prefills, a prefix-cache hit (a block table that starts with
another sequence's blocks, only the tail computed), a prefill chunked over
three steps, and decodes in the same batch. Greedy generation must be
token-identical to HF's ``generate(do_sample=False)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mooncaked.config import ModelConfig
from mooncaked.engine.loader import LoadedModel, load_model
from mooncaked.engine.plan import StepPlan, chunk_of
from mooncaked.engine.runner import ModelRunner
from mooncaked.request import Request, SamplingParams
from tests.hf_fixtures import EOS, make_hf_model, plain_prompt
from tests.parity import greedy_together, hf_greedy, hf_logits

BLOCK = 16
TOL = 1e-4

CASES = [("llama", False), ("llama", True), ("qwen2", False), ("mistral", False)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}{'-sharded' if c[1] else ''}")
def hf_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kind, sharded = request.param
    d = tmp_path_factory.mktemp(f"{kind}{'_sharded' if sharded else ''}")
    hf = make_hf_model(kind, d, sharded=sharded, seed=7)
    # float32 through F.linear: the reference arithmetic, compared at 1e-4.
    loaded = load_model(ModelConfig(path=str(d), dtype="float32", linear_kernel="dense"))
    return kind, sharded, d, hf, loaded


class Blocks:
    """Hands out block ids in order: the simplest allocator a test needs."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=64))


def test_loader_reads_the_directory(hf_case: Any) -> None:
    kind, _sharded, d, hf, loaded = hf_case
    assert isinstance(loaded, LoadedModel)
    arch = loaded.arch
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 2, 16)
    assert arch.qkv_bias is (kind == "qwen2")
    assert arch.tie_word_embeddings is (kind == "qwen2")
    if kind == "llama":
        assert arch.rope_scaling is not None and arch.rope_scaling.rope_type == "llama3"
    if kind == "mistral":
        assert arch.rope_scaling is not None and arch.rope_scaling.rope_type == "linear"
    assert loaded.max_model_len == 512
    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu"
    assert loaded.model_id.startswith(f"hf:{d.name}@")
    assert loaded.served_name == d.name
    tok = loaded.tokenizer
    assert tok.eos_token_ids == (2,)
    assert tok.encode("w0 w1") == [1, 6, 7]
    assert tok.encode("w0 w1", add_special_tokens=False) == [6, 7]
    assert tok.decode([1, 6, 7, 2]) == "w0 w1"
    assert tok.decode([6, 2], skip_special_tokens=False) == f"w0 {EOS}"
    text = tok.apply_chat_template([{"role": "user", "content": "w3"}])
    assert text == "<s>user: w3\nassistant:"
    # Weights really came from the files: HF's own tensors, by name.
    ours = dict(loaded.model.named_parameters(remove_duplicate=False))
    for name, p in hf.named_parameters():
        assert torch.equal(ours[name].detach(), p.detach()), name


def test_model_id_is_stable_and_content_addressed(hf_case: Any) -> None:
    _kind, _sharded, d, _hf, loaded = hf_case
    again = load_model(
        ModelConfig(path=str(d), served_name="x", dtype="float32", linear_kernel="dense")
    )
    assert again.model_id == loaded.model_id
    assert again.served_name == "x"


def test_mixed_plan_logits_match_hf(hf_case: Any) -> None:
    _kind, _sharded, _d, hf, loaded = hf_case
    runner = ModelRunner(loaded, num_blocks=64, block_size=BLOCK)
    blocks = Blocks()

    a = plain_prompt(1, 37)  # full prefill in step 1, then a decode in step 2
    b = plain_prompt(2, 45)  # chunked prefill: 16 + 20 + 9 tokens over three steps
    c = plain_prompt(3, 5)  # short prefill
    d = a[:32] + plain_prompt(4, 13)  # shares a's first two blocks: a prefix-cache hit
    ta, tb, tc = blocks.take(3), blocks.take(3), blocks.take(1)
    # d reuses a's two full blocks and owns the rest.
    td = ta[:2] + blocks.take(1)
    ra, rb, rc, rd = _req("a", a), _req("b", b), _req("c", c), _req("d", d)

    step1 = StepPlan(
        [
            chunk_of(ra, a, 0, ta, True),
            chunk_of(rb, b[:16], 0, tb, False),
            chunk_of(rc, c, 0, tc, True),
        ]
    )
    la, lb1, lc = runner.forward_logits(step1)

    a_next = int(la[-1].argmax())
    a_full = [*a, a_next]
    step2 = StepPlan(
        [
            chunk_of(rd, d[32:], 32, td, True),
            chunk_of(rb, b[16:36], 16, tb, False),
            chunk_of(ra, [a_next], 37, ta, True),
        ]
    )
    ld, lb2, la2 = runner.forward_logits(step2)
    step3 = StepPlan([chunk_of(rb, b[36:], 36, tb, True)])
    (lb3,) = runner.forward_logits(step3)

    ref_a = hf_logits(hf, a_full)
    ref_b = hf_logits(hf, b)
    torch.testing.assert_close(la, ref_a[:37], atol=TOL, rtol=0)
    torch.testing.assert_close(la2, ref_a[37:38], atol=TOL, rtol=0)
    torch.testing.assert_close(lc, hf_logits(hf, c), atol=TOL, rtol=0)
    torch.testing.assert_close(ld, hf_logits(hf, d)[32:], atol=TOL, rtol=0)
    torch.testing.assert_close(torch.cat([lb1, lb2, lb3]), ref_b, atol=TOL, rtol=0)
    assert lb1.shape[0] == 16 and lb2.shape[0] == 20 and lb3.shape[0] == 9


def test_execute_samples_only_where_asked(hf_case: Any) -> None:
    _kind, _sharded, _d, hf, loaded = hf_case
    runner = ModelRunner(loaded, num_blocks=16, block_size=BLOCK)
    a, b = plain_prompt(5, 20), plain_prompt(6, 33)
    plan = StepPlan(
        [
            chunk_of(_req("a", a), a, 0, [0, 1], True),
            chunk_of(_req("b", b), b[:17], 0, [2, 3, 4], False),
        ]
    )
    out = runner.execute(plan)
    assert out[1] is None
    assert out[0] is not None
    assert out[0].token_id == int(hf_logits(hf, a)[-1].argmax())


@pytest.mark.slow
def test_greedy_generation_matches_hf_generate(hf_case: Any) -> None:
    _kind, _sharded, _d, hf, loaded = hf_case
    runner = ModelRunner(loaded, num_blocks=64, block_size=BLOCK)
    new_tokens = 64
    prompts = [plain_prompt(10, 7), plain_prompt(11, 23), plain_prompt(12, 16)]
    # Step 1 prefills all three; later steps decode them together.
    ours = greedy_together(runner, prompts, new_tokens)
    for got, p in zip(ours, prompts, strict=True):
        ref = hf_greedy(hf, p, new_tokens, pad_token_id=0, past_eos=False)
        # HF stops at EOS; up to there the tokens must be identical.
        assert got[: len(ref)] == ref
        assert len(ref) == new_tokens or ref[-1] == 2


def test_missing_weight_is_a_clear_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    make_hf_model("llama", tmp_path, seed=1)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(ModelConfig(path=str(tmp_path)))


@pytest.mark.slow
def test_max_model_len_beyond_the_model_is_rejected(hf_case: Any) -> None:
    _kind, _sharded, d, _hf, _loaded = hf_case
    with pytest.raises(ValueError, match="max_model_len"):
        load_model(ModelConfig(path=str(d), max_model_len=513))
    assert load_model(ModelConfig(path=str(d), max_model_len=100)).max_model_len == 100


def _config(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


def test_arch_from_hf_formats_and_errors() -> None:
    from mooncaked.engine.model import ModelArch

    old_style = ModelArch.from_hf(
        _config(
            rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 4.0}, eos_token_id=[5, 6]
        )
    )
    assert old_style.rope_theta == 500000.0
    assert old_style.rope_scaling is not None and old_style.rope_scaling.factor == 4.0
    assert old_style.head_dim == 4 and old_style.eos_token_ids == (5, 6)
    new_style = ModelArch.from_hf(
        _config(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    )
    assert new_style.rope_theta == 1e6 and new_style.rope_scaling is None
    with pytest.raises(ValueError, match="'gemma'"):
        ModelArch.from_hf(_config(model_type="gemma"))
    with pytest.raises(ValueError, match="'intermediate_size'"):
        ModelArch.from_hf(_config(intermediate_size=None))
    with pytest.raises(ValueError, match="'yarn'"):
        ModelArch.from_hf(_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="'low_freq_factor'"):
        ModelArch.from_hf(_config(rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    windowed = ModelArch.from_hf(_config(model_type="mistral", sliding_window=32))
    assert windowed.max_model_len == 32
