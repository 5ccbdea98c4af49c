"""Weight-only quantized linear layers for the CPU, on torch's packed-weight kernels.

Decode on the CPU is bound by reading the weights: every step reads each of
them once for a handful of rows. Storing them in 8 or 4 bits reads 4x or 8x
fewer bytes than float32. The kernels are torch's own:

- int8: one symmetric scale per output row; ``torch._weight_int8pack_mm``.
- int4: asymmetric groups along the input (a scale and a minimum per group
  of ``group_size`` weights); ``torch._convert_weight_to_int4pack_for_cpu``
  packs, ``torch._weight_int4pack_mm_for_cpu`` multiplies.

Both kernels have their fast paths for bfloat16 activations (float32 ones
take a generic path more than ten times slower), so activations enter them
in bfloat16 and leave in the model's dtype. For many rows at once (a prefill
chunk) the int8 weight is dequantized and multiplied densely instead: the
dense GEMM is compute-bound there, and one pass over the weight costs little
next to it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("none", "int8", "int4")

# Rows from which an int8 layer dequantizes and runs the dense matmul.
DENSE_ROWS = 32
# int4 group sizes the CPU kernel takes, preferred first: the larger group
# stores fewer scales, the smaller is used where the input size needs it.
INT4_GROUP_SIZES = (32,)
_ACT = torch.bfloat16


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with W as int8 rows times a per-row scale."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        # Symmetric, 127 levels each side: -128 is never used, so the
        # quantized row is exactly sign-symmetric.
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        qweight = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.out_features, self.in_features = w.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale)
        self.register_buffer("scale_act", scale.to(_ACT))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.qweight.to(dtype) * self.scale[:, None].to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        if rows.shape[0] >= DENSE_ROWS:
            y = F.linear(rows, self.dequantize(x.dtype), self.bias)
        else:
            y = torch._weight_int8pack_mm(rows.to(_ACT), self.qweight, self.scale_act).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def int4_group_size(in_features: int) -> int | None:
    for size in INT4_GROUP_SIZES:
        if in_features % size == 0:
            return size
    return None


class Int4Linear(nn.Module):
    """``y = x W^T + b`` with W in 4-bit groups: w = q * scale + minimum, q in 0..15."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        n, k = w.shape
        group = int4_group_size(k)
        if group is None:
            raise ValueError(
                f"int4 needs an input size divisible by one of {list(INT4_GROUP_SIZES)}, "
                f"a layer has {k}; use quantization = 'int8'"
            )
        grouped = w.view(n, k // group, group)
        lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = ((grouped - lo[..., None]) / scale[..., None]).round().clamp(0, 15)
        codes = q.to(torch.int32).view(n, k)
        # The kernel computes (q - 8) * scale + zero, so zero = minimum + 8 * scale;
        # its table is [groups, out_features, (scale, zero)].
        scales_zeros = torch.stack([scale, lo + 8.0 * scale], dim=-1).transpose(0, 1)
        self.out_features, self.in_features, self.group_size = n, k, group
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1))
        self.register_buffer("scales_zeros", scales_zeros.contiguous().to(_ACT))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x).to(_ACT)
        y = torch._weight_int4pack_mm_for_cpu(
            rows, self.packed, self.group_size, self.scales_zeros
        ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W reordered once into oneDNN's blocked layout.

    ``F.linear`` hands oneDNN (bf16) or MKL (fp32) a plain row-major weight.
    For the few rows of a decode step that costs about half the speed: oneDNN
    reorders the weight on every call, so a step reads each weight twice, and
    MKL's fp32 GEMV reaches about half the memory bandwidth on some CPUs.
    Reordering once at load, as torch's own inductor does for frozen CPU
    graphs, leaves one pass over the weight per step (measured in
    tools/bench_engine.py). The packed tensor is opaque (no storage): the
    dense weight is not kept.

    ``batch_hint`` is the row count oneDNN lays the weight out for; which
    layout is fastest depends on the CPU (``pick_pack_hint`` measures it).
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int = 1
    ) -> None:
        super().__init__()
        w = weight.detach().contiguous()
        self.out_features, self.in_features = w.shape
        self.batch_hint = batch_hint
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(w, batch_hint))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


# The layouts tried (oneDNN's batch hint), and the row counts each is timed
# at: a decode of one sequence, decode batches, a prefill chunk. The one-row
# layout, first, was chosen on a 2-core AVX-512 EPYC, where it favoured
# decode; on a 2-core AVX2 EPYC it was as fast as 16 or 64 for one row and
# 15-45% slower for 4-16 rows (eight SmolLM2-135M-shaped layers, 1 and 2 threads).
PACK_HINTS = (1, 16, 64)
PACK_ROWS = (1, 4, 16, 64)
# Best of five turns: with best of three, timed hint after hint, a noisy host
# picked the one-row layout in one load of four where the others picked 64.
PACK_REPEATS = 5


def time_interleaved(
    sides: Sequence[Sequence[tuple[Callable[[torch.Tensor], object], int]]],
    rows: int,
    dtype: torch.dtype,
    repeats: int,
) -> list[float]:
    """Best of ``repeats`` for each side, the sides run in turn within every
    repeat: a burst of other work on the host slows one turn of each side
    instead of every turn of one, so it cannot decide a comparison alone."""
    inputs = {
        width: torch.randn(rows, width, generator=torch.Generator().manual_seed(width)).to(dtype)
        for side in sides
        for width in {w for _, w in side}
    }
    best = [float("inf")] * len(sides)
    with torch.inference_mode():
        for turn in range(repeats + 1):  # the first is a warm-up
            for i, side in enumerate(sides):
                t0 = time.perf_counter()
                for call, width in side:
                    call(inputs[width])
                if turn:
                    best[i] = min(best[i], time.perf_counter() - t0)
    return best


# The first hint is kept unless another's worst ratio is this much lower:
# nodes of one kind of machine then pick alike despite timing noise (float32
# results differ in the last bits between layouts).
PACK_MARGIN = 0.10


@dataclass(frozen=True, slots=True)
class PackTiming:
    hint: int
    # Best of PACK_REPEATS, seconds, for every sample weight once at each of PACK_ROWS.
    seconds: tuple[float, ...]


def choose_pack_hint(timings: Sequence[PackTiming]) -> int:
    """The layout never far from the fastest at any row count.

    For each row count each hint's time is taken relative to the fastest
    hint's; the pick is the hint whose worst ratio is least, so no shape pays
    much for another's gain, and the first hint unless the pick beats it by
    ``PACK_MARGIN``.
    """
    if not timings:
        raise ValueError("choose_pack_hint needs at least one timing")
    fastest = [min(col) for col in zip(*(t.seconds for t in timings), strict=True)]

    def worst_ratio(t: PackTiming) -> float:
        return max(s / f for s, f in zip(t.seconds, fastest, strict=True))

    best = min(timings, key=worst_ratio)
    if worst_ratio(best) > worst_ratio(timings[0]) * (1.0 - PACK_MARGIN):
        best = timings[0]
    return best.hint


def pick_pack_hint(
    weights: Sequence[torch.Tensor],
    hints: Sequence[int] = PACK_HINTS,
    rows: Sequence[int] = PACK_ROWS,
    repeats: int = PACK_REPEATS,
) -> tuple[int, list[PackTiming]]:
    """Each hint timed on ``weights`` at each row count; the choice and every timing.

    ``weights`` are some of the model's own (a few layers': more than the
    caches hold, as in a step).
    """
    if not weights or not hints:
        raise ValueError("pick_pack_hint needs weights and at least one hint")
    dtype = weights[0].dtype
    sides = [[(PackedLinear(w, None, hint), w.shape[1]) for w in weights] for hint in hints]
    # [row count][hint]: the hints in turns at each row count, so a burst of
    # other work cannot favour the hint timed before or after it.
    per_rows = [time_interleaved(sides, n, dtype, repeats) for n in rows]
    timings = [
        PackTiming(hint, tuple(seconds[i] for seconds in per_rows)) for i, hint in enumerate(hints)
    ]
    return choose_pack_hint(timings), timings


class GemvPackedLinear(PackedLinear):
    """A ``PackedLinear`` that multiplies a single row through torch's own GEMV.

    For one row (a decode step of one sequence) oneDNN's packed kernel reads
    the weight at well under the memory bandwidth; torch's native
    reduced-precision GEMV (``F.linear`` with oneDNN switched off, which for
    bfloat16 accumulates in float32 with AVX-512) read SmolLM2-135M's weights
    about 1.5x faster on a 2-core AVX-512 EPYC (21.5 against 14.6 GB/s), and
    MKL's float32 GEMV was faster than packed on a Xeon with AMX. It needs
    the weight in its plain layout, so the layer keeps both: the dense weight
    costs the same memory again, which is why ``model.single_row_gemv =
    "auto"`` keeps it only where it measures faster.

    bfloat16 packed results do not depend on the row count; the GEMV's differ
    from them in the last bit for a few outputs in ten thousand (another
    summation order), so with it a sequence decoding alone and one decoding
    in a batch can round differently. "off" keeps bfloat16 batch-invariant.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int = 1
    ) -> None:
        super().__init__(weight, bias, batch_hint)
        self.register_buffer("weight", weight.detach().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != self.in_features:
            return super().forward(x)
        return single_row_gemv(x, self.weight, self.bias)


def single_row_gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` on torch's native kernels: with oneDNN on, bf16 and fp32 matmuls of
    every shape go to oneDNN or MKL's GEMM, and no operator reaches the GEMV otherwise.

    The switch is the process's, restored at once: another thread's matmul
    inside that window would take torch's native kernel instead of oneDNN's
    (the same product, rounded in another order). In the daemon only the
    engine's step thread multiplies.
    """
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return F.linear(x, weight, bias)
    finally:
        torch._C._set_mkldnn_enabled(was)


SINGLE_ROW_GEMV = ("auto", "on", "off")
# Turns of each side: timed one after the other (five of each), a load that
# began meanwhile on the host made the GEMV look slower in one load of four
# here, and the packed kernel was kept for the daemon's life at two thirds
# of the GEMV's decode speed.
GEMV_REPEATS = 9
# "auto" keeps the dense copy when the one-row GEMV is at least this much
# faster than the packed kernel in the timed sample (the copy doubles the
# linear weights' memory; a gain inside the timing noise is not worth it).
GEMV_MARGIN = 0.15


@dataclass(frozen=True, slots=True)
class GemvTiming:
    # Best of GEMV_REPEATS turns, seconds, one row through every sample weight.
    packed_s: float
    gemv_s: float

    @property
    def speedup(self) -> float:
        return self.packed_s / self.gemv_s if self.gemv_s > 0 else 0.0

    def worth_it(self) -> bool:
        return self.speedup >= 1.0 + GEMV_MARGIN


def time_single_row_gemv(
    weights: Sequence[torch.Tensor], batch_hint: int, repeats: int = GEMV_REPEATS
) -> GemvTiming:
    """One row through ``weights``, packed at ``batch_hint`` vs the native
    GEMV, in alternating turns (``time_interleaved``)."""
    if not weights:
        raise ValueError("time_single_row_gemv needs weights")
    dtype = weights[0].dtype
    packed = [(PackedLinear(w, None, batch_hint), w.shape[1]) for w in weights]
    gemv = [(functools.partial(single_row_gemv, weight=w, bias=None), w.shape[1]) for w in weights]
    packed_s, gemv_s = time_interleaved([packed, gemv], 1, dtype, repeats)
    return GemvTiming(packed_s, gemv_s)


LINEAR_KERNELS = ("auto", "packed", "dense")
_PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packed_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the packed kernel cannot serve this model; None when it can."""
    if device.type != "cpu":
        return f"it runs on the CPU only (the model is on {device})"
    if dtype not in _PACKED_DTYPES:
        return f"it packs float32 and bfloat16 weights, the model runs in {dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if dtype == torch.bfloat16:
        return _bf16_packing_unavailable()
    return None


@functools.cache
def _bf16_packing_unavailable() -> str | None:
    # oneDNN packs bf16 weights only on CPUs with AVX-512 (BW, VL, DQ) or
    # AVX-NE-CONVERT; elsewhere the reorder raises. Asked of oneDNN itself
    # on a tiny weight, not guessed from CPU flags.
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"oneDNN cannot pack bfloat16 weights on this CPU ({first})"
    return None


def dense_factory(
    kernel: str, device: torch.device, dtype: torch.dtype
) -> Callable[[torch.Tensor, torch.Tensor | None], nn.Module] | None:
    """What replaces unquantized dense layers for ``model.linear_kernel``; None: keep F.linear."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"model.linear_kernel = {kernel!r}; use one of {list(LINEAR_KERNELS)}")
    if kernel == "dense":
        return None
    why = packed_unavailable(device, dtype)
    if why is None:
        return PackedLinear
    if kernel == "packed":
        raise ValueError(f"model.linear_kernel = 'packed': {why}; use 'auto' or 'dense'")
    return None


def linear_factory(
    quantization: str, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor | None], nn.Module] | None:
    """What replaces each dense layer for ``model.quantization``; None for "none"."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"model.quantization = {quantization!r}; use one of {list(QUANTIZATIONS)}")
    if quantization == "none":
        return None
    if device.type != "cpu":
        raise ValueError(
            f"model.quantization = {quantization!r} runs on the CPU only (the model is on "
            f"{device}); use 'none' there"
        )
    return Int8Linear if quantization == "int8" else Int4Linear
