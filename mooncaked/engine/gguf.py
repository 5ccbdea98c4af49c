"""GGUF model files: architecture, weights and tokenizer from one file.

Parsing and dequantization are the ``gguf`` package's (the format's own
library); this module maps what it reads onto our model:

- metadata (``{arch}.block_count``, ``{arch}.attention.head_count``, ...) ->
  ``ModelArch``;
- tensors (``blk.N.attn_q.weight``, ...) -> float32 torch tensors under HF
  parameter names, in HF layout. llama.cpp's converter permutes the rows of
  Llama's q/k projections (interleaved rotary pairs instead of HF's two
  halves); ``_unpermute`` undoes it, as HF's own reader does;
- ``tokenizer.ggml.*`` -> a ``tokenizers`` tokenizer (byte-level BPE for
  ``gpt2`` vocabularies, SentencePiece-style BPE with byte fallback for
  ``llama`` ones), its special tokens and the chat template.

Only the architectures our model implements are accepted (Mistral files are
written with the ``llama`` architecture), and only the tensor types in
``SUPPORTED_TENSOR_TYPES``; anything else is refused by name.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from mooncaked.engine.model import ModelArch, RopeScaling
from mooncaked.engine.tokenizer import HFTokenizer

# The ``general.architecture`` values we load, and the model_type each becomes.
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.+)")

# Pre-tokenizer splits by ``tokenizer.ggml.pre``: the regexes each vocabulary's
# merges were learned with, applied in order before byte-level encoding.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
    # StarCoder's family splits every digit on its own first.
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
}


log = structlog.get_logger(__name__)


class GGUFError(ValueError):
    """The file is not a GGUF model this server can load; the message says why."""


@dataclass(slots=True)
class GGUFFile:
    """An opened GGUF file: its scalar metadata and its tensors (memory-mapped)."""

    path: Path
    reader: Any  # gguf.GGUFReader
    architecture: str

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        import gguf

        p = Path(path).expanduser()
        if not p.is_file():
            raise GGUFError(f"{p}: no such GGUF file")
        try:
            reader = gguf.GGUFReader(str(p), "r")
        except (ValueError, OSError) as exc:
            raise GGUFError(f"{p}: not a readable GGUF file: {exc}") from None
        f = cls(p, reader, "")
        arch = f.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{p}: no general.architecture in its metadata")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(
                f"{p}: architecture {arch!r} is not supported; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)} (Mistral files use 'llama')"
            )
        f.architecture = arch
        return f

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return value

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{suffix}", default)

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]

    def identity(self) -> str:
        """A content hash that is cheap for multi-GB files.

        The header (metadata, tensor names, types, shapes and offsets) in full,
        plus the file size and 16 samples of 64 KiB spread over the tensor
        data: two different files of the same model differ in one of them.
        """
        h = hashlib.sha256()
        size = self.path.stat().st_size
        data_offset = int(self.reader.data_offset)
        h.update(f"{size}:{data_offset}\n".encode())
        with open(self.path, "rb") as fh:
            h.update(fh.read(data_offset))
            span = max(size - data_offset, 1)
            for i in range(16):
                fh.seek(data_offset + span * i // 16)
                h.update(fh.read(64 * 1024))
        return h.hexdigest()[:24]


def read_arch(f: GGUFFile) -> ModelArch:
    """``ModelArch`` from the file's metadata and the tensors it holds."""
    names = set(f.tensor_names())
    hidden = int(f.need(f"{f.architecture}.embedding_length"))
    num_heads = int(f.need(f"{f.architecture}.attention.head_count"))
    head_dim = f.arch_key("attention.key_length") or f.arch_key("rope.dimension_count")
    rope_type = f.arch_key("rope.scaling.type")
    scaling: RopeScaling | None = None
    if rope_type == "linear":
        scaling = RopeScaling("linear", float(f.need(f"{f.architecture}.rope.scaling.factor")))
    elif rope_type not in (None, "none"):
        raise GGUFError(
            f"{f.path}: RoPE scaling {rope_type!r} is not supported; supported: none, linear"
        )
    if "rope_freqs.weight" in names:
        # Llama 3.1+ files carry their RoPE frequency factors as a tensor
        # instead of the parameters HF's llama3 scaling needs.
        raise GGUFError(
            f"{f.path}: per-frequency RoPE factors (tensor rope_freqs.weight, Llama 3.1 "
            f"scaling) are not supported"
        )
    embed = next((t for t in f.reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFError(f"{f.path}: no token_embd.weight tensor")
    # ne[1] of the embedding: the number of rows, whatever the metadata says.
    vocab_size = int(embed.shape[1])
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = f.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    bos = f.get("tokenizer.ggml.bos_token_id")
    qkv_bias = "blk.0.attn_q.bias" in names
    return ModelArch(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(f.need(f"{f.architecture}.feed_forward_length")),
        num_layers=int(f.need(f"{f.architecture}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(f.arch_key("attention.head_count_kv") or num_heads),
        head_dim=int(head_dim or hidden // num_heads),
        rope_theta=float(f.arch_key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(f.need(f"{f.architecture}.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias=qkv_bias,
        o_bias="blk.0.attn_output.bias" in names,
        max_position_embeddings=int(f.need(f"{f.architecture}.context_length")),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
        model_type=SUPPORTED_ARCHITECTURES[f.architecture],
    )


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor; None for one the model has no use for."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _BLOCK_NAME.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_TENSORS:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}"


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, pairs (x0, x1), ... back to two halves."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def tensor_count(f: GGUFFile) -> int:
    return len(f.reader.tensors)


def iter_tensors(
    f: GGUFFile, arch: ModelArch, wanted: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every tensor of the file, in file order
    (those ``wanted(hf_name)`` says yes to: a pipeline stage's layers; the rest
    are not dequantized at all).

    A tensor our model has no place for, or of a type we do not dequantize,
    is refused by name before anything is read: loading without it would
    serve a different model.
    """
    import gguf

    unknown = [t.name for t in f.reader.tensors if hf_name(t.name) is None]
    if unknown:
        shown = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        raise GGUFError(f"{f.path}: holds tensors a {f.architecture} model does not have: {shown}")
    unsupported = sorted(
        {
            t.tensor_type.name
            for t in f.reader.tensors
            if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES
        }
    )
    if unsupported:
        raise GGUFError(
            f"{f.path}: tensor types {unsupported} are not supported; supported: "
            f"{list(SUPPORTED_TENSOR_TYPES)}"
        )
    permute = f.architecture == "llama"
    for t in f.reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise RuntimeError(f"{t.name} passed the name check but has no HF name")
        if wanted is not None and not wanted(name):
            continue
        # ne is innermost-first; numpy and torch want outermost-first.
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if not values.flags.writeable:
            # F32 tensors come back as views of the read-only memory map.
            values = values.copy()
        tensor = torch.from_numpy(values).reshape(shape)
        if permute and t.name.endswith("attn_q.weight"):
            tensor = _unpermute(tensor, arch.num_heads)
        elif permute and t.name.endswith("attn_k.weight"):
            tensor = _unpermute(tensor, arch.num_kv_heads)
        yield name, tensor


# ---------------------------------------------------------------------------
# Tokenizer


def _byte_level_bpe(tokens: list[str], merges: list[tuple[str, str]], pre: str) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=False))
    splits = PRE_TOKENIZER_SPLITS.get(pre, PRE_TOKENIZER_SPLITS["default"])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into
    two tokens, ranked by the merged token's score (best first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, tuple[str, str]]] = []
    for token, idx in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[idx], vocab[left], vocab[right], (left, right)))
    ranked.sort()
    return [pair for *_, pair in ranked]


def _sentencepiece_bpe(
    tokens: list[str],
    merges: list[tuple[str, str]],
    scores: list[float] | None,
    unk: str | None,
    add_space_prefix: bool,
) -> Any:
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    if not merges:
        if scores is None:
            raise GGUFError("a llama vocabulary needs tokenizer.ggml.merges or .scores")
        merges = _sentencepiece_merges(tokens, scores)
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    tok = Tokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # SentencePiece: spaces are U+2581, and the text gets one in front.
    steps = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decode)
    return tok


def read_tokenizer(f: GGUFFile) -> HFTokenizer:
    """The tokenizer the file's vocabulary describes, with its special tokens and chat template."""
    from tokenizers import AddedToken

    model = f.need("tokenizer.ggml.model")
    tokens = [str(t) for t in f.need("tokenizer.ggml.tokens")]
    merges = [tuple(m.split(" ", 1)) for m in f.get("tokenizer.ggml.merges") or []]
    if any(len(m) != 2 for m in merges):
        raise GGUFError(f"{f.path}: tokenizer.ggml.merges holds an entry that is not 'a b'")
    pairs = [(m[0], m[1]) for m in merges]
    token_types = list(f.get("tokenizer.ggml.token_type") or [])

    def special(key: str) -> str | None:
        idx = f.get(f"tokenizer.ggml.{key}")
        if idx is None or not 0 <= int(idx) < len(tokens):
            return None
        return tokens[int(idx)]

    if model == "gpt2":
        pre = str(f.get("tokenizer.ggml.pre", "default"))
        if pre not in PRE_TOKENIZER_SPLITS:
            # Most byte-level vocabularies split close to GPT-2; say so, since
            # text with digits or odd whitespace may tokenize differently.
            log.warning("gguf.unknown_pre_tokenizer", pre=pre, using="default", path=str(f.path))
        tok = _byte_level_bpe(tokens, pairs, pre)
        add_bos_default = False
    elif model == "llama":
        scores = f.get("tokenizer.ggml.scores")
        tok = _sentencepiece_bpe(
            tokens,
            pairs,
            [float(s) for s in scores] if scores is not None else None,
            special("unknown_token_id"),
            bool(f.get("tokenizer.ggml.add_space_prefix", True)),
        )
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        add_bos_default = True
    else:
        raise GGUFError(
            f"{f.path}: tokenizer model {model!r} is not supported; supported: gpt2, llama"
        )
    # Control tokens (<|im_start|>, </s>) and user-defined ones (<think>) are
    # matched whole in text, as llama.cpp does; control ones are special and
    # dropped by decode(skip_special_tokens=True).
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, token_types, strict=False)
        if kind == _TOKEN_CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, token_types, strict=False)
        if kind == _TOKEN_USER_DEFINED
    ]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFError(f"{f.path}: tokenizer.ggml.tokens holds the same token twice")

    template = f.get("tokenizer.chat_template")
    return HFTokenizer.from_parts(
        tok,
        bos_token=special("bos_token_id"),
        eos_token=special("eos_token_id"),
        unk_token=special("unknown_token_id"),
        pad_token=special("padding_token_id"),
        add_bos=bool(f.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        chat_template=template if isinstance(template, str) else None,
        extra_eos_token_ids=[
            int(v)
            for v in (f.get("tokenizer.ggml.eot_token_id"), f.get("tokenizer.ggml.eom_token_id"))
            if v is not None
        ],
    )
