"""A GGUF model written as a Hugging Face directory (``mooncakectl.bench.hf_export``,
what tools/bench_vllm.py gives vLLM) is the same model: transformers loads it
and computes our logits, its tokenizer encodes as ours, and our loader reads
back the very weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mooncakectl.bench import hf_export
from mooncaked.config import ModelConfig
from mooncaked.engine.loader import LoadedModel, load_model
from mooncaked.engine.model import ModelArch, RopeScaling
from tests.gguf_fixtures import BOS_ID, make_hf, write_gguf
from tests.parity import check_greedy_parity, greedy_logits, hf_logits

TEXTS = ["Hello world", " the cat", "naïve café 🙂", "<|im_start|>user\nHi<|im_end|>\n"]
MESSAGES = [{"role": "user", "content": "Hello world"}]


def _reference(path: Path | str) -> LoadedModel:
    return load_model(ModelConfig(path=str(path), dtype="float32", linear_kernel="dense"))


@pytest.fixture(scope="module", params=[("llama", "Q4_1"), ("qwen2", "Q8_0")], ids=str)
def exported(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    kind, tensor_type = request.param
    d = tmp_path_factory.mktemp(f"export_{kind}")
    gguf = write_gguf(d / f"tiny-{kind}.gguf", make_hf(kind, 3), kind, tensor_type)
    return gguf, hf_export.export_hf(gguf, d / "hf")


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, BOS_ID - 1, (n,), generator=g).tolist()


def test_transformers_computes_our_logits(exported: tuple[Path, Path]) -> None:
    import transformers

    gguf, out = exported
    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32
    ).eval()
    prompt = _prompt(0, 24)
    ours = greedy_logits(_reference(gguf), prompt, 8)
    ids = prompt + [int(t) for t in ours[len(prompt) - 1 :].argmax(-1)[:7]]
    theirs = hf_logits(hf, ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert check_greedy_parity(ours, theirs, 1e-4) == 0


def test_our_loader_reads_back_the_same_weights(exported: tuple[Path, Path]) -> None:
    gguf, out = exported
    a, b = _reference(gguf), _reference(out)
    assert a.arch == b.arch
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_the_tokenizer_encodes_and_templates_as_ours(exported: tuple[Path, Path]) -> None:
    import transformers

    gguf, out = exported
    ours = _reference(gguf).tokenizer
    theirs: Any = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in TEXTS:
        assert theirs(text).input_ids == ours.encode(text), text
    rendered = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == ours.apply_chat_template(MESSAGES)
    assert _reference(out).tokenizer.encode(TEXTS[0]) == ours.encode(TEXTS[0])


def test_an_export_is_kept_until_its_source_changes(exported: tuple[Path, Path]) -> None:
    gguf, out = exported
    assert hf_export.is_current(out, gguf, "float32")
    assert not hf_export.is_current(out, gguf, "bfloat16")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert hf_export.ensure_hf_export(gguf, out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    (out / hf_export.MANIFEST).write_text(json.dumps({"source": "elsewhere"}))
    assert not hf_export.is_current(out, gguf, "float32")


def test_a_bfloat16_export_holds_the_cast_weights(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "tiny.gguf", make_hf("llama", 5), "llama", "F32")
    out = hf_export.export_hf(gguf, tmp_path / "hf", "bfloat16")
    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))
    ref = _reference(gguf).model.state_dict()
    assert weights.keys() == ref.keys()
    for name, w in weights.items():
        assert w.dtype == torch.bfloat16 and torch.equal(w, ref[name].to(torch.bfloat16)), name
    with pytest.raises(ValueError, match="dtype"):
        hf_export.export_hf(gguf, tmp_path / "x", "int8")


def test_builtin_has_no_tokenizer_to_write(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        hf_export.export_hf("builtin:tiny", tmp_path / "hf")


@pytest.mark.parametrize(
    "scaling",
    [None, RopeScaling("linear", 2.0), RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)],
    ids=["none", "linear", "llama3"],
)
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_to_hf_reads_back_as_the_same_arch(model_type: str, scaling: RopeScaling | None) -> None:
    arch = ModelArch(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=5e5,
        rope_scaling=scaling,
        rms_norm_eps=1e-5,
        tie_word_embeddings=model_type == "qwen2",
        qkv_bias=model_type == "qwen2",
        o_bias=False,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_ids=(2, 3),
        sliding_window=1024 if model_type == "mistral" else None,
        model_type=model_type,
    )
    assert ModelArch.from_hf(arch.to_hf()) == arch
