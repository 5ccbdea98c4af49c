"""Decode steps replayed from CUDA graphs, one graph per bucket of batch sizes.

On a GPU a small model's decode step is bound by kernel launches, not by
math: a Llama layer is about twenty kernels, each a few microseconds of work
behind a Python call and a launch. A CUDA graph records the whole forward
once and replays it with one launch. A graph replays fixed shapes at fixed
addresses, so each bucket gets its own graph over views of the same static
buffers, and a step of ``n`` decodes runs the smallest bucket that holds it.

Padding rows (a bucket's rows past ``n``) must not disturb anything: they read
token 0 at position 0 with a context of one key in block 0 (read only, the
result is dropped), and their K/V go to a slot that no real row of the step
writes, with ``keep`` set so the write puts back the value already there
(``attention.write_kv``).

Only an attention backend whose decode reads device tensors alone can be
captured (``static_decode``: flash-attn's paged kernel, which takes the block
table and context lengths as tensors). The SDPA backend builds per-step
gather indices on the host, so it is never graphed. Steps with a prefill
chunk, a batch above the largest bucket, or per-layer connector work (a
handoff streaming KV out between layers) run eagerly.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

from mooncaked.engine.attention import AttentionBackend, AttentionMetadata

CUDA_GRAPH_MODES = ("auto", "on", "off")
# Past this batch a step's math outweighs its launches; larger steps run eagerly.
MAX_GRAPH_BATCH = 256
# Runs before capture: cuBLAS and flash-attn pick and cache their kernels and
# workspaces on first use, which a capture must not record.
_WARMUP_RUNS = 2

# (input_ids [B], positions [B], metadata) -> hidden states [B, hidden].
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including ``max_batch``
    (capped at ``MAX_GRAPH_BATCH``): padding wastes at most 7 rows past 8."""
    if max_batch <= 0:
        raise ValueError(f"max_batch must be > 0, got {max_batch}")
    top = min(max_batch, MAX_GRAPH_BATCH)
    sizes = {b for b in (1, 2, 4) if b < top} | set(range(8, top, 8)) | {top}
    return sorted(sizes)


def graph_unavailable_reason(device: torch.device, backend: AttentionBackend) -> str | None:
    """Why the decode step cannot be captured here, or None when it can."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, the model runs on {device}"
    if not getattr(backend, "static_decode", False):
        return (
            f"the {backend.name} attention backend builds its decode indices on the host "
            "each step; CUDA graphs need flash-attn (model.attention_backend = flash)"
        )
    return None


class DecodeGraphs:
    """Static input buffers and one captured decode forward per bucket.

    ``capture=False`` runs the same fixed-shape forward eagerly instead of
    replaying a graph: the padding and buffer layout without a GPU (tests).
    """

    def __init__(
        self,
        forward: DecodeForward,
        *,
        backend: AttentionBackend,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        max_batch: int,
        capture: bool = True,
    ) -> None:
        if capture:
            reason = graph_unavailable_reason(device, backend)
            if reason is not None:
                raise ValueError(reason)
        self._forward_fn = forward
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.sizes = bucket_sizes(max_batch)
        self.capture = capture
        top, w = self.sizes[-1], self.max_blocks
        # Bucket b reads the first b rows of each buffer. The host side keeps
        # a copy of each: a step rewrites only its rows' live blocks (entries
        # past a row's context are never read, so stale ones may stay), and
        # the block tables, the one large buffer, copy only b rows.
        with torch.inference_mode():
            # ids | positions | slots.
            self._i64 = torch.zeros(3, top, dtype=torch.int64, device=device)
            self._context_lens = torch.ones(top, dtype=torch.int32, device=device)
            self._tables = torch.zeros(top, w, dtype=torch.int32, device=device)
            self._keep = torch.ones(top, dtype=torch.bool, device=device)
        self._host_i64 = np.zeros((3, top), dtype=np.int64)
        self._host_context_lens = np.ones(top, dtype=np.int32)
        self._host_tables = np.zeros((top, w), dtype=np.int32)
        self._host_keep = np.ones(top, dtype=np.bool_)
        self._metas = {b: self._meta(b) for b in self.sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        if capture:
            self._capture_all()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` decodes; None past the largest."""
        for b in self.sizes:
            if b >= num_seqs:
                return b
        return None

    def _views(self, b: int) -> tuple[torch.Tensor, ...]:
        ids, positions, slots = self._i64[:, :b].unbind(0)
        return ids, positions, slots, self._context_lens[:b], self._tables[:b], self._keep[:b]

    def _meta(self, b: int) -> AttentionMetadata:
        _ids, _positions, slots, context_lens, tables, keep = self._views(b)
        cu = torch.arange(b + 1, dtype=torch.int32, device=self.device)
        # The host lists are placeholders: a static-decode backend reads only
        # the tensors, which each replay refills.
        return AttentionMetadata(
            slot_mapping=slots,
            query_lens=[1] * b,
            start_positions=[0] * b,
            context_lens=[1] * b,
            block_size=self.block_size,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_query_len=1,
            max_context_len=self.max_blocks * self.block_size,
            block_tables=tables,
            context_lens_tensor=context_lens,
            decode_seq_ids=list(range(b)),
            query_starts=tuple(range(b + 1)),
            backend=self.backend,
            keep=keep,
        )

    def _forward(self, b: int) -> torch.Tensor:
        ids, positions, *_ = self._views(b)
        return self._forward_fn(ids, positions, self._metas[b])

    def _pad_all(self, b: int) -> None:
        """Every row of bucket ``b`` a padding row (for warm-up and capture)."""
        ids, positions, slots, context_lens, tables, keep = self._views(b)
        for t in (ids, positions, slots, tables):
            t.zero_()
        context_lens.fill_(1)
        keep.fill_(True)

    def _capture_all(self) -> None:
        # The model's device made current: streams, the pool and the capture
        # all belong to it (cuda:1 while cuda:0 is current would capture nothing).
        with torch.cuda.device(self.device), torch.inference_mode():
            # Largest first, all from one memory pool: smaller graphs reuse the
            # larger ones' activation memory instead of each holding its own.
            pool = torch.cuda.graph_pool_handle()
            for b in reversed(self.sizes):
                self._capture(b, pool)
        torch.cuda.synchronize(self.device)

    def _capture(self, b: int, pool: torch.cuda._POOL_HANDLE) -> None:
        self._pad_all(b)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(_WARMUP_RUNS):
                self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a transfer thread's
        # allocations) do not break this capture.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self._outputs[b] = self._forward(b)
        self._graphs[b] = graph

    def run(
        self, input_ids: list[int], positions: list[int], block_tables: list[list[int]]
    ) -> torch.Tensor:
        """Hidden states [n, hidden] of ``n`` one-token decodes (token ``input_ids[i]``
        at ``positions[i]``); writes their K/V into the cache.

        The result is a view of a buffer the next run of the same bucket
        overwrites. Raises ValueError past the largest bucket or for a block
        table too short for its position.
        """
        n = len(input_ids)
        b = self.bucket(n) if n > 0 else None
        if b is None or not len(positions) == len(block_tables) == n:
            raise ValueError(
                f"a graphed decode needs 1..{self.max_batch} rows with a position and a "
                f"block table each, got {n}, {len(positions)}, {len(block_tables)}"
            )
        bs, w = self.block_size, self.max_blocks
        h64, tables = self._host_i64, self._host_tables
        for i, (pos, table) in enumerate(zip(positions, block_tables, strict=True)):
            needed = pos // bs + 1
            if len(table) < needed or needed > w:
                raise ValueError(
                    f"sequence {i}: block table has {len(table)} blocks, {needed} are needed "
                    f"for position {pos} at block_size {bs} (at most {w})"
                )
            h64[2, i] = table[pos // bs] * bs + pos % bs
            tables[i, :needed] = table[:needed]
        h64[0, :n] = input_ids
        h64[1, :n] = positions
        taken = set(h64[2, :n].tolist())
        # Padding rows: token 0 at position 0, one key (entry 0 of a stale or
        # zero table row: always a valid block id), a slot no real row writes.
        h64[:2, n:b] = 0
        h64[2, n:b] = next(s for s in itertools.count() if s not in taken)
        self._host_context_lens[:n] = positions
        self._host_context_lens[:n] += 1
        self._host_context_lens[n:b] = 1
        self._host_keep[:n] = False
        self._host_keep[n:b] = True
        # The buffers are inference tensors: written only in inference mode.
        with torch.inference_mode():
            # Pageable host memory: each copy has read its source when it
            # returns, so the host buffers are free for the next step at once.
            self._i64.copy_(torch.from_numpy(h64), non_blocking=True)
            self._context_lens.copy_(torch.from_numpy(self._host_context_lens), non_blocking=True)
            self._keep.copy_(torch.from_numpy(self._host_keep), non_blocking=True)
            self._tables[:b].copy_(torch.from_numpy(tables[:b]), non_blocking=True)
            self.num_replays += 1
            if self.capture:
                self._graphs[b].replay()
                return self._outputs[b][:n]
            return self._forward(b)[:n]
