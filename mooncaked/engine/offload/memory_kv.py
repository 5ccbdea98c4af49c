"""A memory node's KV: paged blocks in DRAM, the sequences of its compute nodes.

The layout is the engine's (per layer, K and V as ``[num_blocks, block_size,
kv_heads, head_dim]``), so the engine's paged attention reads it unchanged.
A sequence is keyed by ``(peer, key)``: a compute node reaches only its own.
Blocks are allocated as a sequence grows and freed when its peer drops it,
uploads it again, or leaves (every connection of that peer closed).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from mooncaked.engine.offload.wire import KVShape

SeqId = tuple[str, str]


@dataclass(slots=True)
class MemorySeq:
    block_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the blocks: the next step must start here.
    num_tokens: int = 0


class MemoryKV:
    def __init__(self, shape: KVShape, pool_bytes: int) -> None:
        block_bytes = shape.token_kv_bytes() * shape.block_size
        num_blocks = pool_bytes // block_bytes
        if num_blocks <= 0:
            raise ValueError(
                f"offload.pool_bytes = {pool_bytes} holds no block of {block_bytes} bytes"
            )
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = shape.block_size
        self.buffer = torch.zeros(
            (shape.num_layers, 2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim),
            dtype=shape.torch_dtype,
        )
        self._free: deque[int] = deque(range(num_blocks))
        self.seqs: dict[SeqId, MemorySeq] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.buffer[i, 0], self.buffer[i, 1]

    def can_extend(self, seq: MemorySeq, num_tokens: int) -> bool:
        return self._blocks_needed(seq, num_tokens) <= len(self._free)

    def _blocks_needed(self, seq: MemorySeq, num_tokens: int) -> int:
        need = -(-num_tokens // self.block_size)
        return max(0, need - len(seq.block_ids))

    def extend(self, seq: MemorySeq, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` tokens in all; False (nothing taken) when too few are free."""
        extra = self._blocks_needed(seq, num_tokens)
        if extra > len(self._free):
            return False
        seq.block_ids.extend(self._free.popleft() for _ in range(extra))
        return True

    def open(self, sid: SeqId) -> MemorySeq:
        """A fresh sequence under ``sid`` (one there before is freed)."""
        self.drop(sid)
        seq = MemorySeq()
        self.seqs[sid] = seq
        return seq

    def drop(self, sid: SeqId) -> None:
        seq = self.seqs.pop(sid, None)
        if seq is not None:
            self._free.extend(seq.block_ids)

    def drop_peer(self, peer: str) -> int:
        """Free every sequence of ``peer``; how many there were."""
        sids = [sid for sid in self.seqs if sid[0] == peer]
        for sid in sids:
            self.drop(sid)
        return len(sids)

    def write(self, seq: MemorySeq, kv: torch.Tensor) -> None:
        """``kv`` [layers, 2, n, kv_heads, head_dim]: the sequence's first n tokens."""
        n = kv.shape[2]
        slots = self.slots(seq, 0, n)
        flat = self.buffer.view(
            self.shape.num_layers, 2, -1, self.shape.num_kv_heads, self.shape.head_dim
        )
        flat.index_copy_(2, slots, kv)
        seq.num_tokens = n

    def slots(self, seq: MemorySeq, start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor(
            [seq.block_ids[p // bs] * bs + p % bs for p in range(start, end)], dtype=torch.int64
        )

    def check_integrity(self) -> None:
        """free + held == total, no block twice; RuntimeError otherwise."""
        held = [b for seq in self.seqs.values() for b in seq.block_ids]
        every = held + list(self._free)
        if len(every) != self.num_blocks or len(set(every)) != self.num_blocks:
            raise RuntimeError(
                f"memory KV: {len(self._free)} free + {len(held)} held != {self.num_blocks}"
            )
