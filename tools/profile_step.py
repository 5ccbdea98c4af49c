"""Where an engine step's time goes: decode steps at one batch size, timed and profiled.

    python tools/profile_step.py --batch 1
    python tools/profile_step.py --batch 16 --prompt-len 384 --profile-steps 3
    python tools/profile_step.py --batch 16 --prompt-len 256 --prompt-spread 0.5
    python tools/profile_step.py --batch 4 --prompt-len 64 --shared-prefix 1024 --cascade off

The engine runs as the daemon runs it (``tune_process``, the model's
defaults, the engine's own step thread), with no HTTP in front: ``--batch``
requests of ``--prompt-len`` token ids decode ``--max-tokens`` tokens
together after a warm-up round. Printed: the median and the fastest of the
steps in which exactly ``--batch`` requests decoded one token each, and the
share of CPU time of the heaviest operators over ``--profile-steps`` of those
steps under ``torch.profiler``. A served token's time (``mooncakectl bench``'s
TPOT) minus the engine's per-token time (the step plus the engine loop's
scheduling and output processing) is what the HTTP front and streaming cost.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import statistics
import sys
import time
from typing import Any

import structlog
import torch

from mooncaked import process
from mooncaked.config import config_from_dict
from mooncaked.engine import attention
from mooncaked.engine import runner as runner_mod
from mooncaked.engine.bundled import default_model_path
from mooncaked.engine.core import EngineCore
from mooncaked.engine.loader import load_model
from mooncaked.engine.plan import StepPlan
from mooncaked.request import SamplingParams


class StepProbe:
    """Wraps ``ModelRunner.run``: times every step, profiles some decode steps of ``batch``."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.on = False
        self.to_profile = 0
        self.decode_s: list[float] = []
        self.profiles: list[torch.profiler.profile] = []
        # Seconds between a request's outputs as the caller sees them: the
        # step plus the engine loop's own work (no HTTP).
        self.token_gaps_s: list[float] = []

    def install(self) -> None:
        original = runner_mod.ModelRunner.run
        probe = self

        def run(runner: Any, plan: StepPlan, connector: Any = None) -> Any:
            decode = len(plan.chunks) == probe.batch and all(
                len(c.token_ids) == 1 for c in plan.chunks
            )
            if not (probe.on and decode):
                return original(runner, plan, connector)
            if probe.to_profile > 0:
                probe.to_profile -= 1
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                    out = original(runner, plan, connector)
                probe.profiles.append(p)
                return out
            t0 = time.perf_counter()
            out = original(runner, plan, connector)
            probe.decode_s.append(time.perf_counter() - t0)
            return out

        runner_mod.ModelRunner.run = run  # type: ignore[method-assign]

    def op_shares(self, top: int) -> list[tuple[str, float]]:
        per_op: collections.Counter[str] = collections.Counter()
        for p in self.profiles:
            for event in p.key_averages():
                per_op[event.key] += event.self_cpu_time_total
        total = sum(per_op.values()) or 1.0
        return [(name, t / total) for name, t in per_op.most_common(top)]


async def drive(engine: EngineCore, probe: StepProbe, args: argparse.Namespace) -> None:
    vocab = engine.loaded.arch.vocab_size

    spread = random.Random(args.seed)
    shared = [(104729 + 31 * j) % (vocab - 1) + 1 for j in range(args.shared_prefix)]

    async def one(i: int, max_tokens: int) -> None:
        # Distinct prompts past the shared prefix: no request reuses another's
        # cached blocks beyond it. Ids from 1 up skip the usual special tokens at 0.
        lo = round(args.prompt_len * (1 - args.prompt_spread))
        hi = round(args.prompt_len * (1 + args.prompt_spread))
        n = spread.randint(max(1, lo), max(1, hi))
        ids = shared + [(7919 * i + 31 * j) % (vocab - 1) + 1 for j in range(n)]
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        last: float | None = None
        async for _ in engine.add_request(ids, sampling, f"req-{i}"):
            now = time.perf_counter()
            if last is not None and probe.on:
                probe.token_gaps_s.append(now - last)
            last = now

    await engine.start()
    try:
        await asyncio.gather(*(one(i, 8) for i in range(args.batch)))  # warm-up
        probe.on, probe.to_profile = True, args.profile_steps
        base = args.batch
        await asyncio.gather(*(one(base + i, args.max_tokens) for i in range(args.batch)))
    finally:
        await engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model.path (default: the bundled model)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--prompt-spread",
        type=float,
        default=0.0,
        help="prompt lengths drawn from prompt-len x (1 +- this), e.g. 0.5 as bench random's",
    )
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="tokens every prompt starts with (held once by the prefix cache)",
    )
    parser.add_argument(
        "--cascade",
        choices=("on", "off"),
        default="on",
        help="off: decodes sharing prompt blocks attend to them one by one",
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        help="model.attention_backend (vllm-cpu: vLLM's CPU kernel for decodes)",
    )
    parser.add_argument(
        "--vllm-cpu-library",
        default="",
        help="model.vllm_cpu_library: vLLM's _C*.abi3.so or its package directory",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument(
        "--threads", type=int, default=0, help="model.cpu_threads (default 0: the daemon's choice)"
    )
    args = parser.parse_args()
    if args.threads < 0:
        parser.error(f"--threads must be 0 or more, not {args.threads}")
    if not 0.0 <= args.prompt_spread < 1.0:
        parser.error(f"--prompt-spread must be in [0, 1), not {args.prompt_spread}")
    if args.shared_prefix < 0:
        parser.error(f"--shared-prefix must be 0 or more, not {args.shared_prefix}")
    if args.cascade == "off":
        # No run of shared blocks is ever long enough.
        attention._MIN_SHARED_BLOCKS = sys.maxsize
    for name in ("batch", "prompt_len", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}"
            )

    # The engine's log lines go to stderr: stdout is the report.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    config = config_from_dict(
        {
            "model": {
                "path": args.model or default_model_path(),
                "cpu_threads": args.threads,
                "attention_backend": args.attention_backend,
                "vllm_cpu_library": args.vllm_cpu_library,
            }
        }
    )
    process.tune_process(config.model)
    loaded = load_model(config.model)
    probe = StepProbe(args.batch)
    probe.install()
    asyncio.run(drive(EngineCore(config, loaded), probe, args))

    steps = sorted(probe.decode_s)
    if not steps:
        raise SystemExit(f"no step decoded exactly {args.batch} requests together")
    print(
        f"{config.model.path}: {loaded.dtype}, {process.compute_threads()} compute threads, "
        f"{args.attention_backend} attention, "
        f"batch {args.batch}, prompts of {args.prompt_len} +-{args.prompt_spread:.0%}"
        f" after a shared prefix of {args.shared_prefix}, cascade {args.cascade}"
    )
    print(
        f"decode step: median {statistics.median(steps) * 1e3:.1f} ms, "
        f"fastest {steps[0] * 1e3:.1f} ms over {len(steps)} steps"
    )
    # Profiled steps are slower and land among the gaps: the median is robust to them.
    print(f"engine per token: median {statistics.median(probe.token_gaps_s) * 1e3:.1f} ms")
    print(f"CPU time by operator over {len(probe.profiles)} profiled steps:")
    for name, share in probe.op_shares(args.top):
        print(f"  {name:56s} {share * 100:5.1f}%")


if __name__ == "__main__":
    main()
