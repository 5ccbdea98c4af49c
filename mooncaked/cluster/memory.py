"""A memory node as gossip tells it, and how fast its attention reads KV.

A memory node loads no model and runs no engine: what placement needs of it
is its attention service's address, its KV pool's room and use, and the
bandwidth its attention reads KV at. The pool's shape is unknown until the
first compute node connects (it says the model's KV shape), so the
bandwidth is measured at start-up on a synthetic context, with the engine's
paged attention on the CPU threads that serve compute nodes later.

A compute node with ``offload.memory_node = "auto"`` tells its KV shape
(``OffloadInfo``): it prices the q/k/v traffic and says which memory nodes
it may use (those of its shape, or none laid out yet).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from mooncaked.cluster.state import AttentionShape, MemoryInfo, NodeLoad, OffloadInfo
from mooncaked.engine.attention import PagedKV, SdpaBackend, build_metadata
from mooncaked.engine.offload.wire import KVShape, dtype_name

if TYPE_CHECKING:
    from mooncaked.config import Config
    from mooncaked.engine.core import EngineCore
    from mooncaked.engine.offload.server import AttentionServer

# The synthetic context of the start-up probe: a decode batch of 8 sequences
# of 1,024 tokens, one layer of a GQA model (16 query heads on 4 KV heads of
# 64), float32: 16 MiB of KV a call, enough to leave the caches behind.
PROBE_SHAPE = KVShape(
    num_layers=1, num_heads=16, num_kv_heads=4, head_dim=64, dtype="float32", block_size=16
)
PROBE_SEQS = 8
PROBE_TOKENS = 1024
PROBE_REPEATS = 3


def attention_shape(shape: KVShape) -> AttentionShape:
    return AttentionShape(
        shape.num_layers,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.dtype,
        shape.block_size,
    )


def measure_kv_read_bps(
    shape: KVShape = PROBE_SHAPE,
    *,
    num_seqs: int = PROBE_SEQS,
    context_tokens: int = PROBE_TOKENS,
    repeats: int = PROBE_REPEATS,
) -> float:
    """Bytes of KV per second one decode step's attention reads here: the
    best of ``repeats`` calls (the first warms the kernels up too)."""
    bs = shape.block_size
    blocks_each = -(-(context_tokens + 1) // bs)
    cache = torch.randn(
        (2, num_seqs * blocks_each, bs, shape.num_kv_heads, shape.head_dim),
        dtype=shape.torch_dtype,
    )
    backend = SdpaBackend(shape.num_heads, shape.num_kv_heads, shape.head_dim)
    meta = build_metadata(
        query_lens=[1] * num_seqs,
        start_positions=[context_tokens] * num_seqs,
        block_tables=[list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(num_seqs)],
        block_size=bs,
        device=torch.device("cpu"),
        backend=backend,
        dtype=shape.torch_dtype,
    )
    q = torch.randn((num_seqs, shape.num_heads, shape.head_dim), dtype=shape.torch_dtype)
    kv = torch.randn((2, num_seqs, shape.num_kv_heads, shape.head_dim), dtype=shape.torch_dtype)
    read = num_seqs * (context_tokens + 1) * shape.token_kv_bytes() / shape.num_layers
    best = float("inf")
    with torch.inference_mode():
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            backend.forward(q, PagedKV(kv[0], kv[1], cache[0], cache[1]), meta)
            best = min(best, time.perf_counter() - t0)
    return read / best if best > 0.0 else 0.0


def memory_info(
    server: AttentionServer, address: str, kv_read_bps: float, model: str
) -> MemoryInfo:
    """A memory node's gossiped figures, read off its attention service
    (reached at ``address``: the host peers reach, not the one it binds)."""
    kv = server.kv
    if kv is None:
        # Not laid out: the whole pool is room, in the first model's blocks.
        total = free = server.pool_bytes
        shape = None
    else:
        block_bytes = kv.shape.token_kv_bytes() * kv.block_size
        total, free = kv.num_blocks * block_bytes, kv.num_free * block_bytes
        shape = attention_shape(kv.shape)
    return MemoryInfo(
        attention_addr=address,
        total_bytes=total,
        free_bytes=free,
        num_seqs=len(kv.seqs) if kv is not None else 0,
        kv_read_bps=kv_read_bps,
        model=model,
        shape=shape,
    )


def memory_load(server: AttentionServer) -> NodeLoad:
    """A memory node's KV use as load: sequences served, pool used, context held."""
    held = server.load()
    total = held["num_blocks"]
    return NodeLoad(
        running_decode_batch=int(held["num_seqs"]),
        kv_usage=(total - held["num_free_blocks"]) / total if total else 0.0,
        decode_context_tokens=int(held["num_tokens"]),
    )


def offload_info(config: Config, engine: EngineCore) -> OffloadInfo | None:
    """What a compute node tells placement of its offloading (None: placement
    does not offload it, ``offload.memory_node`` is not "auto")."""
    cfg = config.offload
    if not cfg.placed:
        return None
    arch, dtype = engine.loaded.arch, engine.loaded.dtype
    shape = AttentionShape(
        arch.num_layers,
        arch.num_heads,
        arch.num_kv_heads,
        arch.head_dim,
        dtype_name(dtype),
        engine.block_size,
    )
    return OffloadInfo(shape, cfg.micro_batches)
