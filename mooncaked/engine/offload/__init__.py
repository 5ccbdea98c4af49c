"""Attention offloading: decode attention on memory nodes that hold the KV.

``wire`` is the protocol; ``client`` and ``forward`` a compute node's side
(the step thread calls the memory node once a layer); ``memory_kv`` and
``server`` a memory node's (no weights, a DRAM pool of paged KV, the
engine's paged attention on its CPU threads).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from mooncaked.config import Config
from mooncaked.engine.model import ModelArch
from mooncaked.engine.offload.client import AttentionClient, ClientStats
from mooncaked.engine.offload.clients import ClientPool
from mooncaked.engine.offload.direct import DirectHandoff
from mooncaked.engine.offload.forward import OffloadedAttention
from mooncaked.engine.offload.wire import KVShape, dtype_name

if TYPE_CHECKING:
    # The runner imports this package: only the annotation needs it.
    from mooncaked.engine.runner import ModelRunner

__all__ = [
    "AttentionClient",
    "ClientPool",
    "DirectHandoff",
    "KVShape",
    "OffloadedAttention",
    "attach_offload",
    "offload_for",
]


def offload_for(
    config: Config, arch: ModelArch, dtype: torch.dtype, block_size: int
) -> OffloadedAttention:
    """A compute node's offloaded attention: to ``offload.memory_node``, or
    ("auto") to the memory node placement chose for each request."""
    cfg = config.offload
    shape = KVShape(
        num_layers=arch.num_layers,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        dtype=dtype_name(dtype),
        block_size=block_size,
    )
    # One id per process: a restarted node's old sequences are freed, not
    # mixed with its new ones.
    node_id = f"{config.node_id}#{os.urandom(4).hex()}"

    def connect(address: str, stats: ClientStats) -> AttentionClient:
        return AttentionClient(
            address,
            node_id=node_id,
            secret=config.node.cluster_secret.encode(),
            shape=shape,
            num_conns=cfg.micro_batches,
            timeout_s=cfg.timeout_s,
            retry_s=cfg.retry_s,
            stats=stats,
        )

    configured = "" if cfg.placed else cfg.memory_node
    offload = OffloadedAttention(
        ClientPool(connect, keep=configured), cfg.micro_batches, configured
    )
    # Prompts prefilled elsewhere go straight to the memory node.
    offload.direct = DirectHandoff(
        node_id,
        config.node.cluster_secret.encode(),
        shape,
        offload.clients,
        offload.address_for,
        cfg.timeout_s,
    )
    return offload


def attach_offload(config: Config, runner: ModelRunner) -> OffloadedAttention | None:
    """The runner's offloaded attention when ``offload.memory_node`` is set
    (a host:port, or "auto")."""
    if not (config.offload.enabled or config.offload.placed):
        return None
    offload = offload_for(config, runner.arch, runner.dtype, runner.block_size)
    runner.offload = offload
    return offload
