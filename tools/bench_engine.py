"""Engine throughput vs HF transformers, and TTFT with vs without a cached prefix.

One command, both sides in the same process on the same weights (the builtin
model's, loaded into HF ``LlamaForCausalLM`` as well):

    python tools/bench_engine.py

1. Throughput: N requests (prompt lengths uniform in [min, max], M output
   tokens each, greedy, EOS ignored). Ours: all submitted at once to an
   EngineCore. HF: ``generate`` over left-padded batches of prompts sorted by
   length (least padding), at each batch size of ``--hf-batch-sizes``; the best
   one is the baseline. Prints output tokens/s of each and the ratio.
2. Prefix reuse: TTFT of a 1,024-token prompt whose first 960 tokens are in
   the prefix cache vs the same-length prompt with nothing cached; medians of
   several alternating runs, and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass

import torch

from mooncaked.config import Config, with_overrides
from mooncaked.engine.core import EngineCore
from mooncaked.engine.loader import LoadedModel, load_model
from mooncaked.process import tune_process
from mooncaked.request import SamplingParams


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_len: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.prompts) * self.output_len


def make_workload(n: int, lo: int, hi: int, output_len: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(32, 127) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return Workload(prompts, output_len)


def engine_config(args: argparse.Namespace) -> Config:
    return with_overrides(
        Config(),
        model={"cpu_threads": args.cpu_threads},
        scheduler={
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_waiting": 4096,
        },
    )


async def run_ours(loaded: LoadedModel, cfg: Config, wl: Workload) -> tuple[float, list[list[int]]]:
    engine = EngineCore(cfg, loaded)
    await engine.start()
    sp = SamplingParams(max_tokens=wl.output_len, temperature=0.0, ignore_eos=True)
    # Warm-up outside the timed region (first-call allocations, thread start).
    async for _ in engine.add_request(wl.prompts[0][:16], SamplingParams(max_tokens=4)):
        pass

    async def one(prompt: list[int]) -> list[int]:
        ids: list[int] = []
        async for out in engine.add_request(prompt, sp):
            ids += out.new_token_ids
        return ids

    t0 = time.perf_counter()
    outputs = await asyncio.gather(*(one(p) for p in wl.prompts))
    elapsed = time.perf_counter() - t0
    await engine.close()
    return elapsed, list(outputs)


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
    return model.to(torch.float32).eval()


def run_hf(
    model: torch.nn.Module, wl: Workload, batch_size: int
) -> tuple[float, dict[int, list[int]]]:
    order = sorted(range(len(wl.prompts)), key=lambda i: len(wl.prompts[i]))
    outputs: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(wl.prompts[i]) for i in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = wl.prompts[i]
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=wl.output_len,
                min_new_tokens=wl.output_len,
                do_sample=False,
                pad_token_id=0,
            )
        for row, i in enumerate(idx):
            outputs[i] = out[row, width:].tolist()
    return time.perf_counter() - t0, outputs


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch-sizes", default="8,16,32,64")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--prefix-runs", type=int, default=5)
    ap.add_argument(
        "--cpu-threads",
        type=int,
        default=0,
        help="torch threads for both sides (0: the engine's default, cores - 1)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()

    cfg = engine_config(args)
    # The daemon's process settings (threads, allocator), applied as its entry
    # point does: HF runs under the same ones.
    tune_process(cfg.model)
    loaded = load_model(cfg.model)
    print(
        f"model {loaded.served_name}: {sum(p.numel() for p in loaded.model.parameters()) / 1e6:.1f}M "
        f"params, {loaded.dtype}, torch threads {torch.get_num_threads()}"
    )
    if not args.skip_throughput:
        wl = make_workload(
            args.requests, args.min_prompt, args.max_prompt, args.output_len, args.seed
        )
        print(
            f"workload: {args.requests} requests, prompts {args.min_prompt}..{args.max_prompt} "
            f"tokens, {args.output_len} output tokens each"
        )
        ours_s, ours_out = asyncio.run(run_ours(loaded, cfg, wl))
        ours_tps = wl.num_output_tokens / ours_s
        print(f"  mooncaked engine: {ours_s:7.2f} s  {ours_tps:9.1f} output tok/s")
        model = hf_model(loaded)
        best: tuple[float, int, dict[int, list[int]]] | None = None
        for bs in (int(x) for x in args.hf_batch_sizes.split(",")):
            hf_s, hf_out = run_hf(model, wl, bs)
            print(
                f"  HF generate (batch {bs:3d}): {hf_s:7.2f} s  "
                f"{wl.num_output_tokens / hf_s:9.1f} output tok/s"
            )
            if best is None or hf_s < best[0]:
                best = (hf_s, bs, hf_out)
        assert best is not None
        hf_tps = wl.num_output_tokens / best[0]
        same = sum(1 for i, o in enumerate(ours_out) if best[2][i] == o)
        print(
            f"  throughput ratio (ours / best HF, batch {best[1]}): {ours_tps / hf_tps:.2f}x   "
            f"(goal >= 3x); greedy outputs identical for {same}/{len(ours_out)} requests"
        )
    asyncio.run(prefix_bench(loaded, cfg, args.prefix_runs, args.seed + 1))


if __name__ == "__main__":
    main()
