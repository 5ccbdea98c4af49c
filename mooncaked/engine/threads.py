"""Timing the step thread's OpenMP team on the model's own projections.

The daemon no longer picks its team size this way: a timing at start-up is
only as good as that moment's load, and on a busy two-core machine it kept
one thread for the daemon's life where two are faster once the machine is
quiet. The count now comes from the CPU topology (``process.cpu_threads``).
What stays is the timing itself: ``time_calls`` times the packed layouts
(engine/quant.py), and ``pick_threads`` times candidate team sizes where a
caller hands the engine some (``process.thread_candidates``). The
projections are most of a step's time on the CPU and touch no KV cache, so
timing them changes no state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mooncaked.engine.model import CausalLM

# Rows of the prefill-shaped measurement, and how the two shapes weigh: a
# served token costs one decode row; a prompt token a prefill row.
PREFILL_ROWS = 64
REPEATS = 3


@dataclass(frozen=True, slots=True)
class ThreadTiming:
    threads: int
    # Best of REPEATS, seconds: every projection once for one row, and for
    # PREFILL_ROWS rows.
    decode_s: float
    prefill_s: float

    @property
    def score(self) -> float:
        """Seconds per token, decode and prompt weighed alike."""
        return self.decode_s + self.prefill_s / PREFILL_ROWS


def _projections(model: CausalLM) -> list[tuple[Callable[[torch.Tensor], object], int]]:
    """Every projection of the model with its input width."""
    arch = model.arch
    out: list[tuple[Callable[[torch.Tensor], object], int]] = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv.active:
            out.append((attn.qkv.project, arch.hidden_size))
        else:
            out += [(attn.q_proj, arch.hidden_size), (attn.k_proj, arch.hidden_size)]
            out.append((attn.v_proj, arch.hidden_size))
        out.append((attn.o_proj, arch.num_heads * arch.head_dim))
        if mlp.gate_up.active:
            out.append((mlp.gate_up.project, arch.hidden_size))
        else:
            out += [(mlp.gate_proj, arch.hidden_size), (mlp.up_proj, arch.hidden_size)]
        out.append((mlp.down_proj, arch.intermediate_size))
    out.append((model.lm_head, arch.hidden_size))
    return out


def time_projections(model: CausalLM, rows: int, dtype: torch.dtype) -> float:
    """Best of REPEATS: seconds to run every projection once on ``rows`` rows."""
    return time_calls(_projections(model), rows, dtype)


def time_calls(
    calls: Sequence[tuple[Callable[[torch.Tensor], object], int]],
    rows: int,
    dtype: torch.dtype,
    repeats: int = REPEATS,
) -> float:
    """Best of ``repeats`` after a warm-up: seconds to run every ``(call, input width)``
    once on ``rows`` rows of fixed random inputs."""
    inputs = {
        width: torch.randn(rows, width, generator=torch.Generator().manual_seed(width)).to(dtype)
        for width in {w for _, w in calls}
    }
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            for call, width in calls:
                call(inputs[width])
            best = min(best, time.perf_counter() - t0)
    return best


def pick_threads(
    model: CausalLM,
    dtype: torch.dtype,
    candidates: Sequence[int],
    set_threads: Callable[[int], None],
) -> tuple[int, list[ThreadTiming]]:
    """The fastest of ``candidates`` and every timing; runs in the thread that computes.

    ``set_threads(n)`` changes that thread's team; it is left at the pick.
    """
    if not candidates:
        raise ValueError("pick_threads needs at least one candidate")
    timings: list[ThreadTiming] = []
    for n in candidates:
        set_threads(n)
        timings.append(
            ThreadTiming(
                threads=n,
                decode_s=time_projections(model, 1, dtype),
                prefill_s=time_projections(model, PREFILL_ROWS, dtype),
            )
        )
    best = min(timings, key=lambda t: t.score).threads
    set_threads(best)
    return best, timings
