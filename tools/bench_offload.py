"""Decode throughput with attention local and offloaded to a memory node, side by side.

    python tools/bench_offload.py [--model builtin:tiny] [--contexts 1000,4000]
        [--batches 1,4,16] [--steps 8] [--compute-cpu 0] [--memory-cpu 1]

For each context length and batch size it times decode steps of one runner
(the engine's model runner, one CPU core, one thread) three ways: attention
local (the baseline), offloaded to a memory node in another process on
another core with one micro-batch, and with two (staggered). The context is
random KV written into the local cache; the memory node receives it as an
upload during a warm-up step that is not timed, after which the sequences'
local blocks go back to a block pool (as the engine's scheduler frees them)
and the timed steps read no local KV. It prints decode tokens/s, the ratio
to the local run of the same shape, the bytes sent and received per step,
the overlap (the share of the layers' time in flight that the compute
thread did not wait for: what micro-batching hides), and the compute
node's KV pool blocks in use during the timed steps.
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
from mooncaked.engine.kv_pool import BlockPool
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


def _plan(batch: int, ctx: int, step: int, tables: dict[str, list[int]] | None) -> StepPlan:
    """One decode a sequence; ``tables`` None: their KV is on the memory node."""
    chunks = [
        ScheduledChunk(
            request_id=f"seq{i}",
            token_ids=[3 + (i + step) % 200],
            start_pos=ctx + step,
            block_ids=tables[f"seq{i}"] if tables is not None else [],
            sample=True,
            kv_remote=tables is None,
        )
        for i in range(batch)
    ]
    return StepPlan(chunks=chunks)


def _time_steps(
    runner: ModelRunner, batch: int, ctx: int, steps: int, tables: dict[str, list[int]] | None
) -> float:
    """Seconds of steps 1..steps (step 0, the warm-up, ran before)."""
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        runner.execute(_plan(batch, ctx, s, tables))
    return time.perf_counter() - t0


Row = tuple[str, float, float, float, int]


def _run_shape(
    runner: ModelRunner, config: Config, port: int, batch: int, ctx: int, steps: int
) -> list[Row]:
    """(mode, tok/s, bytes a step, overlap, pool blocks in use) for local, 1
    and 2 micro-batches."""
    per_seq = -(-(ctx + steps + 2) // BLOCK)
    pool = BlockPool(runner.num_blocks, enable_prefix_caching=False)
    runner.kv_buffer.normal_()
    rows: list[Row] = []
    runner.offload = None
    tables = _allocate(pool, batch, per_seq)
    runner.execute(_plan(batch, ctx, 0, tables))
    secs = _time_steps(runner, batch, ctx, steps, tables)
    rows.append(("local", batch * steps / secs, 0.0, 0.0, pool.num_used_blocks))
    for micro in (1, 2):
        cfg = with_overrides(
            config,
            # The memory node lays out its pool (GBs at long contexts) on
            # the first HELLO: past the default 5 s on one core.
            offload={
                "memory_node": f"127.0.0.1:{port}",
                "micro_batches": micro,
                "timeout_s": 300.0,
            },
        )
        offload = offload_for(cfg, runner.arch, runner.dtype, BLOCK)
        runner.offload = offload
        try:
            # Connect and upload from the local blocks; then, as the
            # scheduler does, the moved sequences' blocks go back.
            out = runner.run(_plan(batch, ctx, 0, tables))
            if sorted(out.kv_moved) != sorted(tables):
                raise RuntimeError(f"memory node failed: {offload.stats.last_error}")
            for ids in tables.values():
                pool.free(ids)
            st = offload.stats
            sent0, recv0, wait0, flight0 = st.bytes_sent, st.bytes_received, st.wait_s, st.flight_s
            secs = _time_steps(runner, batch, ctx, steps, None)
            if st.failures:
                raise RuntimeError(f"memory node failed: {offload.stats.last_error}")
            moved = (st.bytes_sent - sent0 + st.bytes_received - recv0) / steps
            flight = st.flight_s - flight0
            overlap = 1 - (st.wait_s - wait0) / flight if flight > 0 else 0.0
            in_use = pool.num_used_blocks
            rows.append(
                (f"offload x{micro}", batch * steps / secs, moved, max(0.0, overlap), in_use)
            )
        finally:
            offload.close()
            runner.offload = None
        # The next mode starts from local KV again (the memory node forgot
        # this connection's sequences when it closed).
        tables = _allocate(pool, batch, per_seq)
    return rows


def _allocate(pool: BlockPool, batch: int, per_seq: int) -> dict[str, list[int]]:
    tables: dict[str, list[int]] = {}
    for i in range(batch):
        ids = pool.allocate(per_seq)
        if ids is None:
            raise RuntimeError("the bench's block pool is too small")
        tables[f"seq{i}"] = ids
    return tables


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
              f"{'KiB/step':>9} {'overlap':>7} {'blocks':>6}")  # fmt: skip
        for ctx in contexts:
            for batch in batches:
                rows = _run_shape(runner, config, port, batch, ctx, args.steps)
                base = rows[0][1]
                for mode, tps, moved, overlap, in_use in rows:
                    print(f"{ctx:>6} {batch:>5} {mode:<11} {tps:>9.1f} {tps / base:>7.2f}x "
                          f"{moved / 1024:>9.1f} {overlap:>7.0%} {in_use:>6}", flush=True)  # fmt: skip
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
