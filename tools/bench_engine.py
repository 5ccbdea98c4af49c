"""Engine speed vs HF transformers, per precision, and TTFT with vs without a cached prefix.

One command, every side in the same process on the same weights (``--model``:
builtin:tiny, a Hugging Face directory or a GGUF file; HF ``LlamaForCausalLM``
gets our float32 weights):

    python tools/bench_engine.py --model PATH --precisions float32,int8,int4

For each precision of ``--precisions`` (float32, bfloat16, float16, int8,
int4; the quantized ones keep float32 elsewhere) and each torch thread count
of ``--threads``, ours is measured in process through an EngineCore, its
unquantized linears through ``--linear-kernel`` (``model.linear_kernel``:
auto packs them for oneDNN on the CPU):

1. Single-stream decode, tokens/s: one request, ``--decode-tokens`` tokens
   after the first (medians of ``--repeats``). With ``--decode-batch N``
   (ours only), also N such requests together: tokens/s while all decode.
2. Prompt processing, tokens/s: a ``--prompt-tokens`` prompt (512) with
   nothing cached, time to its first token.
3. Throughput, output tokens/s: ``--requests`` requests submitted at once,
   prompt lengths uniform in [min, max], output lengths drawn from the
   output lengths of Kimi's conversation trace (its quantiles are built in),
   scaled so the trace's longest becomes ``--max-output-len``; EOS ignored.
   HF: ``generate`` over left-padded batches of prompts sorted by length at
   each batch size of ``--hf-batch-sizes``; a batch runs until its longest
   output. Its best batch size is the baseline, and ours in float32 must be
   token-identical to it.

HF float32 is measured the same way (1., 2., 3.) and every figure is printed
with its ratio to HF's. Then, unless ``--skip-prefix``: TTFT of a 1,024-token
prompt whose first 960 tokens are cached vs nothing cached.

``--llamacpp`` adds llama.cpp as a third side (GGUF models only): its own
``llama-bench`` (built by ``tools/llamacpp_anchor.sh``; ``auto`` finds it
there, or give the ``anchor.env`` it wrote) on a file of the same weights at
each precision, written from ``--model`` by ``llama-quantize``: float32 vs
F32, float16 vs F16, bfloat16 vs BF16, int8 vs Q8_0, int4 vs Q4_0. It runs as
a subprocess with the same thread count, after ours, never at the same time:
prompt processing of ``--prompt-tokens`` and generation of
``--decode-tokens`` (medians of ``--repeats``), printed with ours / llama.cpp.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mooncakectl.bench.engine_bench import (
    LLAMACPP_TYPES,
    PRECISIONS,
    TRACE_MAX_OUTPUT,
    AnchorError,
    LlamaCpp,
    Workload,
    make_workload,
    read_anchor,
)
from mooncaked.config import Config, with_overrides
from mooncaked.engine.core import EngineCore
from mooncaked.engine.graphs import CUDA_GRAPH_MODES
from mooncaked.engine.loader import LoadedModel, load_model
from mooncaked.engine.quant import LINEAR_KERNELS, SINGLE_ROW_GEMV
from mooncaked.process import (
    keep_large_allocations_mapped,
    run_in_compute_thread,
    set_compute_threads,
)
from mooncaked.request import SamplingParams


def _layout_rows(value: str) -> list[int]:
    try:
        rows = [int(x) for x in value.split(",")]
    except ValueError:
        rows = []
    if not rows or min(rows) < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: give rows >= 0, comma-separated")
    return rows


def _modes(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of some of ``allowed``."""

    def parse(value: str) -> list[str]:
        modes = [x for x in value.split(",") if x]
        if not modes or any(m not in allowed for m in modes):
            raise argparse.ArgumentTypeError(
                f"{value!r}: give some of {list(allowed)}, comma-separated"
            )
        return modes

    return parse


def engine_config(
    args: argparse.Namespace,
    precision: str,
    kernel: str | None = None,
    layout_rows: int = 0,
    gemv: str = "auto",
    cuda_graphs: str = "auto",
) -> Config:
    dtype, quantization = PRECISIONS[precision]
    kv: dict[str, object] = {}
    if args.kv_block_size:
        kv["block_size"] = args.kv_block_size
    return with_overrides(
        Config(),
        kv=kv,
        model={
            "path": args.model,
            "dtype": dtype,
            "quantization": quantization,
            "linear_kernel": kernel or args.linear_kernel,
            "packed_layout_rows": layout_rows,
            "single_row_gemv": gemv,
            "cuda_graphs": cuda_graphs,
        },
        scheduler={
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_waiting": 4096,
        },
    )


@dataclass(slots=True)
class Figures:
    """One side's measurements; 0.0 where not measured."""

    decode_tps: float = 0.0
    prefill_tps: float = 0.0
    throughput_tps: float = 0.0
    # --decode-batch requests decoding together, output tokens/s.
    batch_decode_tps: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)
    note: str = ""
    # Ours: the decode step replayed from CUDA graphs.
    graphed: bool = False


async def _generate(engine: EngineCore, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Token ids and the time each arrived."""
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    ids: list[int] = []
    times: list[float] = []
    async for out in engine.add_request(prompt, sp):
        ids += out.new_token_ids
        times += [time.perf_counter()] * len(out.new_token_ids)
    return ids, times


async def measure_ours(
    loaded: LoadedModel, cfg: Config, args: argparse.Namespace, wl: Workload | None
) -> Figures:
    engine = EngineCore(cfg, loaded)
    await engine.start()
    figures = Figures(graphed=engine.runner.graphs is not None)
    rng = random.Random(args.seed + 7)
    vocab_top = min(loaded.arch.vocab_size, 1000)

    def fresh(n: int) -> list[int]:
        # Never cached: every prompt is new random ids.
        return [rng.randrange(32, vocab_top) for _ in range(n)]

    try:
        await _generate(engine, fresh(16), 4)  # warm-up: first-call allocations, threads
        decode: list[float] = []
        prefill: list[float] = []
        for _ in range(args.repeats):
            _ids, times = await _generate(engine, fresh(32), args.decode_tokens + 1)
            decode.append(args.decode_tokens / (times[-1] - times[0]))
            t0 = time.perf_counter()
            _ids, times = await _generate(engine, fresh(args.prompt_tokens), 1)
            prefill.append(args.prompt_tokens / (times[0] - t0))
        figures.decode_tps = statistics.median(decode)
        figures.prefill_tps = statistics.median(prefill)
        if args.decode_batch > 0:
            batch = []
            for _ in range(args.repeats):
                runs = await asyncio.gather(
                    *(
                        _generate(engine, fresh(32), args.decode_tokens + 1)
                        for _ in range(args.decode_batch)
                    )
                )
                batch.append(_steady_tps([times for _ids, times in runs]))
            figures.batch_decode_tps = statistics.median(batch)
        if wl is not None:
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(_generate(engine, p, n) for p, n in zip(wl.prompts, wl.output_lens, strict=True))
            )
            figures.throughput_tps = wl.num_output_tokens / (time.perf_counter() - t0)
            figures.outputs = [ids for ids, _times in results]
    finally:
        await engine.close()
    return figures


def _steady_tps(streams: list[list[float]]) -> float:
    """Tokens/s while every stream decodes: from the last first token to the first last one."""
    start = max(times[0] for times in streams)
    end = min(times[-1] for times in streams)
    tokens = sum(1 for times in streams for t in times if start < t <= end)
    return tokens / (end - start) if end > start else 0.0


def hf_model(loaded: LoadedModel) -> torch.nn.Module:
    import transformers

    a = loaded.arch
    config = transformers.LlamaConfig(
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        rope_theta=a.rope_theta,
        rms_norm_eps=a.rms_norm_eps,
        tie_word_embeddings=a.tie_word_embeddings,
        max_position_embeddings=a.max_position_embeddings,
        bos_token_id=a.bos_token_id,
        eos_token_id=list(a.eos_token_ids),
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.model.state_dict(), strict=False)
    # With tied embeddings lm_head.weight may be absent on either side.
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"weights do not map onto HF: {missing} {unexpected}")
    return model.to(device=loaded.device, dtype=torch.float32).eval()


def _hf_generate(model: torch.nn.Module, prompts: list[list[int]], n: int) -> torch.Tensor:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, width:]


def run_hf(model: torch.nn.Module, wl: Workload, batch_size: int) -> tuple[float, list[list[int]]]:
    """Static batches of prompts sorted by length; each runs to its longest output."""
    order = sorted(range(len(wl.prompts)), key=lambda i: len(wl.prompts[i]))
    outputs: list[list[int]] = [[] for _ in wl.prompts]
    t0 = time.perf_counter()
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        out = _hf_generate(model, [wl.prompts[i] for i in idx], max(wl.output_lens[i] for i in idx))
        for row, i in enumerate(idx):
            outputs[i] = out[row, : wl.output_lens[i]].tolist()
    return time.perf_counter() - t0, outputs


def measure_hf(
    model: torch.nn.Module, args: argparse.Namespace, wl: Workload | None, vocab: int
) -> Figures:
    rng = random.Random(args.seed + 7)
    top = min(vocab, 1000)
    figures = Figures()
    _hf_generate(model, [[rng.randrange(32, top) for _ in range(16)]], 4)  # warm-up
    decode: list[float] = []
    prefill: list[float] = []
    for _ in range(args.repeats):
        prompt = [rng.randrange(32, top) for _ in range(32)]
        t0 = time.perf_counter()
        _hf_generate(model, [prompt], 1)
        t1 = time.perf_counter()
        _hf_generate(model, [prompt], args.decode_tokens + 1)
        t2 = time.perf_counter()
        # The second run repeats the first one's prefill and first token.
        decode.append(args.decode_tokens / ((t2 - t1) - (t1 - t0)))
        prompt = [rng.randrange(32, top) for _ in range(args.prompt_tokens)]
        t0 = time.perf_counter()
        _hf_generate(model, [prompt], 1)
        prefill.append(args.prompt_tokens / (time.perf_counter() - t0))
    figures.decode_tps = statistics.median(decode)
    figures.prefill_tps = statistics.median(prefill)
    if wl is not None:
        best: tuple[float, int, list[list[int]]] | None = None
        for bs in (int(x) for x in args.hf_batch_sizes.split(",")):
            hf_s, hf_out = run_hf(model, wl, bs)
            print(
                f"    HF generate (batch {bs:3d}): {hf_s:7.2f} s  "
                f"{wl.num_output_tokens / hf_s:9.1f} output tok/s",
                flush=True,
            )
            if best is None or hf_s < best[0]:
                best = (hf_s, bs, hf_out)
        if best is not None:
            figures.throughput_tps = wl.num_output_tokens / best[0]
            figures.outputs = best[2]
            figures.note = f"best batch {best[1]}"
    return figures


ANCHOR_SCRIPT = Path(__file__).resolve().parent / "llamacpp_anchor.sh"


def llamacpp_file(anchor: LlamaCpp, source: Path, precision: str) -> Path:
    """The source GGUF's weights rewritten in the file type matching ``precision``.

    Every type comes from the same source, so each side reads the same
    weights: a quantized source dequantizes exactly, to F32 as our loader
    does, and narrower types round from there.
    """
    ftype = LLAMACPP_TYPES[precision]
    anchor.models.mkdir(parents=True, exist_ok=True)
    out = anchor.models / f"{source.stem}-{ftype}.gguf"
    if out.exists() and out.stat().st_mtime >= source.stat().st_mtime:
        return out
    tmp = out.with_suffix(".tmp")
    done = subprocess.run(
        [str(anchor.quantize), "--allow-requantize", str(source), str(tmp), ftype],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama-quantize to {ftype} failed:\n{done.stderr[-2000:]}")
    tmp.replace(out)
    return out


def measure_llamacpp(
    anchor: LlamaCpp, model: Path, args: argparse.Namespace, threads: int
) -> Figures:
    """llama-bench: prompt processing and generation, medians of its samples."""
    cmd = [str(anchor.bench), "-m", str(model), "-t", str(threads), "-o", "json"]
    cmd += ["-p", str(args.prompt_tokens), "-n", str(args.decode_tokens), "-r", str(args.repeats)]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        check=False,
    )
    figures = Figures()
    if done.returncode != 0:
        # One file type crashing should cost its own row, not every other side's figures
        # (llama-bench at 0c1e570 dies of SIGSEGV on Q8_0 and Q4_0 on a CPU with AMX).
        how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
        tail = done.stderr.strip().splitlines()[-1:] or ["no stderr"]
        figures.note = f"llama-bench failed ({how}) on {model.name}: {tail[0][:200]}"
        return figures
    for rec in json.loads(done.stdout):
        rate = statistics.median(rec["samples_ts"])
        if rec["n_gen"] > 0:
            figures.decode_tps = rate
        elif rec["n_prompt"] > 0:
            figures.prefill_tps = rate
    figures.note = f"llama-bench, {model.name}"
    return figures


async def ttft(engine: EngineCore, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    stream = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    async for out in stream:
        if out.new_token_ids:
            elapsed = time.perf_counter() - t0
    return elapsed


async def prefix_bench(loaded: LoadedModel, cfg: Config, runs: int, seed: int) -> None:
    rng = random.Random(seed)
    engine = EngineCore(cfg, loaded)
    await engine.start()
    await ttft(engine, [65] * 32)  # warm-up
    cached: list[float] = []
    uncached: list[float] = []
    hit_tokens: list[int] = []
    for _ in range(runs):
        prefix = [rng.randrange(32, 127) for _ in range(960)]
        # Populate the cache with the prefix under another tail.
        await ttft(engine, prefix + [rng.randrange(32, 127) for _ in range(64)])
        before = engine.stats().prefix_hit_tokens
        cached.append(await ttft(engine, prefix + [rng.randrange(32, 127) for _ in range(64)]))
        hit_tokens.append(engine.stats().prefix_hit_tokens - before)
        uncached.append(await ttft(engine, [rng.randrange(32, 127) for _ in range(1024)]))
    await engine.close()
    c, u = statistics.median(cached), statistics.median(uncached)
    print(f"prefix reuse: 1024-token prompt, {statistics.median(hit_tokens)} tokens cached")
    print(f"  TTFT uncached  median {u * 1e3:8.1f} ms  ({[round(x * 1e3, 1) for x in uncached]})")
    print(f"  TTFT cached    median {c * 1e3:8.1f} ms  ({[round(x * 1e3, 1) for x in cached]})")
    print(f"  speedup (uncached / cached): {u / c:.2f}x   (goal >= 5x)")


def _line(f: Figures) -> str:
    """One side's figures as soon as they are measured: a cut-short run still tells."""
    return (
        f"decode {f.decode_tps:.1f} tok/s, prompt {f.prefill_tps:.1f} tok/s, "
        f"throughput {f.throughput_tps:.1f} tok/s"
        + (f", batch decode {f.batch_decode_tps:.1f} tok/s" if f.batch_decode_tps else "")
        + f" {f.note}"
    )


def _ratio(ours: float, base: float) -> str:
    return f"{ours / base:5.2f}x" if ours > 0 and base > 0 else "    -"


def print_table(rows: list[tuple[str, int, Figures]], base: Figures) -> None:
    print()
    print(
        f"{'side':<26}{'threads':>8}{'decode tok/s':>14}{'vs HF':>8}{'prompt tok/s':>14}"
        f"{'vs HF':>8}{'throughput tok/s':>18}{'vs HF':>8}{'batch decode':>14}  note"
    )
    for name, threads, f in rows:
        print(
            f"{name:<26}{threads:>8}{f.decode_tps:>14.1f}{_ratio(f.decode_tps, base.decode_tps):>8}"
            f"{f.prefill_tps:>14.1f}{_ratio(f.prefill_tps, base.prefill_tps):>8}"
            f"{f.throughput_tps:>18.1f}{_ratio(f.throughput_tps, base.throughput_tps):>8}"
            f"{f.batch_decode_tps:>14.1f}  {f.note}"
        )


def print_versus(versus: dict[tuple[str, int], tuple[Figures, Figures]]) -> None:
    print()
    print("ours / llama.cpp at the same precision (goals: decode >= 1.0x, prompt >= 1.2x)")
    print(f"{'precision':<12}{'llama.cpp':>10}{'threads':>8}{'decode':>10}{'prompt':>10}")
    for (precision, threads), (ours, theirs) in versus.items():
        print(
            f"{precision:<12}{LLAMACPP_TYPES[precision]:>10}{threads:>8}"
            f"{_ratio(ours.decode_tps, theirs.decode_tps):>10}"
            f"{_ratio(ours.prefill_tps, theirs.prefill_tps):>10}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="builtin:tiny", help="builtin:tiny, HF directory or .gguf")
    ap.add_argument("--precisions", default="float32,int8,int4", help=f"of {list(PRECISIONS)}")
    ap.add_argument(
        "--threads", default="", help="torch thread counts to measure, e.g. 1,2 (default: cores)"
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument(
        "--decode-batch",
        type=int,
        default=0,
        help="ours only: also this many requests decoding together, tokens/s while all decode",
    )
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument(
        "--max-output-len",
        type=int,
        default=256,
        help="the trace's longest output (2,000 tokens) scales to this",
    )
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-batch-sizes", default="8,16,32,64")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--prefix-runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument(
        "--linear-kernel",
        default="auto",
        choices=LINEAR_KERNELS,
        help="model.linear_kernel of ours (HF always gets dense float32 weights)",
    )
    ap.add_argument(
        "--packed-layout-rows",
        type=_layout_rows,
        default=[0],
        help="model.packed_layout_rows of ours, each measured (0: picked at load; e.g. 1,0 "
        "puts the one-row layout beside the picked one); the last is set against llama.cpp",
    )
    ap.add_argument(
        "--single-row-gemv",
        type=_modes(SINGLE_ROW_GEMV),
        default=["auto"],
        help="model.single_row_gemv of ours, each measured for every layout (auto, on, off; "
        "e.g. off,auto puts packed-only beside the load-time pick); the last is set against "
        "llama.cpp",
    )
    ap.add_argument(
        "--cuda-graphs",
        type=_modes(CUDA_GRAPH_MODES),
        default=["auto"],
        help="model.cuda_graphs of ours, each measured (auto, on, off; e.g. off,on on a GPU "
        "puts eager decode beside graphed); the last is set against llama.cpp",
    )
    ap.add_argument(
        "--kv-block-size",
        type=int,
        default=0,
        help="kv.block_size of ours (0: the config's default); flash-attn, and so CUDA "
        "graphs, need a multiple of 256",
    )
    ap.add_argument(
        "--llamacpp",
        default="",
        metavar="auto|ANCHOR_ENV",
        help="add llama.cpp's llama-bench as a side (GGUF --model only)",
    )
    args = ap.parse_args()
    precisions = [x for x in args.precisions.split(",") if x]
    unknown = [x for x in precisions if x not in PRECISIONS]
    if unknown:
        ap.error(f"unknown precision(s) {unknown}; use {list(PRECISIONS)}")
    threads = [int(x) for x in args.threads.split(",") if x] or [torch.get_num_threads()]
    anchor: LlamaCpp | None = None
    if args.llamacpp:
        if not args.model.endswith(".gguf"):
            ap.error(f"--llamacpp needs a GGUF --model, got {args.model!r}")
        try:
            anchor = read_anchor(args.llamacpp, ANCHOR_SCRIPT)
        except AnchorError as exc:
            raise SystemExit(str(exc)) from None
        print(f"llama.cpp side: {anchor.version}", flush=True)

    keep_large_allocations_mapped()
    # Before anything computes: a load in this thread at torch's default would
    # give it an OpenMP team of its own, for the rest of the run, beside the
    # one that is measured (single-stream decode was about 2x slower).
    set_compute_threads(threads[0])
    # The source of HF's weights: dense float32 layers whose state_dict is HF's.
    base_cfg = engine_config(args, "float32", kernel="dense")
    fp32 = load_model(base_cfg.model)
    print(
        f"model {fp32.served_name}: {sum(p.numel() for p in fp32.model.parameters()) / 1e6:.1f}M "
        f"params; precisions {precisions}; threads {threads}",
        flush=True,
    )
    wl = None
    if not args.skip_throughput:
        wl = make_workload(
            args.requests,
            args.min_prompt,
            args.max_prompt,
            args.max_output_len,
            args.seed,
            fp32.arch.vocab_size,
        )
        print(
            f"workload: {args.requests} requests, prompts {args.min_prompt}..{args.max_prompt} "
            f"tokens, outputs {min(wl.output_lens)}..{max(wl.output_lens)} tokens "
            f"(mean {statistics.mean(wl.output_lens):.0f}, trace lengths x "
            f"{args.max_output_len / TRACE_MAX_OUTPUT:.3f}), {wl.num_output_tokens} in all",
            flush=True,
        )

    rows: list[tuple[str, int, Figures]] = []
    hf_rows: dict[int, Figures] = {}
    # (precision, threads) -> (ours, llama.cpp)
    versus: dict[tuple[str, int], tuple[Figures, Figures]] = {}
    for n_threads in threads:
        # As the daemon runs: one OpenMP team of n_threads, in the thread that
        # computes (ours: the engine's step thread; HF: a thread of its own).
        set_compute_threads(n_threads)
        if not args.skip_hf:
            print(f"HF transformers float32, {n_threads} threads", flush=True)
            model = hf_model(fp32)
            hf_rows[n_threads] = run_in_compute_thread(
                lambda model=model: measure_hf(model, args, wl, fp32.arch.vocab_size)
            )
            rows.append(("HF generate float32", n_threads, hf_rows[n_threads]))
            print(f"  {_line(hf_rows[n_threads])}", flush=True)
            del model
        for precision in precisions:
            variants = [
                (r, g, c)
                for c in args.cuda_graphs
                for r in args.packed_layout_rows
                for g in args.single_row_gemv
            ]
            dense_done: set[str] = set()
            for layout_rows, gemv, graphs in variants:
                if graphs in dense_done:
                    continue  # the layout and the GEMV are a packed kernel's only
                print(f"ours {precision}, {n_threads} threads", flush=True)
                cfg = engine_config(
                    args, precision, layout_rows=layout_rows, gemv=gemv, cuda_graphs=graphs
                )
                same_as_base = precision == "float32" and cfg.model == base_cfg.model
                loaded = fp32 if same_as_base else load_model(cfg.model)
                f = asyncio.run(measure_ours(loaded, cfg, args, wl))
                base = hf_rows.get(n_threads)
                if wl is not None and base is not None and base.outputs:
                    same = sum(1 for a, b in zip(f.outputs, base.outputs, strict=True) if a == b)
                    f.note = f"greedy = HF for {same}/{len(f.outputs)}"
                kernel = "" if loaded.quantization != "none" else f" {loaded.linear_kernel}"
                if loaded.linear_kernel == "packed":
                    kernel += f"/{loaded.packed_layout_rows}" + ("m" if layout_rows == 0 else "")
                    if loaded.single_row_gemv:
                        kernel += "+gemv" + ("m" if gemv == "auto" else "")
                if f.graphed:
                    kernel += "+graphs"
                rows.append((f"ours {precision}{kernel}", n_threads, f))
                print(f"  {_line(f)}", flush=True)
                packed = loaded.linear_kernel == "packed"
                del loaded
                gc.collect()
                if not packed:
                    dense_done.add(graphs)
            if anchor is not None:
                gguf = llamacpp_file(anchor, Path(args.model), precision)
                print(f"llama.cpp {LLAMACPP_TYPES[precision]}, {n_threads} threads", flush=True)
                lf = measure_llamacpp(anchor, gguf, args, n_threads)
                rows.append((f"llama.cpp {LLAMACPP_TYPES[precision]}", n_threads, lf))
                versus[(precision, n_threads)] = (f, lf)
                print(f"  {_line(lf)}", flush=True)
    for n_threads in threads:
        base = hf_rows.get(n_threads, Figures())
        print_table([r for r in rows if r[1] == n_threads], base)
    if versus:
        print_versus(versus)
    if not args.skip_prefix:
        set_compute_threads(threads[-1])
        asyncio.run(prefix_bench(fp32, base_cfg, args.prefix_runs, args.seed + 1))


if __name__ == "__main__":
    main()
