"""Reduced precision on the CPU: ``model.dtype`` honoured, parity with transformers.

bfloat16 is compared with transformers running the same checkpoint in
bfloat16. The two differ only in rounding (fused q/k/v and gate/up matmuls,
another summation order), so the bound is a few bf16 steps at the logits'
size: |logit| < 4 in these models, where one bf16 step is 1/64.
``BF16_TOL`` = 0.125 is 8 steps; a wrong weight, RoPE or cache read is off
by whole units.

Greedy decoding runs through the paged bf16 K/V cache, one decode step at a
time, and each step's logits are checked against transformers' over the
same sequence. Where the two disagree on the next token it must be a near
tie in transformers' own logits (within the tolerance), never a real
difference.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from mooncaked.config import ModelConfig
from mooncaked.engine.loader import (
    cpu_flags,
    cpu_has_bf16,
    load_model,
    resolve_dtype,
)
from mooncaked.engine.runner import ModelRunner
from tests.hf_fixtures import make_hf_model, plain_prompt
from tests.parity import check_greedy_parity, greedy_logits, hf_logits

BLOCK = 16
BF16_TOL = 0.125
CPU = torch.device("cpu")


def _assert_greedy_matches_hf(hf: Any, loaded: Any, tol: float, max_differ: int) -> None:
    """Greedy decoding of a fixed prompt, every step's logits within ``tol`` of
    transformers' over the same sequence; at most ``max_differ`` near ties."""
    prompt, new_tokens = plain_prompt(3, 21), 24
    ours = greedy_logits(loaded, prompt, new_tokens)
    ids = prompt + ours[len(prompt) - 1 :].argmax(-1).tolist()[: new_tokens - 1]
    theirs = hf_logits(hf, ids)
    torch.testing.assert_close(ours, theirs, atol=tol, rtol=0)
    assert check_greedy_parity(ours, theirs, tol) <= max_differ


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def bf16_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = tmp_path_factory.mktemp(f"{request.param}_bf16")
    hf = make_hf_model(request.param, d, seed=7).to(torch.bfloat16)
    return hf, load_model(ModelConfig(path=str(d), dtype="bfloat16"))


def test_bfloat16_is_honoured_on_the_cpu(bf16_case: Any) -> None:
    _hf, loaded = bf16_case
    assert loaded.dtype == torch.bfloat16 and loaded.device.type == "cpu"
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    runner = ModelRunner(loaded, num_blocks=4, block_size=BLOCK)
    assert runner.kv_buffer.dtype == torch.bfloat16
    # Another precision, other K/V bytes: other block hashes.
    assert loaded.model_id.endswith("#bfloat16")


def test_bfloat16_logits_and_greedy_match_hf_in_bfloat16(bf16_case: Any) -> None:
    hf, loaded = bf16_case
    _assert_greedy_matches_hf(hf, loaded, BF16_TOL, 2)


def test_float32_stays_the_cpu_default_without_bf16_instructions() -> None:
    assert resolve_dtype("float32", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype("float16", CPU) == torch.float16
    expected = torch.bfloat16 if cpu_has_bf16() else torch.float32
    assert resolve_dtype("auto", CPU) == expected
    # The builtin model stays float32 through F.linear on every CPU.
    builtin = load_model(ModelConfig())
    assert builtin.model_id == "builtin:tiny@0" and builtin.dtype == torch.float32
    assert builtin.linear_kernel == "dense"
    with pytest.raises(ValueError, match="'float8'"):
        resolve_dtype("float8", CPU)


def test_bf16_instructions_are_read_from_cpu_flags() -> None:
    x86 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"
    old = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n"
    assert cpu_has_bf16(cpu_flags(x86)) and cpu_has_bf16(cpu_flags(arm))
    assert not cpu_has_bf16(cpu_flags(old))
    assert cpu_flags("no flags here") == frozenset()


def test_unknown_dtype_in_config_is_named(tmp_path: Path) -> None:
    from mooncaked.config import ConfigError, load_config

    path = tmp_path / "c.toml"
    path.write_text('[model]\ndtype = "float8"\n')
    with pytest.raises(ConfigError, match="dtype"):
        load_config(path)


# ---------------------------------------------------------------------------
# Weight-only quantized linears (int8, int4) against transformers in float32.
#
# int8 on the random checkpoints: each weight is off by at most half a
# step (max |row| / 254) and activations enter the kernel in bfloat16, so
# the logits stay within INT8_TOL = 0.25 of float32 transformers (0.12
# measured). int4 loses too much on random weights for a bound that means
# anything, so its checkpoint is first snapped onto the int4 grid (each
# group of 32 inputs holds the 16 levels (q - 8) / 32, both ends present):
# quantizing it is then exact, and only the bfloat16 activations remain,
# within the bf16 bound. On the real model each must pick transformers'
# next token wherever that is not a near tie.

INT8_TOL = 0.25


def _snap_to_int4_grid(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() != 2:
                continue  # the embedding too: Qwen2's tied head is quantized from it
            n, k = p.shape
            q = torch.randint(0, 16, (n, k // 32, 32), generator=gen)
            q[..., 0], q[..., 1] = 0, 15
            p.copy_(((q - 8).float() / 32.0).view(n, k))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def fp32_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = tmp_path_factory.mktemp(f"{request.param}_fp32")
    return make_hf_model(request.param, d, seed=7), d


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def int4_grid_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = tmp_path_factory.mktemp(f"{request.param}_grid")
    hf = make_hf_model(request.param, d, seed=7)
    _snap_to_int4_grid(hf, seed=8)
    hf.save_pretrained(str(d))
    return hf, d


def _quantized_parity(hf: Any, d: Path, quantization: str, tol: float) -> None:
    loaded = load_model(ModelConfig(path=str(d), quantization=quantization))
    assert loaded.quantization == quantization
    assert loaded.model_id.endswith("#" + quantization)
    prompt, new_tokens = plain_prompt(3, 21), 24
    ours = greedy_logits(loaded, prompt, new_tokens)
    ids = prompt + ours[len(prompt) - 1 :].argmax(-1).tolist()[: new_tokens - 1]
    theirs = hf_logits(hf, ids)
    torch.testing.assert_close(ours, theirs, atol=tol, rtol=0)
    assert check_greedy_parity(ours, theirs, tol) <= 2


def test_int8_logits_and_greedy_match_hf_float32(fp32_case: Any) -> None:
    hf, d = fp32_case
    _quantized_parity(hf, d, "int8", INT8_TOL)


@pytest.mark.slow
def test_int4_on_grid_weights_matches_hf_float32(int4_grid_case: Any) -> None:
    hf, d = int4_grid_case
    _quantized_parity(hf, d, "int4", BF16_TOL)


def test_quantized_layers_replace_the_dense_ones(fp32_case: Any) -> None:
    from mooncaked.engine.quant import Int4Linear, Int8Linear

    _hf, d = fp32_case
    for quantization, cls in (("int8", Int8Linear), ("int4", Int4Linear)):
        model = load_model(ModelConfig(path=str(d), quantization=quantization)).model
        layer = model.model.layers[0]
        assert isinstance(layer.self_attn.qkv.linear, cls)
        assert isinstance(layer.mlp.gate_up.linear, cls)
        assert isinstance(layer.self_attn.o_proj, cls)
        assert isinstance(layer.mlp.down_proj, cls) and isinstance(model.lm_head, cls)
        # No dense projection weight is left behind: only the embedding and norms.
        dense = [n for n, p in model.named_parameters() if p.dim() == 2]
        assert dense == ["model.embed_tokens.weight"]


def test_int8_dense_path_for_many_rows_matches_the_kernel() -> None:
    from mooncaked.engine.quant import DENSE_ROWS, Int8Linear

    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    layer = Int8Linear(w, b)
    x = torch.randn(DENSE_ROWS, 64, generator=gen)
    many = layer(x)  # dequantized, dense
    few = torch.cat([layer(x[i : i + 1]) for i in range(DENSE_ROWS)])  # the kernel
    reference = x @ layer.dequantize().T + b
    torch.testing.assert_close(many, reference, atol=1e-4, rtol=0)
    # The kernel's bf16 activations: within a few bf16 steps of |y| < 32.
    torch.testing.assert_close(few, reference, atol=0.5, rtol=0)
    # Each weight within half a quantization step of the original.
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((layer.dequantize() - w).abs() <= step / 2 + 1e-6).all())


def test_bad_quantization_is_refused_by_name(tmp_path: Path) -> None:
    from mooncaked.config import ConfigError, load_config
    from mooncaked.engine.quant import Int4Linear, linear_factory

    path = tmp_path / "c.toml"
    path.write_text('[model]\nquantization = "int3"\n')
    with pytest.raises(ConfigError, match="quantization"):
        load_config(path)
    with pytest.raises(ValueError, match="'int3'"):
        linear_factory("int3", CPU)
    with pytest.raises(ValueError, match="CPU only"):
        linear_factory("int8", torch.device("cuda"))
    with pytest.raises(ValueError, match="divisible by"):
        Int4Linear(torch.ones(8, 48), None)


# ---------------------------------------------------------------------------
# The packed (oneDNN) kernel for unquantized linears.
#
# In bfloat16 it computes what F.linear computes (the same library, the
# weight reordered once instead of per call), so the bf16 bound holds as
# it is. In float32 only the summation order differs from MKL's: each
# output is off by a few float32 ulps of its dot product, which after
# every layer of these checkpoints stays within 2.1e-6 of transformers'
# logits (measured on both), so the float32 parity bound of 1e-4 holds for
# packed too; "dense" stays for bit-exact agreement.

FP32_PACKED_TOL = 1e-4


def _bf16_packing() -> str | None:
    from mooncaked.engine.quant import packed_unavailable

    return packed_unavailable(CPU, torch.bfloat16)


needs_bf16_packing = pytest.mark.skipif(
    _bf16_packing() is not None, reason=f"packed bf16: {_bf16_packing()}"
)


def test_packed_linear_computes_the_dense_product() -> None:
    from mooncaked.engine.quant import PackedLinear

    gen = torch.Generator().manual_seed(0)
    cases = [(torch.float32, 1e-4)]
    if _bf16_packing() is None:
        cases.append((torch.bfloat16, 0.0))
    for dtype, tol in cases:
        w = torch.randn(96, 64, generator=gen).to(dtype)
        b = torch.randn(96, generator=gen).to(dtype)
        layer = PackedLinear(w, b)
        for rows in (1, 3, 64):
            x = torch.randn(rows, 64, generator=gen).to(dtype)
            with torch.inference_mode():
                got, want = layer(x), torch.nn.functional.linear(x, w, b)
            assert got.dtype == dtype and got.shape == (rows, 96)
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_bf16_packing)])
def test_packed_kernel_replaces_every_dense_projection(fp32_case: Any, dtype: str) -> None:
    from mooncaked.engine.quant import PackedLinear

    _hf, d = fp32_case
    loaded = load_model(ModelConfig(path=str(d), dtype=dtype, linear_kernel="packed"))
    assert loaded.linear_kernel == "packed"
    model = loaded.model
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv.linear, PackedLinear)
    assert isinstance(layer.mlp.gate_up.linear, PackedLinear)
    assert isinstance(layer.self_attn.o_proj, PackedLinear)
    assert isinstance(layer.mlp.down_proj, PackedLinear) and isinstance(model.lm_head, PackedLinear)
    assert [n for n, p in model.named_parameters() if p.dim() == 2] == ["model.embed_tokens.weight"]
    dense = load_model(ModelConfig(path=str(d), dtype=dtype, linear_kernel="dense"))
    assert dense.linear_kernel == "dense" and isinstance(dense.model.lm_head, torch.nn.Linear)
    # Same numbers, same block hashes: the kernel is not part of the model id.
    assert dense.model_id == loaded.model_id


@pytest.mark.slow
def test_packed_float32_logits_and_greedy_match_hf_float32(fp32_case: Any) -> None:
    hf, d = fp32_case
    loaded = load_model(ModelConfig(path=str(d), dtype="float32", linear_kernel="packed"))
    _assert_greedy_matches_hf(hf, loaded, FP32_PACKED_TOL, 0)


@pytest.mark.slow
@needs_bf16_packing
def test_packed_bfloat16_matches_dense_bfloat16(fp32_case: Any) -> None:
    _hf, d = fp32_case
    prompt, new_tokens = plain_prompt(5, 19), 12
    runs = [
        greedy_logits(
            load_model(
                ModelConfig(path=str(d), dtype="bfloat16", linear_kernel=k, single_row_gemv="off")
            ),
            prompt,
            new_tokens,
        )
        for k in ("packed", "dense")
    ]
    torch.testing.assert_close(runs[0], runs[1], atol=BF16_TOL, rtol=0)
    assert bool((runs[0].argmax(-1) == runs[1].argmax(-1)).all())


def test_packed_kernel_refusals_name_the_reason(tmp_path: Path) -> None:
    from mooncaked.config import ConfigError, load_config
    from mooncaked.engine.quant import PackedLinear, dense_factory

    assert dense_factory("auto", CPU, torch.float32) is PackedLinear
    if _bf16_packing() is None:
        assert dense_factory("auto", CPU, torch.bfloat16) is PackedLinear
    assert dense_factory("dense", CPU, torch.float32) is None
    # auto falls back where packing cannot run; an explicit "packed" says why.
    assert dense_factory("auto", CPU, torch.float16) is None
    assert dense_factory("auto", torch.device("cuda"), torch.bfloat16) is None
    with pytest.raises(ValueError, match="float16"):
        dense_factory("packed", CPU, torch.float16)
    with pytest.raises(ValueError, match="CPU only"):
        dense_factory("packed", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="'fast'"):
        dense_factory("fast", CPU, torch.float32)
    path = tmp_path / "c.toml"
    path.write_text('[model]\nlinear_kernel = "fast"\n')
    with pytest.raises(ConfigError, match="linear_kernel"):
        load_config(path)


def test_bfloat16_falls_back_to_dense_where_onednn_cannot_pack_it(
    fp32_case: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without AVX-512 oneDNN refuses to pack bf16: auto loads dense, packed says why."""
    from mooncaked.engine import quant

    why = "oneDNN cannot pack bfloat16 weights on this CPU (needs avx512bw)"
    monkeypatch.setattr(quant, "_bf16_packing_unavailable", lambda: why)
    assert quant.dense_factory("auto", CPU, torch.bfloat16) is None
    assert quant.dense_factory("auto", CPU, torch.float32) is quant.PackedLinear
    with pytest.raises(ValueError, match="cannot pack bfloat16"):
        quant.dense_factory("packed", CPU, torch.bfloat16)
    _hf, d = fp32_case
    loaded = load_model(ModelConfig(path=str(d), dtype="bfloat16"))
    assert loaded.linear_kernel == "dense" and loaded.dtype == torch.bfloat16
    assert isinstance(loaded.model.lm_head, torch.nn.Linear)


def test_every_packed_layout_computes_the_dense_product() -> None:
    from mooncaked.engine.quant import PACK_HINTS, PackedLinear

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=gen)
    for hint in PACK_HINTS:
        layer = PackedLinear(w, None, hint)
        for rows in (1, 5, 16, 64):
            x = torch.randn(rows, 64, generator=gen)
            with torch.inference_mode():
                got = layer(x)
            want = torch.nn.functional.linear(x, w)
            torch.testing.assert_close(got, want, atol=FP32_PACKED_TOL, rtol=FP32_PACKED_TOL)


def test_the_packed_layout_is_the_one_never_far_from_the_fastest() -> None:
    from mooncaked.engine.quant import PackTiming, choose_pack_hint

    def pick(*rows: tuple[float, ...]) -> int:
        return choose_pack_hint([PackTiming(int(h), tuple(t)) for h, *t in rows])

    # Measured on an AVX2 EPYC: the one-row layout ties for one row and
    # loses 25-40% at 16 rows.
    assert pick((1, 30.7, 60.4, 140.9), (16, 27.6, 43.4, 126.8), (64, 37.1, 44.5, 138.1)) == 16
    # Worst ratio, not the sum: 64 wins 16 rows by far but loses one row by 50%.
    assert pick((1, 10.0, 20.0, 50.0), (16, 10.5, 14.0, 50.0), (64, 15.0, 10.0, 40.0)) == 16
    # Within the margin of the first hint: the first is kept.
    assert pick((1, 10.0, 20.0, 50.0), (16, 9.8, 19.0, 49.0), (64, 10.5, 19.5, 48.0)) == 1
    assert pick((64, 1.0, 1.0, 1.0)) == 64
    with pytest.raises(ValueError):
        choose_pack_hint([])


@pytest.mark.slow
def test_packed_layout_is_measured_at_load_unless_configured(fp32_case: Any) -> None:
    from mooncaked.config import ConfigError, load_config
    from mooncaked.engine.quant import PACK_HINTS, PACK_ROWS, PackedLinear

    _hf, d = fp32_case
    measured = load_model(ModelConfig(path=str(d), dtype="float32", linear_kernel="packed"))
    timings = measured.packed_layout_timings
    assert [t.hint for t in timings] == list(PACK_HINTS)
    assert all(len(t.seconds) == len(PACK_ROWS) and min(t.seconds) > 0 for t in timings)
    assert measured.packed_layout_rows in PACK_HINTS
    assert measured.model.lm_head.batch_hint == measured.packed_layout_rows
    fixed = load_model(
        ModelConfig(path=str(d), dtype="float32", linear_kernel="packed", packed_layout_rows=16)
    )
    assert fixed.packed_layout_rows == 16 and fixed.packed_layout_timings == []
    layers = [m for m in fixed.model.modules() if isinstance(m, PackedLinear)]
    assert layers and {m.batch_hint for m in layers} == {16}
    # Another layout, the same numbers within the packed float32 bound.
    prompt = plain_prompt(7, 13)
    torch.testing.assert_close(
        greedy_logits(fixed, prompt, 6),
        greedy_logits(measured, prompt, 6),
        atol=FP32_PACKED_TOL,
        rtol=0,
    )
    path = Path(d).parent / "bad.toml"
    path.write_text("[model]\npacked_layout_rows = -1\n")
    with pytest.raises(ConfigError, match="packed_layout_rows"):
        load_config(path)


# ---------------------------------------------------------------------------
# One-row steps through torch's native GEMV on a kept dense copy.
#
# In bfloat16 it accumulates in float32 as oneDNN does, in another order: a
# few outputs in ten thousand round to the neighbouring bf16 value, so the
# bf16 bound holds as it is. In float32 it is MKL's GEMV, the kernel HF's
# F.linear runs, within the packed bound.


def _gemv_cases() -> list[tuple[torch.dtype, float]]:
    cases = [(torch.float32, FP32_PACKED_TOL)]
    if _bf16_packing() is None:
        cases.append((torch.bfloat16, 1 / 32))
    return cases


def test_gemv_linear_takes_the_gemv_for_one_row_and_the_packed_kernel_for_more() -> None:
    from mooncaked.engine.quant import GemvPackedLinear, PackedLinear, single_row_gemv

    gen = torch.Generator().manual_seed(2)
    for dtype, tol in _gemv_cases():
        w = torch.randn(96, 64, generator=gen).to(dtype)
        b = torch.randn(96, generator=gen).to(dtype)
        layer, packed = GemvPackedLinear(w, b, 16), PackedLinear(w, b, 16)
        # The dense copy the GEMV reads is the weight itself.
        assert torch.equal(layer.weight, w)
        with torch.inference_mode():
            for shape in ((1, 64), (1, 1, 64)):
                x = torch.randn(*shape, generator=gen).to(dtype)
                got = layer(x)
                assert got.shape == (*shape[:-1], 96) and got.dtype == dtype
                torch._C._set_mkldnn_enabled(False)
                try:
                    native = torch.nn.functional.linear(x, w, b)
                finally:
                    torch._C._set_mkldnn_enabled(True)
                assert torch.equal(got, native)
                want = torch.nn.functional.linear(x.float(), w.float(), b.float())
                torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
            for rows in (2, 5, 64):
                x = torch.randn(rows, 64, generator=gen).to(dtype)
                assert torch.equal(layer(x), packed(x))
        # oneDNN is on again after each call, and after one that raised.
        assert torch._C._get_mkldnn_enabled()
        with pytest.raises(RuntimeError):
            single_row_gemv(torch.ones(1, 64, dtype=torch.float64), w, b)
        assert torch._C._get_mkldnn_enabled()


def test_gemv_is_kept_only_where_it_is_measured_faster_by_the_margin() -> None:
    from mooncaked.engine.quant import GEMV_MARGIN, GemvTiming

    # bf16 on a 2-core AVX-512 EPYC: 1.5x; float32 there: 0.6x.
    assert GemvTiming(packed_s=8.75e-3, gemv_s=5.89e-3).worth_it()
    assert not GemvTiming(packed_s=13.1e-3, gemv_s=21.4e-3).worth_it()
    # A lead inside the margin does not pay for a second copy of the weights.
    assert not GemvTiming(packed_s=1.0 + GEMV_MARGIN / 2, gemv_s=1.0).worth_it()
    assert GemvTiming(packed_s=1.0 + GEMV_MARGIN, gemv_s=1.0).worth_it()
    assert GemvTiming(packed_s=1.0, gemv_s=0.0).speedup == 0.0


def test_the_gemv_and_packed_kernels_are_timed_in_alternating_turns() -> None:
    """Each repeat runs every side once, in turn, after one warm-up turn:
    load that comes and goes on the host lands on both sides alike."""
    from mooncaked.engine.quant import time_interleaved

    order: list[str] = []

    def call(name: str) -> Callable[[torch.Tensor], None]:
        def run(x: torch.Tensor) -> None:
            assert x.shape == (2, 8)
            order.append(name)

        return run

    best = time_interleaved(
        [[(call("a1"), 8), (call("a2"), 8)], [(call("b"), 8)]], 2, torch.float32, 3
    )
    assert len(best) == 2 and all(0.0 <= t < float("inf") for t in best)
    assert order == ["a1", "a2", "b"] * 4  # a warm-up turn and three timed


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_bf16_packing)])
def test_single_row_gemv_on_off_and_measured(fp32_case: Any, dtype: str) -> None:
    from mooncaked.config import ConfigError, load_config
    from mooncaked.engine.quant import GemvPackedLinear, PackedLinear

    _hf, d = fp32_case

    def load(gemv: str) -> Any:
        return load_model(ModelConfig(path=str(d), dtype=dtype, single_row_gemv=gemv))

    on, off, auto = load("on"), load("off"), load("auto")
    layers = on.model.projections()
    assert len(layers) == 4 * len(on.model.model.layers) + 1
    assert all(isinstance(m, GemvPackedLinear) for m in layers)
    # The dense copy is every packed weight once more, and is counted; a tied
    # head's is the embedding, which is there anyway.
    copies = sum(m.weight.nbytes for m in layers)
    if on.arch.tie_word_embeddings:
        copies -= on.model.lm_head.weight.nbytes
    assert on.single_row_gemv and on.gemv_extra_bytes == copies
    assert on.gemv_timing is None
    assert not off.single_row_gemv and off.gemv_extra_bytes == 0 and off.gemv_timing is None
    assert not any(isinstance(m, GemvPackedLinear) for m in off.model.projections())
    assert all(isinstance(m, PackedLinear) for m in off.model.projections())
    t = auto.gemv_timing
    assert t is not None and t.packed_s > 0 and t.gemv_s > 0
    assert auto.single_row_gemv == t.worth_it()
    assert isinstance(auto.model.lm_head, GemvPackedLinear) == t.worth_it()
    # Not part of the model id: the same K/V within rounding, the same blocks.
    assert on.model_id == off.model_id
    # A prefill-only node never runs a one-row step: no copy, nothing timed.
    prefill = load_model(ModelConfig(path=str(d), dtype=dtype), decodes=False)
    assert not prefill.single_row_gemv and prefill.gemv_timing is None
    assert not any(isinstance(m, GemvPackedLinear) for m in prefill.model.projections())
    path = Path(d).parent / "bad_gemv.toml"
    path.write_text('[model]\nsingle_row_gemv = "yes"\n')
    with pytest.raises(ConfigError, match="single_row_gemv"):
        load_config(path)


@needs_bf16_packing
def test_bfloat16_with_single_row_gemv_matches_hf_in_bfloat16(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mooncaked.engine import quant

    calls: list[int] = []
    gemv = quant.single_row_gemv

    def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[-1])
        return gemv(x, weight, bias)

    monkeypatch.setattr(quant, "single_row_gemv", counted)
    d = tmp_path_factory.mktemp("llama_bf16_gemv")
    hf = make_hf_model("llama", d, seed=7).to(torch.bfloat16)
    loaded = load_model(ModelConfig(path=str(d), dtype="bfloat16", single_row_gemv="on"))
    # Decode steps of one row each: every one after the prompt takes the GEMV.
    _assert_greedy_matches_hf(hf, loaded, BF16_TOL, 2)
    # Every linear of each of the 23 decode steps (none of the prefill's 21 rows).
    assert len(calls) == 23 * (4 * len(loaded.model.model.layers) + 1)
