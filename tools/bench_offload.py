"""Decode throughput with attention local and offloaded to a memory node, side by side.

    python tools/bench_offload.py [--model builtin:tiny] [--contexts 1000,4000]
        [--batches 1,4,16] [--steps 8] [--compute-cpu 0] [--memory-cpu 1]

For each context length and batch size it times decode steps of one runner
(the engine's model runner, one CPU core, one thread) three ways: attention
local (the baseline), offloaded to a memory node in another process on
another core with one micro-batch, and with two (staggered). The context is
random KV written into the local cache; the memory node receives it as an
upload during a warm-up step that is not timed. It prints decode tokens/s,
the ratio to the local run of the same shape, the bytes sent and received
per step, and the overlap: the share of the layers' time in flight that the
compute thread did not wait for (what micro-batching hides).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import socket
import sys
import time

import structlog
import torch

from mooncaked.config import Config, ModelConfig, OffloadConfig, with_overrides
from mooncaked.engine.loader import load_model
from mooncaked.engine.offload import offload_for
from mooncaked.engine.offload.server import AttentionServer
from mooncaked.engine.plan import ScheduledChunk, StepPlan
from mooncaked.engine.runner import ModelRunner

SECRET = "bench-offload-secret"
BLOCK = 16


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)


def _memory_main(port: int, cpu: int, pool_bytes: int) -> None:
    _pin(cpu)
    # Its connection notices would interleave with the table.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    async def serve() -> None:
        server = AttentionServer(
            node_id="bench-memory",
            secret=SECRET.encode(),
            host="127.0.0.1",
            port=port,
            pool_bytes=pool_bytes,
            threads=1,
        )
        async with server:
            await asyncio.Event().wait()

    asyncio.run(serve())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _plan(batch: int, ctx: int, step: int, blocks_per_seq: int) -> StepPlan:
    chunks = [
        ScheduledChunk(
            request_id=f"seq{i}",
            token_ids=[3 + (i + step) % 200],
            start_pos=ctx + step,
            block_ids=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
            sample=True,
        )
        for i in range(batch)
    ]
    return StepPlan(chunks=chunks)


def _time_steps(runner: ModelRunner, batch: int, ctx: int, steps: int, per_seq: int) -> float:
    """Seconds of steps 1..steps (step 0, the warm-up, ran before)."""
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        runner.execute(_plan(batch, ctx, s, per_seq))
    return time.perf_counter() - t0


def _run_shape(
    runner: ModelRunner, config: Config, port: int, batch: int, ctx: int, steps: int
) -> list[tuple[str, float, float, float]]:
    """(mode, tok/s, bytes a step, overlap) for local, 1 and 2 micro-batches."""
    per_seq = -(-(ctx + steps + 2) // BLOCK)
    runner.kv_buffer.normal_()
    rows: list[tuple[str, float, float, float]] = []
    runner.offload = None
    runner.execute(_plan(batch, ctx, 0, per_seq))
    secs = _time_steps(runner, batch, ctx, steps, per_seq)
    rows.append(("local", batch * steps / secs, 0.0, 0.0))
    for micro in (1, 2):
        cfg = with_overrides(
            config, offload={"memory_node": f"127.0.0.1:{port}", "micro_batches": micro}
        )
        offload = offload_for(cfg, runner.arch, runner.dtype, BLOCK)
        runner.offload = offload
        try:
            runner.execute(_plan(batch, ctx, 0, per_seq))  # connect and upload
            st = offload.client.stats
            sent0, recv0, wait0, flight0 = st.bytes_sent, st.bytes_received, st.wait_s, st.flight_s
            secs = _time_steps(runner, batch, ctx, steps, per_seq)
            if st.failures:
                raise RuntimeError(f"memory node failed: {offload.client.last_error}")
            moved = (st.bytes_sent - sent0 + st.bytes_received - recv0) / steps
            flight = st.flight_s - flight0
            overlap = 1 - (st.wait_s - wait0) / flight if flight > 0 else 0.0
            rows.append((f"offload x{micro}", batch * steps / secs, moved, max(0.0, overlap)))
        finally:
            offload.close()
            runner.offload = None
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="builtin:tiny")
    # builtin:tiny holds 4,096 positions: longer contexts need a model that does.
    p.add_argument("--contexts", default="1000,4000")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--compute-cpu", type=int, default=0)
    p.add_argument("--memory-cpu", type=int, default=1)
    args = p.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    config = Config(model=ModelConfig(path=args.model), offload=OffloadConfig())
    config = with_overrides(config, node={"cluster_secret": SECRET})
    _pin(args.compute_cpu)
    loaded = load_model(config.model)
    per_seq = -(-(max(contexts) + args.steps + 2) // BLOCK)
    num_blocks = max(batches) * per_seq
    runner = ModelRunner(loaded, num_blocks, BLOCK, backend="sdpa", cuda_graphs="off")
    pool_bytes = runner.kv_buffer.numel() * runner.kv_buffer.element_size() + (16 << 20)
    port = _free_port()
    ctx_mp = mp.get_context("spawn")
    memory = ctx_mp.Process(
        target=_memory_main, args=(port, args.memory_cpu, pool_bytes), daemon=True
    )
    memory.start()
    try:
        _wait_port(port)
        print(f"model {args.model}: {loaded.arch.num_layers} layers, "
              f"{loaded.arch.num_kv_heads} kv heads x {loaded.arch.head_dim}, {loaded.dtype}; "
              f"compute cpu {args.compute_cpu}, memory cpu {args.memory_cpu}, 1 thread each")  # fmt: skip
        print(f"{'ctx':>6} {'batch':>5} {'mode':<11} {'tok/s':>9} {'vs local':>8} "
              f"{'KiB/step':>9} {'overlap':>7}")  # fmt: skip
        for ctx in contexts:
            for batch in batches:
                rows = _run_shape(runner, config, port, batch, ctx, args.steps)
                base = rows[0][1]
                for mode, tps, moved, overlap in rows:
                    print(f"{ctx:>6} {batch:>5} {mode:<11} {tps:>9.1f} {tps / base:>7.2f}x "
                          f"{moved / 1024:>9.1f} {overlap:>7.0%}", flush=True)  # fmt: skip
    finally:
        memory.kill()
        memory.join()
    return 0


def _wait_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("the memory node did not start")


if __name__ == "__main__":
    sys.exit(main())
