"""Small random Hugging Face checkpoints on disk, for loader and parity tests.

Each directory is complete: config.json, safetensors weights (one file, or
shards with an index), generation_config.json, tokenizer.json (a WordLevel
tokenizer built with ``tokenizers``) and tokenizer_config.json with a chat
template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
VOCAB_SIZE = 128

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def plain_prompt(seed: int, n: int) -> list[int]:
    """``n`` seeded random token ids past 0..5 (unk, bos, eos, role words)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, VOCAB_SIZE, (n,), generator=g).tolist()


def word_vocab(vocab_size: int = VOCAB_SIZE) -> dict[str, int]:
    words = [UNK, BOS, EOS, "user:", "assistant:", "system:"]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    return {w: i for i, w in enumerate(words)}


def write_tokenizer(model_dir: Path, vocab_size: int = VOCAB_SIZE) -> None:
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    vocab = word_vocab(vocab_size)
    tok = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([BOS, EOS, UNK])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": BOS,
                "eos_token": {"content": EOS, "special": True},
                "unk_token": UNK,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )


def tiny_config(
    *, vocab_size: int, rms_norm_eps: float, bos_token_id: int, eos_token_id: int
) -> dict[str, Any]:
    """The transformers config fields every tiny test model shares: two layers
    of width 64, four query heads on two KV heads."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": rms_norm_eps,
        "initializer_range": 0.1,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }


def perturb(model: torch.nn.Module, seed: int) -> None:
    """HF initialises norms to 1 and biases to 0; make them random so loading them counts."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def make_hf_model(kind: str, model_dir: Path, *, sharded: bool = False, seed: int = 0) -> Any:
    """Save a small random ``kind`` model; return the HF model.

    llama: llama3 RoPE scaling, untied head; qwen2: q/k/v bias, tied
    embeddings; mistral: linear RoPE scaling.
    """
    import transformers

    common = tiny_config(vocab_size=VOCAB_SIZE, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    if kind == "llama":
        config = transformers.LlamaConfig(
            **common,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
        )
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**common, rope_theta=1000.0, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    elif kind == "mistral":
        config = transformers.MistralConfig(
            **common,
            rope_theta=5000.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            sliding_window=None,
            tie_word_embeddings=False,
        )
        model = transformers.MistralForCausalLM(config)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    perturb(model, seed)
    model.eval()
    model_dir.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {"max_shard_size": "60KB"} if sharded else {}
    model.save_pretrained(str(model_dir), **kwargs)
    write_tokenizer(model_dir)
    return model
