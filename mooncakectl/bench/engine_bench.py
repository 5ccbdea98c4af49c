"""The inputs of the engine benchmark (``tools/bench_engine.py``): its
trace-shaped workload, the precisions it measures and the llama.cpp file type
of each, and where the llama.cpp anchor (``tools/llamacpp_anchor.sh``) put
llama.cpp's own benchmark. Pure but for reading the anchor's file."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

from mooncakectl.bench.anchors import AnchorError, anchor_env

# Output lengths of the conversation trace (12,031 requests): its 64 quantiles
# at (i + 0.5) / 64. Drawing uniformly among them follows the trace's
# distribution: a mass of long answers and a tail of very short ones.
TRACE_OUTPUT_QUANTILES = (
    3, 3, 8, 11, 15, 20, 25, 29, 36, 45, 60, 78, 95, 112, 129, 146,
    168, 187, 203, 217, 230, 243, 257, 270, 280, 290, 301, 311, 319, 328, 337, 346,
    355, 363, 369, 377, 385, 393, 400, 407, 414, 422, 429, 438, 445, 453, 460, 467,
    476, 486, 496, 508, 519, 532, 544, 558, 574, 595, 618, 648, 683, 740, 849, 1249,
)  # fmt: skip
TRACE_MAX_OUTPUT = 2000

PRECISIONS = {
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "float16": ("float16", "none"),
    # The dtype a server gets by default: bf16 activations where the CPU has
    # bf16 instructions (the kernels' fast path), float32 elsewhere.
    "int8": ("auto", "int8"),
    "int4": ("auto", "int4"),
}


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def trace_output_lengths(n: int, max_len: int, rng: random.Random) -> list[int]:
    """``n`` lengths drawn from the trace's distribution, scaled so its longest is ``max_len``."""
    scale = max_len / TRACE_MAX_OUTPUT
    return [max(1, round(rng.choice(TRACE_OUTPUT_QUANTILES) * scale)) for _ in range(n)]


def make_workload(n: int, lo: int, hi: int, max_output_len: int, seed: int, vocab: int) -> Workload:
    rng = random.Random(seed)
    # Ids of ordinary tokens in any vocabulary this bench loads (the builtin's
    # printable bytes, a real model's common sub-words).
    top = min(vocab, 1000)
    prompts = [[rng.randrange(32, top) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return Workload(prompts, trace_output_lengths(n, max_output_len, rng))


# Our precision -> the llama.cpp file type that stores weights the same way.
LLAMACPP_TYPES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int8": "Q8_0",
    "int4": "Q4_0",
}


@dataclass(slots=True)
class LlamaCpp:
    """Where tools/llamacpp_anchor.sh put llama.cpp's benchmark and quantizer."""

    bench: Path
    quantize: Path
    models: Path
    version: str


def read_anchor(spec: str, script: Path | None = None) -> LlamaCpp:
    """``auto``: ask the anchor ``script`` (``tools/llamacpp_anchor.sh``) where
    it built llama.cpp; else the path of the anchor.env it wrote."""
    env = anchor_env(spec, script, flag="--llamacpp", missing="llama.cpp is not built")
    try:
        anchor = LlamaCpp(
            bench=Path(env["LLAMACPP_BENCH"]),
            quantize=Path(env["LLAMACPP_QUANTIZE"]),
            models=Path(env["LLAMACPP_ANCHOR_DIR"]) / "models",
            version=env.get("LLAMACPP_VERSION", "unknown"),
        )
    except KeyError as e:
        raise AnchorError(f"--llamacpp {spec}: the anchor file has no {e.args[0]}") from None
    for tool in (anchor.bench, anchor.quantize):
        if not os.access(tool, os.X_OK):
            raise AnchorError(f"--llamacpp {spec}: {tool} is not an executable; rebuild the anchor")
    return anchor
