"""A memory node's KV: paged blocks in DRAM, the sequences of its compute nodes.

The layout is the engine's (per layer, K and V as ``[num_blocks, block_size,
kv_heads, head_dim]``), so the engine's paged attention reads it unchanged.
A sequence is keyed by ``(peer, key)``: a compute node reaches only its own.
Blocks are allocated as a sequence grows and freed when its peer drops it,
uploads it again, or leaves (every connection of that peer closed).

A prompt's KV may also be written here by a prefill node, under a grant
(the direct handoff): the blocks are ``reserve``d with a deadline, ``fill``ed
when the handoff ends, and ``claim``ed by the peer's first step. Until then
the sequence outlives its peer's connections and is freed at its deadline.
Blocks a writer may still reach (a reservation given up before it was
filled) are quarantined until its grant's deadline, never handed out sooner.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mooncaked.engine.offload.wire import KVShape
from mooncaked.handoff import KVLayout

SeqId = tuple[str, str]


@dataclass(slots=True)
class MemorySeq:
    block_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the blocks: the next step must start here.
    num_tokens: int = 0
    # A direct handoff's sequence not claimed by a step yet: freed then (0: a
    # claimed one, freed only when its peer drops it or leaves).
    deadline: float = 0.0
    # Reserved for a prefill node's writes, not yet told they landed.
    filling: bool = False


# nbytes -> a zeroed uint8 tensor (a transfer segment peers write under grants).
Allocator = Callable[[int], torch.Tensor]


class MemoryKV:
    def __init__(
        self,
        shape: KVShape,
        pool_bytes: int,
        *,
        allocate: Allocator | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        block_bytes = shape.token_kv_bytes() * shape.block_size
        num_blocks = pool_bytes // block_bytes
        if num_blocks <= 0:
            raise ValueError(
                f"offload.pool_bytes = {pool_bytes} holds no block of {block_bytes} bytes"
            )
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = shape.block_size
        dims = (shape.num_layers, 2, num_blocks, shape.block_size, shape.num_kv_heads)
        if allocate is None:
            self.buffer = torch.zeros((*dims, shape.head_dim), dtype=shape.torch_dtype)
        else:
            raw = allocate(num_blocks * block_bytes)
            self.buffer = raw.view(shape.torch_dtype).view(*dims, shape.head_dim)
        self.clock = clock
        self._free: deque[int] = deque(range(num_blocks))
        self.seqs: dict[SeqId, MemorySeq] = {}
        # (until, blocks): kept from everyone while a writer's grant may be live.
        self._quarantine: list[tuple[float, list[int]]] = []

    @property
    def layout(self) -> KVLayout:
        """The buffer as a prefill node addresses it: the same planes, blocks
        and rows as a compute node's KV segment (``KVLayout.offset``)."""
        s = self.shape
        row_bytes = s.num_kv_heads * s.head_dim * s.elem_bytes
        return KVLayout(s.num_layers, self.num_blocks, s.block_size, row_bytes)

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
        if seq is None:
            return
        if seq.filling:
            # A prefill node may still write them until its grant ends.
            self._quarantine.append((seq.deadline, seq.block_ids))
        else:
            self._free.extend(seq.block_ids)

    def drop_peer(self, peer: str) -> int:
        """Free every sequence of ``peer`` but those a direct handoff left for
        it to claim (they end at their deadline); how many were freed."""
        sids = [sid for sid, seq in self.seqs.items() if sid[0] == peer and not seq.deadline]
        for sid in sids:
            self.drop(sid)
        return len(sids)

    # -- direct handoff ----------------------------------------------------

    def reserve(self, sid: SeqId, num_tokens: int, until: float) -> MemorySeq | None:
        """Fresh blocks for a prompt of ``num_tokens`` a prefill node writes
        until ``until``; None (nothing taken) when too few are free. A
        reservation there before is given up (quarantined)."""
        self.sweep()
        self.drop(sid)
        seq = MemorySeq(deadline=until, filling=True)
        if not self.extend(seq, num_tokens):
            return None
        self.seqs[sid] = seq
        return seq

    def fill(self, sid: SeqId, num_tokens: int, claim_by: float) -> bool:
        """The reservation's first ``num_tokens`` tokens landed: the peer's
        first step must claim it by ``claim_by``. False: no such reservation."""
        seq = self.seqs.get(sid)
        if seq is None or not seq.filling or len(seq.block_ids) * self.block_size < num_tokens:
            return False
        seq.filling = False
        seq.num_tokens = num_tokens
        seq.deadline = claim_by
        return True

    @staticmethod
    def claim(seq: MemorySeq) -> None:
        """A step reached the sequence: it lives with its peer from now on."""
        if not seq.filling:
            seq.deadline = 0.0

    def sweep(self) -> int:
        """Free what outlived its deadline (quarantined blocks, sequences never
        filled or claimed); how many blocks went back."""
        now = self.clock()
        freed = 0
        late = [sid for sid, seq in self.seqs.items() if 0.0 < seq.deadline <= now]
        for sid in late:
            # A reservation's deadline is its grant's: nothing writes it now.
            seq = self.seqs.pop(sid)
            self._free.extend(seq.block_ids)
            freed += len(seq.block_ids)
        keep: list[tuple[float, list[int]]] = []
        for until, blocks in self._quarantine:
            if until <= now:
                self._free.extend(blocks)
                freed += len(blocks)
            else:
                keep.append((until, blocks))
        self._quarantine = keep
        return freed

    @property
    def num_quarantined(self) -> int:
        return sum(len(b) for _, b in self._quarantine)

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
        kept = [b for _, blocks in self._quarantine for b in blocks]
        every = held + kept + list(self._free)
        if len(every) != self.num_blocks or len(set(every)) != self.num_blocks:
            raise RuntimeError(
                f"memory KV: {len(self._free)} free + {len(held)} held + {len(kept)} "
                f"quarantined != {self.num_blocks}"
            )
