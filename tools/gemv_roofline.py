"""How fast torch's one-row bf16 GEMV reads weights, against what the memory gives.

    python tools/gemv_roofline.py                 # SmolLM2-135M's shapes, 1 and 2 threads
    python tools/gemv_roofline.py --threads 1,2,4 --layers 30

A decode step of one sequence multiplies one row by every weight: it can go
no faster than the weights stream from memory. For each thread count this
prints the GEMV's read rate per weight shape (``F.linear`` with oneDNN off,
the path ``quant.GemvPackedLinear`` takes) and a float32 sum over as many
bytes (what the memory gives a simple streaming kernel), timed in turns,
best of ``--repeats``. A GEMV whose rate grows with threads as the sum's
does is bound by its arithmetic, not by memory.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query / 3 KV heads of 64,
# vocabulary 49,152 (q/k/v fused: 960 rows; gate/up fused: 3,072).
SHAPES = {
    "qkv 960x576": (960, 576),
    "o 576x576": (576, 576),
    "gate_up 3072x576": (3072, 576),
    "down 576x1536": (576, 1536),
    "head 49152x576": (49152, 576),
}


def best_of(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--layers", type=int, default=30, help="weights of each shape (the model's)")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    if not threads or min(threads) < 1 or args.layers < 1 or args.repeats < 1:
        p.error("--threads, --layers and --repeats must be positive")

    gen = torch.Generator().manual_seed(0)
    weights = {
        name: [
            torch.randn(n, k, generator=gen).to(torch.bfloat16)
            for _ in range(1 if n > 10_000 else args.layers)
        ]
        for name, (n, k) in SHAPES.items()
    }
    total = sum(w.numel() * 2 for ws in weights.values() for w in ws)
    flat = torch.randn(total // 4, generator=gen)
    print(f"torch {torch.__version__}, {total / 1e6:.0f} MB of bf16 weights")
    header = f"{'threads':>7}  {'f32 sum GB/s':>12}  " + "  ".join(f"{n:>17}" for n in SHAPES)
    print(header)
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        with torch.inference_mode():
            for t in threads:
                torch.set_num_threads(t)
                sum_s = best_of(flat.sum, args.repeats)
                rates = []
                for ws in weights.values():
                    x = torch.randn(1, ws[0].shape[1], generator=gen).to(torch.bfloat16)
                    s = best_of(lambda ws=ws, x=x: [F.linear(x, w) for w in ws], args.repeats)
                    rates.append(sum(w.numel() * 2 for w in ws) / s / 1e9)
                print(
                    f"{t:>7}  {flat.numel() * 4 / sum_s / 1e9:>12.1f}  "
                    + "  ".join(f"{r:>17.1f}" for r in rates)
                )
    finally:
        torch._C._set_mkldnn_enabled(was)


if __name__ == "__main__":
    main()
