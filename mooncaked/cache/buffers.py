"""Where the tiered store's blocks come from and go: device KV blocks or host rows.

A source of an offload or a target of a load is either ``DeviceBlocks`` (block
ids of a device KV cache) or a uint8 ``[n, block_bytes]`` host tensor whose row
``i`` pairs with ``hashes[i]``. This module checks such a buffer and copies
between it and the DRAM pool's slots; the copies run in the store's copy
threads, never on the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mooncaked.cache.dram import DramPool
from mooncaked.cache.layout import BlockLayout, KVCaches, gather_blocks, scatter_blocks
from mooncaked.cache.tiers import Tier


@dataclass(frozen=True, slots=True)
class DeviceBlocks:
    """Blocks of a device KV cache: the source of an offload or the target of a load.

    ``block_ids[i]`` pairs with ``hashes[i]`` of the call it is passed to.
    """

    kv_caches: KVCaches
    block_ids: Sequence[int]


# A uint8 [n, block_bytes] host tensor works as a source or target too (row i
# pairs with hashes[i]).
BlockBuffer = DeviceBlocks | torch.Tensor

# Where a loaded block is copied from: (tier it came from, DRAM slot or staging row).
Source = tuple[Tier, int | torch.Tensor]


def check_buffer(buf: BlockBuffer, n: int, name: str, layout: BlockLayout) -> None:
    """ValueError unless ``buf`` is a block buffer of ``layout`` for ``n`` hashes."""
    if isinstance(buf, DeviceBlocks):
        if len(buf.block_ids) != n:
            raise ValueError(f"{name} has {len(buf.block_ids)} block ids for {n} hashes")
        layout.check_kv_caches(buf.kv_caches)
        return
    if not isinstance(buf, torch.Tensor):
        raise ValueError(f"{name} must be DeviceBlocks or a uint8 tensor, got {type(buf)}")
    block_bytes = layout.block_bytes
    if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != block_bytes:
        raise ValueError(
            f"{name} must be a uint8 tensor [n, {block_bytes}], got {buf.dtype} {tuple(buf.shape)}"
        )
    if buf.shape[0] != n:
        raise ValueError(f"{name} has {buf.shape[0]} rows for {n} hashes")
    if buf.device.type != "cpu":
        raise ValueError(f"{name} as a tensor must be on the CPU; use DeviceBlocks otherwise")


def copy_in(
    src: BlockBuffer,
    dram: DramPool,
    rows: list[int],
    slots: list[int],
    overflow: list[int],
    staged: torch.Tensor,
) -> None:
    """Worker thread: src rows -> DRAM slots, overflow rows -> staging rows."""
    for src_rows, out, out_rows in ((rows, dram.slots, slots), (overflow, staged, None)):
        if not src_rows:
            continue
        if isinstance(src, DeviceBlocks):
            gather_blocks(src.kv_caches, [src.block_ids[i] for i in src_rows], out, out_rows)
        else:
            copy_rows(src, src_rows, out, out_rows or list(range(len(src_rows))))


def copy_out(sources: list[Source], dram: DramPool, dst: BlockBuffer) -> None:
    """Worker thread: sources (DRAM slots or staging buffers) -> dst rows 0..n-1."""
    slot_pos: list[int] = []
    slot_ids: list[int] = []
    staged_pos: list[int] = []
    staged_bufs: list[torch.Tensor] = []
    for i, (_, src) in enumerate(sources):
        if isinstance(src, int):
            slot_pos.append(i)
            slot_ids.append(src)
        else:
            staged_pos.append(i)
            staged_bufs.append(src)
    staged = torch.stack(staged_bufs) if staged_bufs else None
    if isinstance(dst, DeviceBlocks):
        if slot_pos:
            scatter_blocks(
                dst.kv_caches, [dst.block_ids[i] for i in slot_pos], dram.slots, slot_ids
            )
        if staged is not None:
            scatter_blocks(dst.kv_caches, [dst.block_ids[i] for i in staged_pos], staged)
        return
    if slot_pos:
        copy_rows(dram.slots, slot_ids, dst, slot_pos)
    if staged is not None:
        copy_rows(staged, list(range(len(staged_pos))), dst, staged_pos)


def copy_rows(
    src: torch.Tensor, src_rows: list[int], dst: torch.Tensor, dst_rows: list[int]
) -> None:
    """dst[dst_rows] = src[src_rows] for uint8 [n, block_bytes] host tensors."""
    # numpy's fancy indexing copies rows at memcpy speed; torch's index ops
    # are several times slower on CPU (tools/bench_cache.py).
    s = src.numpy()
    d = dst.numpy()
    d[np.asarray(dst_rows, dtype=np.intp)] = s[np.asarray(src_rows, dtype=np.intp)]
