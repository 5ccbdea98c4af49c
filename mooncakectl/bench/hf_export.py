"""A Hugging Face directory of a model mooncaked loads (a GGUF file, say), for
servers that read only that format: ``tools/bench_vllm.py`` gives vLLM the
weights mooncaked serves from the GGUF.

The weights go through mooncaked's own loader (dequantized to float32, q/k
rows in Hugging Face's order) and are written in ``dtype``. float32 keeps
them exact: each server then casts them to its compute dtype itself, and a
float32 -> bfloat16 cast rounds to nearest everywhere, so both compute with
the same numbers. The directory is complete for transformers and vLLM:
config.json, model.safetensors, generation_config.json, tokenizer.json and
tokenizer_config.json (chat template included).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mooncaked.config import ModelConfig
from mooncaked.engine.loader import load_model
from mooncaked.engine.tokenizer import HFTokenizer

# Written last: a directory without it is an export that did not finish.
MANIFEST = "mooncaked_export.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_dir(source: str | Path, cache: Path) -> Path:
    """``cache/hf-<source's stem>``: SmolLM2-135M-Instruct.Q4_1.gguf -> hf-SmolLM2-135M-Instruct.Q4_1."""
    return cache / f"hf-{Path(source).stem}"


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_current(out_dir: Path, source: str | Path, dtype: str) -> bool:
    """Whether ``out_dir`` holds a finished export of ``source`` (same path, size
    and modification time) in ``dtype``."""
    manifest = read_manifest(out_dir)
    return manifest is not None and manifest == _source_key(source, dtype)


def _source_key(source: str | Path, dtype: str) -> dict[str, Any]:
    path = Path(source).expanduser().resolve()
    st = path.stat()
    return {"source": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": dtype}


def export_hf(source: str | Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Write ``source`` (anything ``model.path`` takes with a Hugging Face
    tokenizer: a GGUF file, an HF directory) as a Hugging Face directory."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ValueError(f"export dtype {dtype!r}: give one of {list(DTYPES)}")
    loaded = load_model(
        ModelConfig(path=str(source), dtype="float32", linear_kernel="dense", device="cpu")
    )
    if not isinstance(loaded.tokenizer, HFTokenizer):
        raise ValueError(f"{source}: its tokenizer has no Hugging Face form to write")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)
    arch = loaded.arch
    tensors = {
        name: t.detach().to(DTYPES[dtype]).contiguous()
        for name, t in loaded.model.state_dict().items()
        # A tied head is the embedding: safetensors keeps no second copy.
        if not (arch.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = arch.to_hf() | {"dtype": dtype}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": arch.bos_token_id, "eos_token_id": list(arch.eos_token_ids)}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    loaded.tokenizer.save(out_dir)
    (out_dir / MANIFEST).write_text(json.dumps(_source_key(source, dtype), indent=2))
    return out_dir


def ensure_hf_export(source: str | Path, out_dir: Path, dtype: str = "float32") -> Path:
    """``out_dir``, exported from ``source`` unless it already is."""
    if is_current(out_dir, source, dtype):
        return out_dir
    return export_hf(source, out_dir, dtype)
