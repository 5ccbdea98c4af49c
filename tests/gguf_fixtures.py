"""Small random GGUF files, written with ``gguf.GGUFWriter`` as llama.cpp's converter would.

A tiny random transformers model (Llama or Qwen2) is saved with every 2-D
weight in one tensor type (F32, F16, BF16, Q8_0, Q4_0 or Q4_1; quantized
with ``gguf.quants.quantize``), norms in F32, Llama's q/k rows permuted the
way llama.cpp stores them, and a byte-level BPE vocabulary (256 byte tokens,
a few merges, ChatML control tokens) with a chat template in the metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.hf_fixtures import perturb, tiny_config

# The 256 byte tokens in GPT-2's printable spelling, then merges, then control tokens.
MERGES = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("Ġ", "a"),
    ("o", "n"),
    ("e", "r"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġw", "or"),
    ("l", "d"),
    ("Ġwor", "ld"),
    ("H", "e"),
    ("l", "l"),
    ("He", "ll"),
    ("Hell", "o"),
    ("Ġ", "c"),
    ("a", "t"),
    ("Ġc", "at"),
    ("Ã", "©"),
]
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


def byte_spelling() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[int]]:
    tokens = byte_spelling() + ["".join(m) for m in MERGES] + CONTROL_TOKENS
    types = [1] * (len(tokens) - len(CONTROL_TOKENS)) + [3] * len(CONTROL_TOKENS)
    return tokens, types


VOCAB_SIZE = len(vocabulary()[0])
BOS_ID = VOCAB_SIZE - 2  # <|im_start|>
EOS_ID = VOCAB_SIZE - 1  # <|im_end|>


def make_hf(kind: str, seed: int) -> Any:
    """A small random transformers model with non-trivial norms and biases."""
    import transformers

    common = tiny_config(
        vocab_size=VOCAB_SIZE, rms_norm_eps=1e-5, bos_token_id=BOS_ID, eos_token_id=EOS_ID
    )
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
        )
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**common, rope_theta=1000.0, tie_word_embeddings=True)
        )
    else:
        raise ValueError(f"unknown kind {kind!r}")
    perturb(model, seed)
    return model.eval()


_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, N, rest
    return f"blk.{parts[2]}.{_LAYER[parts[3]]}"


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp's converter: each head's two rotary halves interleaved as pairs.
    rows = w.shape[0]
    return (
        w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def finish(w: Any) -> None:
    """Write out a ``gguf.GGUFWriter``'s header, metadata and tensors, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(path: Path, hf: Any, kind: str, tensor_type: str) -> Path:
    """Save ``hf`` as a GGUF file with 2-D weights in ``tensor_type``."""
    import gguf

    cfg = hf.config
    qtype = gguf.GGMLQuantizationType[tensor_type]
    w = gguf.GGUFWriter(str(path), kind)
    w.add_name(f"tiny-{kind}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if kind == "llama":
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    tokens, types = vocabulary()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_pad_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    tied = bool(cfg.tie_word_embeddings)
    for name, p in hf.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        arr = p.detach().float().numpy().copy()
        if kind == "llama" and name.endswith("q_proj.weight"):
            arr = _permute(arr, cfg.num_attention_heads)
        elif kind == "llama" and name.endswith("k_proj.weight"):
            arr = _permute(arr, cfg.num_key_value_heads)
        if arr.ndim == 1:
            w.add_tensor(_gguf_name(name), arr.astype(np.float32))
        elif qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(arr, qtype))
        else:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    finish(w)
    return path


# A SentencePiece-style ("llama") vocabulary: <unk> <s> </s>, 256 byte
# tokens, then pieces whose scores rank the merges (longer pieces first).
SPM_PIECES = [
    "▁",
    "t",
    "h",
    "e",
    "c",
    "a",
    "w",
    "o",
    "r",
    "l",
    "d",
    "H",
    "i",
    "n",
    "▁t",
    "he",
    "▁the",
    "▁c",
    "at",
    "▁cat",
    "▁w",
    "or",
    "▁wor",
    "ld",
    "▁world",
    "He",
    "ll",
    "Hell",
    "Hello",
    "▁Hello",
    "in",
    "▁in",
]


def write_spm_gguf(path: Path, extra_tensors: tuple[str, ...] = ()) -> Path:
    """A tiny Llama GGUF (F32) whose vocabulary is SentencePiece-style, with scores, no merges.

    ``extra_tensors``: names of further (32,) tensors to store, for a file
    that holds more than the model has.
    """
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    scores = [0.0] * 259 + [
        -100.0 - i if len(p) == 1 else -float(i) for i, p in enumerate(SPM_PIECES)
    ]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_block_count(1)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    gen = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (len(tokens), 32),
        "output_norm.weight": (32,),
        "blk.0.attn_norm.weight": (32,),
        "blk.0.ffn_norm.weight": (32,),
        "blk.0.attn_q.weight": (32, 32),
        "blk.0.attn_k.weight": (32, 32),
        "blk.0.attn_v.weight": (32, 32),
        "blk.0.attn_output.weight": (32, 32),
        "blk.0.ffn_gate.weight": (64, 32),
        "blk.0.ffn_up.weight": (64, 32),
        "blk.0.ffn_down.weight": (32, 64),
    }
    shapes.update({name: (32,) for name in extra_tensors})
    for name, shape in shapes.items():
        w.add_tensor(name, gen.standard_normal(shape).astype(np.float32) * 0.1)
    finish(w)
    return path
