"""Llama-family decoder (Llama 2/3, Qwen2, Mistral) over a paged KV cache.

Parameter names match Hugging Face's, so a safetensors checkpoint loads by
name. The forward pass takes a flat batch of tokens from many sequences (the
runner's step), writes their K/V into the paged cache and returns hidden
states; logits are computed separately, only where the runner samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mooncaked.engine.attention import AttentionMetadata, PagedKV, paged_attention
from mooncaked.handoff import LayerSpan

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
# The transformers class of each, for the configs ModelArch.to_hf writes.
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling; ``rope_type`` is "linear" or "llama3"."""

    rope_type: str
    factor: float
    # llama3 only.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Llama's attention_bias also puts a bias on o_proj; Qwen2's q/k/v bias does not.
    o_bias: bool = False
    # Set when the checkpoint uses sliding-window attention: this model attends
    # to the full context, which is only exact up to the window.
    sliding_window: int | None = None
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def max_model_len(self) -> int:
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelArch:
        """Build from a Hugging Face ``config.json`` dict (old and 5.x RoPE formats)."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {list(SUPPORTED_MODEL_TYPES)}"
            )

        def need(key: str) -> Any:
            if config.get(key) is None:
                raise ValueError(f"config.json ({model_type}) is missing the key {key!r}")
            return config[key]

        hidden = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        if config.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias=true is not supported")
        hidden_act = config.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"config.json: hidden_act {hidden_act!r} is not supported (silu only)")

        # transformers 5.x writes rope_parameters (with rope_theta inside);
        # older checkpoints have rope_theta at top level and rope_scaling.
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r}; supported: "
                f"{list(SUPPORTED_ROPE_TYPES)}"
            )
        scaling: RopeScaling | None = None
        if rope_type == "linear":
            scaling = RopeScaling("linear", float(_rope_key(rope, "factor")))
        elif rope_type == "llama3":
            scaling = RopeScaling(
                "llama3",
                float(_rope_key(rope, "factor")),
                float(_rope_key(rope, "low_freq_factor")),
                float(_rope_key(rope, "high_freq_factor")),
                int(_rope_key(rope, "original_max_position_embeddings")),
            )

        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
            window = config.get("sliding_window") if config.get("use_sliding_window") else None
        else:
            qkv_bias = o_bias = bool(config.get("attention_bias", False))
            window = config.get("sliding_window") if model_type == "mistral" else None

        eos = config.get("eos_token_id")
        eos_ids = (
            tuple(int(e) for e in eos)
            if isinstance(eos, list)
            else (() if eos is None else (int(eos),))
        )
        bos = config.get("bos_token_id")
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            max_position_embeddings=int(need("max_position_embeddings")),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            sliding_window=int(window) if window else None,
            model_type=model_type,
        )

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict that ``from_hf`` (and transformers)
        reads back as this architecture."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        s = self.rope_scaling
        if s is not None:
            rope |= {"rope_type": s.rope_type, "factor": s.factor}
            if s.rope_type == "llama3":
                rope |= {
                    "low_freq_factor": s.low_freq_factor,
                    "high_freq_factor": s.high_freq_factor,
                    "original_max_position_embeddings": s.original_max_position_embeddings,
                }
        config: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
        }
        if self.model_type == "qwen2":
            config["use_sliding_window"] = self.sliding_window is not None
            if self.sliding_window is not None:
                config["sliding_window"] = self.sliding_window
        else:
            config["attention_bias"] = self.qkv_bias
            if self.model_type == "mistral":
                config["sliding_window"] = self.sliding_window
        return config


def _rope_key(rope: dict[str, Any], key: str) -> Any:
    if rope.get(key) is None:
        raise ValueError(
            f"config.json: rope_scaling of type {rope.get('rope_type')!r} needs {key!r}"
        )
    return rope[key]


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """Inverse frequencies in fp32 on CPU, computed exactly as transformers does."""
    dim = arch.head_dim
    # On the CPU explicitly: the model may be built under a meta-device context.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (arch.rope_theta**exponents)
    s = arch.rope_scaling
    if s is None:
        return inv_freq
    if s.rope_type == "linear":
        return inv_freq / s.factor
    # llama3: long wavelengths are divided by factor, short ones kept, the
    # band between interpolated smoothly.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' arithmetic: normalize in float32, round to the input's
        # dtype, then scale. rms_norm computes a reduced-precision input in
        # float32 and rounds once, the same bits as casting around it, without
        # the two casts (a decode step runs 2 norms per layer).
        return self.weight * F.rms_norm(x, self.weight.shape, eps=self.eps)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin``, the same bits in four
    ops instead of seven: rotate_half(x) (the two halves of a head swapped,
    the new first half negated) is a roll by half a head, the negation
    carried by ``signed_sin`` (see ``CausalLM.rope``). Not addcmul: its fused
    multiply-add rounds once where transformers rounds twice."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class _FusedLinear:
    """Several projections of the same input as one matmul.

    ``fuse`` concatenates the layers' weights once and re-points each layer's
    parameters at its rows of the fused tensor, so memory is not doubled and
    the HF parameter names still load (a copy into a layer's weight writes
    the fused tensor). Small-batch decode on CPU is dominated by per-op
    overhead: three (q, k, v) or two (gate, up) GEMMs become one.

    ``replace`` swaps the matmul for another module of the same weight (a
    quantized one); the dense weight is then dropped.
    """

    __slots__ = ("bias", "linear", "sizes", "weight")

    def __init__(self) -> None:
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.linear: nn.Module | None = None
        self.sizes: list[int] = []

    @property
    def active(self) -> bool:
        return self.weight is not None or self.linear is not None

    def fuse(self, layers: list[nn.Linear]) -> None:
        with torch.no_grad():
            weight = torch.cat([layer.weight for layer in layers])
            has_bias = [layer.bias is not None for layer in layers]
            bias = torch.cat([layer.bias for layer in layers]) if all(has_bias) else None
            if any(has_bias) and bias is None:
                return  # mixed biases: keep the separate matmuls
            lo = 0
            for layer in layers:
                hi = lo + layer.weight.shape[0]
                layer.weight.data = weight[lo:hi]
                if bias is not None:
                    layer.bias.data = bias[lo:hi]
                lo = hi
        self.weight, self.bias = weight, bias
        self.sizes = [layer.weight.shape[0] for layer in layers]

    def replace(self, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]) -> None:
        if self.weight is None:
            raise RuntimeError("fused projection replaced before fuse()")
        self.linear = make(self.weight, self.bias)
        self.weight = self.bias = None

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The fused output, the layers' columns side by side in fuse() order."""
        if self.linear is not None:
            return self.linear(x)
        if self.weight is None:
            raise RuntimeError("fused projection used before fuse()")
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.project(x).split(self.sizes, dim=-1)


# (cos, signed sin) of the step's positions, [T, 1, head_dim] each: the
# rotary embedding every layer applies to q and k. The sin's first half is
# negated, which turns rotate_half into a roll (``_apply_rope``).
Rope = tuple[torch.Tensor, torch.Tensor]
# One layer's (K, V) cache, [num_blocks, block_size, kv_heads, head_dim] each.
LayerCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_proj = nn.Linear(
            arch.hidden_size, arch.num_heads * arch.head_dim, bias=arch.qkv_bias
        )
        self.k_proj = nn.Linear(
            arch.hidden_size, arch.num_kv_heads * arch.head_dim, bias=arch.qkv_bias
        )
        self.v_proj = nn.Linear(
            arch.hidden_size, arch.num_kv_heads * arch.head_dim, bias=arch.qkv_bias
        )
        self.o_proj = nn.Linear(arch.num_heads * arch.head_dim, arch.hidden_size, bias=arch.o_bias)
        self.qkv = _FusedLinear()

    def fuse(self) -> None:
        self.qkv.fuse([self.q_proj, self.k_proj, self.v_proj])

    def forward(
        self, x: torch.Tensor, rope: Rope, kv_cache: LayerCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(x, rope)
        out = paged_attention(q, PagedKV(k, v, *kv_cache), meta)
        return self.project_out(out)

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """[T, heads, head_dim] attention output -> [T, hidden]."""
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))

    def project_qkv(
        self, x: torch.Tensor, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D] of ``x``, q and k rotated: what
        attention takes (here, or on a memory node)."""
        t = x.shape[0]
        cos, sin = rope
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv.active:
            # Fused: q and k are adjacent columns of one output, rotated in one
            # pass (the same elementwise arithmetic, half the ops per layer).
            qkv = self.qkv.project(x)
            qk = qkv[:, : (h + kvh) * d].view(t, h + kvh, d)
            qk = _apply_rope(qk, cos, sin)
            q, k = qk[:, :h], qk[:, h:]
            v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
        else:
            q = self.q_proj(x).view(t, h, d)
            k = self.k_proj(x).view(t, kvh, d)
            v = self.v_proj(x).view(t, kvh, d)
            q = _apply_rope(q, cos, sin)
            k = _apply_rope(k, cos, sin)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.gate_up = _FusedLinear()

    def fuse(self) -> None:
        self.gate_up.fuse([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up.active:
            gate, up = self.gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: Rope, kv_cache: LayerCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, arch: ModelArch, span: LayerSpan) -> None:
        super().__init__()
        # A stage without the embedding takes hidden states in; the last
        # stage of a tied model keeps it for its head.
        self.embed_tokens: nn.Embedding | None = (
            nn.Embedding(arch.vocab_size, arch.hidden_size)
            if span.first or (span.last and arch.tie_word_embeddings)
            else None
        )
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(span.count))
        self.norm: RMSNorm | None = (
            RMSNorm(arch.hidden_size, arch.rms_norm_eps) if span.last else None
        )


class CausalLM(nn.Module):
    """``model.*`` + ``lm_head``: the HF ``*ForCausalLM`` parameter layout.

    Built over a ``LayerSpan`` (a stage of a pipelined prefill group), it
    holds only those layers, as ``model.layers.0`` on: ``local_name`` maps
    a checkpoint's names onto them. A stage that is not the first takes
    hidden states in, and one that is not the last gives its residual
    stream out (no final norm, no head).
    """

    def __init__(self, arch: ModelArch, span: LayerSpan | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.span = span if span is not None else LayerSpan(0, arch.num_layers, arch.num_layers)
        self.model = DecoderModel(arch, self.span)
        self.lm_head: nn.Module | None = (
            nn.Linear(arch.hidden_size, arch.vocab_size, bias=False) if self.span.last else None
        )
        self.tie_weights()
        # A plain attribute, not a buffer: it survives construction on the meta
        # device and is never part of a checkpoint.
        self._inv_freq_cpu = rope_inv_freq(arch)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def fuse_projections(self) -> None:
        """Call once the weights are loaded, on their final device and dtype."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def replace_linears(
        self, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]
    ) -> None:
        """Every projection and the output head become ``make(weight, bias)``.

        Call after ``fuse_projections``. The dense layers go: once replaced,
        the HF-named parameters of q/k/v and gate/up are no longer needed
        (they only gave the checkpoint's names a place to load into), and
        keeping them would keep the dense weights in memory. The embedding
        stays dense; a tied head gets its own replaced copy.
        """
        with torch.no_grad():
            for layer in self.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                for fused, names in (
                    (attn.qkv, ("q_proj", "k_proj", "v_proj")),
                    (mlp.gate_up, ("gate_proj", "up_proj")),
                ):
                    if not fused.active:
                        raise RuntimeError("replace_linears() needs fuse_projections() first")
                    fused.replace(make)
                    owner = attn if fused is attn.qkv else mlp
                    for name in names:
                        delattr(owner, name)
                attn.o_proj = make(attn.o_proj.weight, attn.o_proj.bias)
                mlp.down_proj = make(mlp.down_proj.weight, None)
            if self.lm_head is not None:
                self.lm_head = make(self.lm_head.weight, None)

    def projections(self) -> list[nn.Module]:
        """Every projection's module and the head, fused ones included (a fused
        projection's module is not a submodule: ``modules()`` misses it). A
        fused projection still dense has no module and is not listed."""
        out: list[nn.Module] = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for fused, parts in (
                (attn.qkv, ("q_proj", "k_proj", "v_proj")),
                (mlp.gate_up, ("gate_proj", "up_proj")),
            ):
                owner = attn if fused is attn.qkv else mlp
                if fused.linear is not None:
                    out.append(fused.linear)
                elif not fused.active:
                    out += [getattr(owner, name) for name in parts]
            out += [attn.o_proj, mlp.down_proj]
        if self.lm_head is not None:
            out.append(self.lm_head)
        return out

    def dense_weights(self, layers: int) -> list[torch.Tensor]:
        """The projection weights of the first ``layers`` layers, fused where fused."""
        out: list[torch.Tensor] = []
        for layer in self.model.layers[:layers]:
            attn, mlp = layer.self_attn, layer.mlp
            for fused, parts in (
                (attn.qkv, (attn.q_proj, attn.k_proj, attn.v_proj)),
                (mlp.gate_up, (mlp.gate_proj, mlp.up_proj)),
            ):
                if fused.weight is not None:
                    out.append(fused.weight)
                else:
                    out += [p.weight for p in parts]
            out += [attn.o_proj.weight, mlp.down_proj.weight]
        return out

    def local_name(self, name: str) -> str | None:
        """A checkpoint's parameter name as this model holds it; None for a
        parameter of layers (or ends) another stage holds."""
        span = self.span
        if span.whole:
            return name
        prefix = "model.layers."
        if name.startswith(prefix):
            index, dot, rest = name[len(prefix) :].partition(".")
            if not dot or not index.isdigit():
                return name
            i = int(index)
            return f"{prefix}{i - span.lo}.{rest}" if span.lo <= i < span.hi else None
        if name.startswith("model.embed_tokens."):
            return name if self.model.embed_tokens is not None else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if span.last else None
        return name

    def restrict(self, span: LayerSpan) -> None:
        """Drop every layer and end outside ``span`` (of the whole model this is)."""
        if not self.span.whole:
            raise RuntimeError("restrict() takes a whole model")
        self.span = span
        self.model.layers = nn.ModuleList(self.model.layers[span.lo : span.hi])
        if not span.last:
            self.model.norm = None
            self.lm_head = None
        if not (span.first or (span.last and self.arch.tie_word_embeddings)):
            self.model.embed_tokens = None

    def tie_weights(self) -> None:
        embed = self.model.embed_tokens
        if self.arch.tie_word_embeddings and self.lm_head is not None and embed is not None:
            self.lm_head.weight = embed.weight

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_cpu.to(positions.device)
            self._inv_freq[positions.device] = inv_freq
        freqs = positions[:, None].float() * inv_freq[None, :]
        sin = freqs.sin()
        cos = torch.cat((freqs, freqs), dim=-1).cos()
        # [T, 1, head_dim]: broadcast over heads.
        return cos.to(dtype)[:, None, :], torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerCache],
        meta: AttentionMetadata,
        layer_done: Callable[[int], None] | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of flat tokens; writes their K/V into ``kv_caches``.

        ``layer_done(i)`` runs once layer ``i`` (of this model's) has written
        its K/V, so they can leave the device while the next layers compute.
        ``hidden``: the stage before's output for these tokens, in place of
        ``input_ids`` (a stage after the first). A stage before the last
        returns its residual stream, unnormalized.
        """
        if hidden is not None:
            x = hidden
        elif self.model.embed_tokens is not None and self.span.first:
            x = self.model.embed_tokens(input_ids)
        else:
            raise RuntimeError("a stage after the first takes hidden states, not token ids")
        rope = self.rope(positions, x.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            x = layer(x, rope, kv_cache, meta)
            if layer_done is not None:
                layer_done(i)
        norm = self.model.norm
        return norm(x) if norm is not None else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError(f"layers {self.span.lo}..{self.span.hi} hold no output head")
        return self.lm_head(hidden)
