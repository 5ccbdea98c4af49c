"""Load a model: a local Hugging Face directory, a GGUF file, or the seeded builtin test model.

``builtin:tiny`` needs no download: its weights come from a CPU
``torch.Generator`` seeded with ``model.seed``, so every machine builds the
same model, and greedy output is reproducible across runs and nodes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from mooncaked.config import BUILTIN_PREFIX, ModelConfig, PipelineConfig
from mooncaked.engine.model import CausalLM, ModelArch
from mooncaked.engine.quant import (
    GemvPackedLinear,
    GemvTiming,
    PackTiming,
    dense_factory,
    linear_factory,
    pick_pack_hint,
    time_single_row_gemv,
)
from mooncaked.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from mooncaked.handoff import LayerSpan, split_layers

# Layers whose weights time the packed layouts: four of SmolLM2-135M's hold
# 52 MB in float32, more than a server CPU's last-level cache, as a step's do.
PACK_SAMPLE_LAYERS = 4
# Bytes of weights the one-row GEMV is timed on: a bandwidth-bound GEMV is
# measured only on weights that stream from memory, as a step's do (four
# SmolLM2 layers in bf16, 32 MB, sat in a 32 MB L3 and the GEMV's lead
# vanished: 1.05x against 1.5x on eight or sixteen layers).
GEMV_SAMPLE_BYTES = 128 << 20


@dataclass(slots=True)
class LoadedModel:
    model: CausalLM
    arch: ModelArch
    tokenizer: Tokenizer
    # Seeds block hashes: equal ids mean equal weights and tokenizer.
    model_id: str
    served_name: str
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    # model.quantization: "none", "int8" or "int4".
    quantization: str = "none"
    # How unquantized linears multiply: "dense" (F.linear) or "packed" (oneDNN).
    linear_kernel: str = "dense"
    # Packed: the rows oneDNN laid the weights out for, and what was timed
    # to pick it (empty when the config fixed it).
    packed_layout_rows: int = 0
    packed_layout_timings: list[PackTiming] = field(default_factory=list)
    # Packed: whether one-row steps take the native GEMV on a kept dense copy,
    # the bytes that copy costs, and what was timed to decide (None when the
    # config decided).
    single_row_gemv: bool = False
    gemv_extra_bytes: int = 0
    gemv_timing: GemvTiming | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device = {name!r} but no CUDA device is available")
    return dev


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# /proc/cpuinfo flags of instructions that compute on bfloat16 directly
# (x86: AVX512-BF16, AMX; Arm: the BF16 extension).
_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first processor's feature flags (x86 ``flags``, Arm ``Features``); empty if unknown."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text("utf-8", errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_has_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU has bfloat16 arithmetic instructions.

    Without them torch converts bf16 to fp32 in registers: weights are read
    at half the bytes but every matmul pays the conversion, which on small
    decode matmuls costs more than it saves (measured in tools/bench_engine.py).
    """
    if flags is None:
        # torch's own probes first (cpuinfo library), /proc/cpuinfo where they say no.
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        if any(getattr(torch.cpu, name, lambda: False)() for name in probes):
            return True
        flags = cpu_flags()
    return bool(flags & _BF16_CPU_FLAGS)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``model.dtype`` as a torch dtype. ``auto``: bfloat16 on CUDA; on the CPU,
    bfloat16 where it has bf16 instructions, float32 elsewhere."""
    if name == "auto":
        if device.type == "cpu" and not cpu_has_bf16():
            return torch.float32
        return torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[name]


def _max_model_len(config: ModelConfig, arch: ModelArch) -> int:
    limit = arch.max_model_len
    if config.max_model_len > 0:
        if config.max_model_len > limit:
            raise ValueError(
                f"model.max_model_len = {config.max_model_len} exceeds the model's limit "
                f"of {limit} positions"
            )
        return config.max_model_len
    return limit


def load_model(
    config: ModelConfig,
    progress: IO[str] | None = None,
    *,
    decodes: bool = True,
    pipeline: PipelineConfig | None = None,
) -> LoadedModel:
    """``progress``: where a progress bar goes (default stderr); drawn only on a terminal.
    ``decodes``: False for a node that only prefills, whose steps are never one
    row, so ``single_row_gemv = "auto"`` keeps no dense copy there.
    ``pipeline``: a stage of a pipelined prefill group loads only its layers."""
    stage = _StageOf(pipeline)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    kernel = config.linear_kernel
    if config.is_builtin and device.type == "cpu":
        # The builtin model is defined as float32 through F.linear: its greedy
        # output (random weights, near ties everywhere) is then the same on
        # every CPU, whatever instructions it has, unless asked otherwise.
        dtype = torch.float32 if config.dtype == "auto" else dtype
        kernel = "dense" if kernel == "auto" else kernel
    # Refused before minutes of loading, not after.
    linear_factory(config.quantization, device)
    packed = dense_factory(kernel, device, dtype)
    if config.is_builtin:
        loaded = _load_builtin(config, device, dtype, stage)
    elif config.path.endswith(".gguf"):
        loaded = _load_gguf(
            config, device, dtype, sys.stderr if progress is None else progress, stage
        )
    else:
        loaded = _load_hf_dir(config, device, dtype, stage)
    make = linear_factory(config.quantization, device)
    if make is not None:
        loaded.model.replace_linears(make)
        loaded.quantization = config.quantization
    elif packed is not None:
        rows = config.packed_layout_rows
        if rows == 0:
            rows, loaded.packed_layout_timings = pick_pack_hint(
                loaded.model.dense_weights(PACK_SAMPLE_LAYERS)
            )
        if config.single_row_gemv == "auto" and not decodes:
            loaded.single_row_gemv = False
        elif config.single_row_gemv == "auto":
            loaded.gemv_timing = time_single_row_gemv(_gemv_sample(loaded.model), rows)
            loaded.single_row_gemv = loaded.gemv_timing.worth_it()
        else:
            loaded.single_row_gemv = config.single_row_gemv == "on"
        make_packed = GemvPackedLinear if loaded.single_row_gemv else packed
        loaded.model.replace_linears(functools.partial(make_packed, batch_hint=rows))
        loaded.linear_kernel = "packed"
        loaded.packed_layout_rows = rows
        if loaded.single_row_gemv:
            loaded.gemv_extra_bytes = gemv_copy_bytes(loaded.model)
    loaded.model_id += precision_tag(dtype, config.quantization)
    return loaded


def gemv_copy_bytes(model: CausalLM) -> int:
    """Bytes of the dense copies the GEMV layers keep beside their packed weights.

    A tied head's copy is the embedding itself, which stays anyway."""
    embed = model.model.embed_tokens
    embedding = embed.weight.untyped_storage().data_ptr() if embed is not None else None
    storages = {
        m.weight.untyped_storage().data_ptr(): m.weight.untyped_storage().nbytes()
        for m in model.projections()
        if isinstance(m, GemvPackedLinear)
    }
    return sum(n for ptr, n in storages.items() if ptr != embedding)


def _gemv_sample(model: CausalLM) -> list[torch.Tensor]:
    per_layer = sum(w.nbytes for w in model.dense_weights(1))
    layers = min(len(model.model.layers), max(1, -(-GEMV_SAMPLE_BYTES // per_layer)))
    return model.dense_weights(layers)


def precision_tag(dtype: torch.dtype, quantization: str = "none") -> str:
    """Suffix of the model id for a precision other than float32 dense weights.

    The model id seeds block hashes, which key every cache tier and the
    cluster index: K/V computed in another precision are other bytes (and
    another block size) and must never be served for the float32 model's.
    """
    tags = [] if dtype == torch.float32 else [str(dtype).removeprefix("torch.")]
    if quantization != "none":
        tags.append(quantization)
    return "".join("#" + t for t in tags)


@contextmanager
def load_progress(stream: IO[str], total: int, label: str) -> Iterator[Callable[[], None]]:
    """Yields ``advance()``; draws a bar on ``stream`` only where it is a terminal
    (a daemon's log file gets no escape codes)."""
    if not stream.isatty():
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    console = Console(file=stream, force_terminal=True)
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=total)
        yield lambda: bar.advance(task)


class _StageOf:
    """The layers a node loads: all of them, or its stage's of a pipelined group."""

    def __init__(self, pipeline: PipelineConfig | None) -> None:
        self._pipeline = pipeline if pipeline is not None and pipeline.enabled else None

    def span(self, arch: ModelArch) -> LayerSpan:
        p = self._pipeline
        if p is None:
            return LayerSpan(0, arch.num_layers, arch.num_layers)
        try:
            return split_layers(arch.num_layers, p.num_stages, p.split)[p.stage]
        except ValueError as exc:
            raise ValueError(f"pipeline.split: {exc}") from None


def _empty_model(
    arch: ModelArch, device: torch.device, dtype: torch.dtype, span: LayerSpan | None = None
) -> CausalLM:
    # Built without allocating, given storage of the final dtype on the final
    # device once (no fp32 copy on the way), then filled by the caller.
    with torch.device("meta"):
        model = CausalLM(arch, span)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    return model


# ---------------------------------------------------------------------------
# builtin:tiny

BUILTIN_NAMES = ("tiny",)


def builtin_arch(name: str) -> ModelArch:
    if name != "tiny":
        raise ValueError(
            f"unknown builtin model {BUILTIN_PREFIX}{name}; known: "
            f"{[BUILTIN_PREFIX + n for n in BUILTIN_NAMES]}"
        )
    tok = ByteTokenizer(384)
    return ModelArch(
        vocab_size=384,
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qkv_bias=False,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_ids=tok.eos_token_ids,
    )


def _unit_noise(shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """Zero-mean, unit-variance noise that is bit-identical on every CPU.

    ``torch.randn`` takes vectorized paths that differ between instruction
    sets (AVX2, AVX-512, none), so the same seed gave different weights on
    different nodes. Integers from the generator are exact everywhere, and
    the affine map to a uniform on [-sqrt(3), sqrt(3)] is exactly rounded.
    """
    ints = torch.randint(0, 1 << 24, shape, generator=gen, dtype=torch.int64)
    return (ints.to(torch.float32) + 0.5) * (2.0 * math.sqrt(3.0) / (1 << 24)) - math.sqrt(3.0)


def _builtin_weights(model: CausalLM, seed: int) -> None:
    """Fill ``model`` from a seeded CPU generator, in parameter-name order.

    Plain std-0.02 weights with unit norms give a residual stream that the
    token embedding dominates, and tied embeddings then make greedy decoding
    echo its last token forever. Instead: random norm gains (so the output
    head no longer favours the input token), fan-in scaled projections (each
    keeps its input's size), and sharper attention (q/k x4) so that a
    continuation depends on the whole context. Rows of special tokens,
    unused ids and non-printable bytes are shrunk: their logits stay small,
    so greedy output is printable ASCII, EOS is rarely sampled and requests
    run to max_tokens. The final norm's gain sets the logits' spread, small
    enough that temperature sampling is not just greedy.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name == "model.norm.weight":
            values = _unit_noise(param.shape, gen) * 0.25
        elif name.endswith("norm.weight"):
            values = _unit_noise(param.shape, gen)
        elif name == "model.embed_tokens.weight":
            values = _unit_noise(param.shape, gen)
            printable = torch.zeros(param.shape[0], dtype=torch.bool)
            printable[32:127] = True
            printable[ord("\n")] = True
            values[~printable] *= 0.05
        else:
            values = _unit_noise(param.shape, gen) / math.sqrt(param.shape[-1])
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                values *= 4.0
        param.data.copy_(values)


def _load_builtin(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, stage: _StageOf
) -> LoadedModel:
    name = config.path[len(BUILTIN_PREFIX) :]
    arch = builtin_arch(name)
    model = CausalLM(arch)
    # Drawn whole, in name order, then cut: a stage's weights are the whole
    # model's, as its checkpoint's would be.
    _builtin_weights(model, config.seed)
    span = stage.span(arch)
    if not span.whole:
        model.restrict(span)
    model = model.to(device=device, dtype=dtype).eval()
    model.fuse_projections()
    return LoadedModel(
        model=model,
        arch=arch,
        tokenizer=ByteTokenizer(arch.vocab_size),
        model_id=f"{config.path}@{config.seed}",
        served_name=config.served_name or config.path,
        device=device,
        dtype=dtype,
        max_model_len=_max_model_len(config, arch),
    )


# ---------------------------------------------------------------------------
# Hugging Face directory


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text("utf-8"))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _weight_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: has no weight_map")
        files = sorted({d / str(f) for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names weight files that are missing: {missing}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{d}: no *.safetensors weight files")
    return files


def _eos_ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


class _Weights:
    """A model's parameters filled by name from a checkpoint, and which came.

    A stage of a pipelined group holds some of the checkpoint's layers: the
    others' names are wanted by nobody here, and skipped unread."""

    def __init__(self, model: CausalLM) -> None:
        self._model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self._loaded: set[str] = set()
        self._unexpected: list[str] = []

    def wanted(self, name: str) -> bool:
        """Whether ``name`` is this model's to load (not another stage's)."""
        return self._model.local_name(name) is not None

    def expects(self, name: str) -> bool:
        """Whether the model has ``name``; one it lacks is noted for ``check``."""
        local = self._model.local_name(name)
        if local is None:
            return False
        if local in self.params:
            return True
        self._unexpected.append(name)
        return False

    def copy(self, name: str, tensor: torch.Tensor, where: str, source: str) -> None:
        name = self._model.local_name(name) or name
        param = self.params[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"{where} has shape {tuple(tensor.shape)}, {source} implies {tuple(param.shape)}"
            )
        param.copy_(tensor)
        self._loaded.add(name)

    def finish(self, arch: ModelArch, *, unexpected: str, missing: str) -> None:
        """Ready the model for serving; ValueError when the checkpoint held names
        the model lacks, or lacked some the model has (a tied lm_head shares the
        embedding's)."""
        if self._unexpected:
            raise ValueError(f"{unexpected}: {_shown(sorted(self._unexpected))}")
        tied = arch.tie_word_embeddings and self._model.lm_head is not None
        loaded = self._loaded | ({"lm_head.weight"} if tied else set())
        absent = sorted(set(self.params) - loaded)
        if absent:
            raise ValueError(f"{missing}: {_shown(absent)}")
        self._model.eval()
        self._model.fuse_projections()


def hf_model_id(d: Path) -> str:
    """The model id of a Hugging Face directory, before its precision tag: its
    name, config, weight files (names and sizes) and tokenizer. Another
    engine's KV connector that loads the same directory computes the same id
    (``integrations/``), so their blocks hash alike."""
    h = hashlib.sha256()
    h.update((d / "config.json").read_bytes())
    for f in _weight_files(d):
        h.update(f"{f.name}:{f.stat().st_size}\n".encode())
    h.update(hashlib.sha256((d / "tokenizer.json").read_bytes()).digest())
    return f"hf:{d.name}@{h.hexdigest()[:24]}"


def _load_hf_dir(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, stage: _StageOf
) -> LoadedModel:
    from safetensors import safe_open

    d = Path(config.path).expanduser()
    if not d.is_dir():
        raise ValueError(
            f"model.path {config.path!r} is neither builtin:<name>, a directory nor a .gguf file"
        )
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{d}: no config.json")
    hf_config = _read_json(cfg_path)
    arch = ModelArch.from_hf(hf_config)
    files = _weight_files(d)

    gen_cfg_path = d / "generation_config.json"
    extra_eos = list(arch.eos_token_ids)
    if gen_cfg_path.is_file():
        extra_eos += _eos_ids(_read_json(gen_cfg_path).get("eos_token_id"))
    tokenizer = HFTokenizer(d, extra_eos_token_ids=extra_eos)

    model = _empty_model(arch, device, dtype, stage.span(arch))
    weights = _Weights(model)
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for key in st.keys():
                    # Rotary inv_freq buffers of old exports are recomputed;
                    # anything else the model lacks means the config does not
                    # describe the checkpoint (e.g. q/k/v biases without
                    # attention_bias).
                    if key.endswith("rotary_emb.inv_freq") and key not in weights.params:
                        continue
                    if not weights.wanted(key):
                        continue  # another stage's layers
                    if weights.expects(key):
                        weights.copy(key, st.get_tensor(key), f"{f.name}: {key}", "the config")
    weights.finish(
        arch,
        unexpected=f"{d}: the safetensors files hold weights that config.json does not describe",
        missing=f"{d}: weights missing from the safetensors files",
    )

    return LoadedModel(
        model=model,
        arch=arch,
        tokenizer=tokenizer,
        model_id=hf_model_id(d),
        served_name=config.served_name or d.name,
        device=device,
        dtype=dtype,
        max_model_len=_max_model_len(config, arch),
    )


# ---------------------------------------------------------------------------
# GGUF file


def _load_gguf(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    progress: IO[str],
    stage: _StageOf,
) -> LoadedModel:
    from mooncaked.engine import gguf

    f = gguf.GGUFFile.open(config.path)
    arch = gguf.read_arch(f)
    tokenizer = gguf.read_tokenizer(f)
    model = _empty_model(arch, device, dtype, stage.span(arch))
    weights = _Weights(model)
    label = f"loading {f.path.name}"
    with torch.no_grad(), load_progress(progress, gguf.tensor_count(f), label) as advance:
        for name, tensor in gguf.iter_tensors(f, arch, wanted=weights.wanted):
            advance()
            if weights.expects(name):
                # Dequantized to fp32 on the CPU, cast once on the way to the device.
                weights.copy(name, tensor, f"{f.path.name}: {name}", "the metadata")
    weights.finish(
        arch,
        unexpected=f"{f.path}: holds tensors its metadata does not describe",
        missing=f"{f.path}: weights missing from the file",
    )
    return LoadedModel(
        model=model,
        arch=arch,
        tokenizer=tokenizer,
        model_id=f"gguf:{f.path.stem}@{f.identity()}",
        served_name=config.served_name or f.path.stem,
        device=device,
        dtype=dtype,
        max_model_len=_max_model_len(config, arch),
    )
