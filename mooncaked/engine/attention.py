"""Attention over a paged KV cache: a torch SDPA backend and a flash-attn backend.

Per layer, K and V live in two tensors ``[num_blocks, block_size, kv_heads,
head_dim]``. A token at position ``p`` of a sequence lives in slot
``block_ids[p // block_size] * block_size + p % block_size`` of the flat view
``[num_blocks * block_size, kv_heads, head_dim]``. Each step first writes the
new tokens' K/V into their slots, then attends each query token to every key of
its sequence up to and including its own position, so a chunk that starts at
``start_pos > 0`` (a prefix-cache hit or a later prefill chunk) sees the cached
context as well as itself.

The runner builds one ``AttentionMetadata`` per step; every layer reuses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import structlog
import torch
import torch.nn.functional as F

log = structlog.get_logger(__name__)

# Upstream flash-attn checks this for paged KV in both the varlen and the
# kvcache kernels ("Paged KV cache block size must be divisible by 256").
FLASH_BLOCK_SIZE_MULTIPLE = 256


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Decode sequences attended in one SDPA call, padded to the group's longest."""

    # [Bg] flat row of each decode query.
    rows: torch.Tensor
    # [Bg * max_blocks] the sequences' block tables, flattened and padded with
    # block 0: K/V are gathered whole blocks at a time, far cheaper than one
    # slot at a time.
    blocks: torch.Tensor
    # [Bg, 1, 1, max_blocks * block_size] 0 where a key is real, -inf past the
    # context. Additive float: the CPU's fused SDPA kernel takes it directly,
    # where a bool mask costs a conversion per call (about 2x slower).
    mask: torch.Tensor
    # [n] int64: the blocks every sequence of the group starts with (a shared
    # prompt prefix), attended once for all of them; ``blocks`` and ``mask``
    # then cover only what follows. None: nothing shared.
    prefix: torch.Tensor | None = None


# Decode sequences are split into at most this many groups, and groups hold
# at least _MIN_DECODE_GROUP sequences: padding every sequence to the batch's
# longest context wasted about half the attention work on mixed lengths.
_MAX_DECODE_GROUPS = 4
_MIN_DECODE_GROUP = 16
# Decodes whose block tables start with at least this many of the same blocks
# (a shared system prompt or few-shot prefix, held once by the prefix cache)
# attend to those blocks together: their K/V are gathered and read once per
# layer for the whole group instead of once per sequence (cascade attention).
# Below it, the extra kernel call and the merge cost more than they save.
_MIN_SHARED_BLOCKS = 4


@dataclass(slots=True)
class AttentionMetadata:
    """What every layer needs to write and read the paged cache in one step.

    Sequences appear in plan order; their query tokens are contiguous in the
    flat batch, sequence ``i`` owning rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``.
    """

    # [T] flat cache slot of each new token (int64, on the model's device).
    slot_mapping: torch.Tensor
    # Host copies of the per-sequence shape, for Python-level dispatch.
    query_lens: list[int]
    # Tokens already in the cache before this step (the first query's position).
    start_positions: list[int]
    # start + query_len: the keys each sequence attends to, new tokens included.
    context_lens: list[int]
    block_size: int
    # [B + 1] int32 cumulative query / context lengths (flash-attn's varlen form).
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_query_len: int
    max_context_len: int
    # [B, max_blocks] int32 block ids, zero padded.
    block_tables: torch.Tensor
    # [B] int32 context lengths on the device (flash decode).
    context_lens_tensor: torch.Tensor
    # SDPA decode batch: sequences with one query token, attended in a few
    # calls (groups of similar context length).
    decode_seq_ids: list[int]
    decode_groups: tuple[DecodeGroup, ...] = ()
    # True when the step is decodes only, in one group whose rows are the
    # step's rows in order: the queries and the output need no gather.
    decode_whole: bool = False
    # SDPA prefill: the sequences with more than one query token, and for each
    # its blocks ([n] int64), or None when start_pos == 0 and the chunk's own
    # K/V are the whole context.
    prefill_seq_ids: tuple[int, ...] = ()
    prefill_blocks: tuple[torch.Tensor | None, ...] = ()
    # Host copy of cu_seqlens_q.
    query_starts: tuple[int, ...] = ()
    # The kernel every layer calls through ``paged_attention``.
    backend: AttentionBackend | None = None
    # [T] bool, True for a row that only pads a fixed-size batch (a CUDA
    # graph's bucket): its slot gets back the value it holds. None: every row
    # is real.
    keep: torch.Tensor | None = None
    # What else the backend computes once per step (``AttentionBackend.prepare``).
    extra: object | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_all_decode(self) -> bool:
        return self.max_query_len == 1


def build_metadata(
    *,
    query_lens: list[int],
    start_positions: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    backend: AttentionBackend,
    dtype: torch.dtype = torch.float32,
) -> AttentionMetadata:
    """Build the step's metadata from host lists (one entry per sequence).

    Raises ValueError when a block table does not cover a sequence's tokens:
    the caller allocated too few blocks.
    """
    num_seqs = len(query_lens)
    if not (len(start_positions) == len(block_tables) == num_seqs) or num_seqs == 0:
        raise ValueError(
            f"metadata needs one query length, start position and block table per "
            f"sequence, got {len(query_lens)}, {len(start_positions)}, {len(block_tables)}"
        )
    context_lens = [s + q for s, q in zip(start_positions, query_lens, strict=True)]
    slots: list[int] = []
    for i, (start, ctx, table) in enumerate(
        zip(start_positions, context_lens, block_tables, strict=True)
    ):
        needed = (ctx + block_size - 1) // block_size
        if len(table) < needed:
            raise ValueError(
                f"sequence {i}: block table has {len(table)} blocks, {needed} are needed "
                f"for {ctx} tokens at block_size {block_size}"
            )
        for pos in range(start, ctx):
            slots.append(table[pos // block_size] * block_size + pos % block_size)

    max_blocks = max(len(t) for t in block_tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
    cu_q = [0]
    cu_k = [0]
    for q, c in zip(query_lens, context_lens, strict=True):
        cu_q.append(cu_q[-1] + q)
        cu_k.append(cu_k[-1] + c)

    def i32(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
        query_lens=list(query_lens),
        start_positions=list(start_positions),
        context_lens=context_lens,
        block_size=block_size,
        cu_seqlens_q=i32(cu_q),
        cu_seqlens_k=i32(cu_k),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        block_tables=i32(padded),
        context_lens_tensor=i32(context_lens),
        decode_seq_ids=[],
        query_starts=tuple(cu_q),
        backend=backend,
    )
    backend.prepare(meta, block_tables, device, dtype)
    return meta


def _add_sdpa_indices(
    meta: AttentionMetadata,
    block_tables: list[list[int]],
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Precompute gather indices once per step instead of once per layer."""
    decode_ids = [i for i, q in enumerate(meta.query_lens) if q == 1]
    prefill_ids = [i for i, q in enumerate(meta.query_lens) if q > 1]
    meta.decode_seq_ids = decode_ids
    if decode_ids:
        # The merge of a cascade needs the kernel's log-sum-exp, which only
        # the CPU's fused kernel gives back through a public op.
        families, rest = (
            shared_prefixes(meta, decode_ids, block_tables)
            if device.type == "cpu"
            else ([], decode_ids)
        )
        groups = [
            _decode_group(meta, members, block_tables, device, dtype, shared)
            for members, shared in families
        ]
        num_groups = min(_MAX_DECODE_GROUPS, max(1, len(rest) // _MIN_DECODE_GROUP))
        # Sorted by length only to split: one group keeps the step's order.
        by_len = sorted(rest, key=lambda i: meta.context_lens[i]) if num_groups > 1 else rest
        size = max(1, -(-len(by_len) // num_groups))
        groups += [
            _decode_group(meta, by_len[lo : lo + size], block_tables, device, dtype)
            for lo in range(0, len(by_len), size)
        ]
        meta.decode_groups = tuple(groups)
        # One group of every row in step order (decode_ids are ascending).
        meta.decode_whole = len(groups) == 1 and not families and not prefill_ids
    add_prefill_blocks(meta, block_tables, device)


def add_prefill_blocks(
    meta: AttentionMetadata, block_tables: list[list[int]], device: torch.device
) -> None:
    """The sequences SDPA attends one by one (more than one query token), and
    the blocks of each that starts past its cached context."""
    bs = meta.block_size
    prefill_ids = [i for i, q in enumerate(meta.query_lens) if q > 1]
    meta.prefill_seq_ids = tuple(prefill_ids)
    meta.prefill_blocks = tuple(
        None
        if meta.start_positions[i] == 0
        else torch.tensor(
            block_tables[i][: (meta.context_lens[i] + bs - 1) // bs], dtype=torch.int64
        ).to(device)
        for i in prefill_ids
    )


def shared_prefixes(
    meta: AttentionMetadata, decode_ids: list[int], block_tables: list[list[int]]
) -> tuple[list[tuple[list[int], int]], list[int]]:
    """Decodes that start with the same blocks: ([(members, shared blocks)], the rest).

    Only whole blocks before the one each sequence writes this step count: the
    prefix cache shares full blocks only, so the same block id is the same
    keys. Families form on the first block and share their common run.
    """
    bs = meta.block_size
    by_first: dict[int, list[int]] = {}
    for i in decode_ids:
        if (meta.context_lens[i] - 1) // bs >= _MIN_SHARED_BLOCKS:
            by_first.setdefault(block_tables[i][0], []).append(i)
    families: list[tuple[list[int], int]] = []
    for members in by_first.values():
        shared = min((meta.context_lens[i] - 1) // bs for i in members)
        first = block_tables[members[0]]
        for i in members[1:]:
            table = block_tables[i]
            n = 0
            while n < shared and table[n] == first[n]:
                n += 1
            shared = n
        if len(members) >= 2 and shared >= _MIN_SHARED_BLOCKS:
            families.append((members, shared))
    in_family = {i for members, _ in families for i in members}
    # The rest in step order: one group of them needs no gather of its rows.
    return families, [i for i in decode_ids if i not in in_family]


def _decode_group(
    meta: AttentionMetadata,
    seq_ids: list[int],
    block_tables: list[list[int]],
    device: torch.device,
    dtype: torch.dtype,
    shared: int = 0,
) -> DecodeGroup:
    """The group's gather indices and mask; ``shared`` leading blocks, common
    to every sequence, go in ``prefix`` and out of the rest."""
    bs = meta.block_size
    ctxs = [meta.context_lens[i] - shared * bs for i in seq_ids]
    nblk = (max(ctxs) + bs - 1) // bs
    blocks: list[int] = []
    for i, ctx in zip(seq_ids, ctxs, strict=True):
        table = block_tables[i][shared : shared + (ctx + bs - 1) // bs]
        blocks.extend(table)
        blocks.extend([0] * (nblk - len(table)))
    key_pos = torch.arange(nblk * bs)
    real = key_pos[None, :] < torch.tensor(ctxs)[:, None]
    bias = torch.zeros(real.shape, dtype=dtype).masked_fill_(~real, float("-inf"))
    prefix = block_tables[seq_ids[0]][:shared]
    return DecodeGroup(
        rows=torch.tensor([meta.query_starts[i] for i in seq_ids], dtype=torch.int64).to(device),
        blocks=torch.tensor(blocks, dtype=torch.int64).to(device),
        mask=bias[:, None, None, :].to(device),
        prefix=torch.tensor(prefix, dtype=torch.int64).to(device) if shared else None,
    )


class PagedKV(NamedTuple):
    """One layer's K/V in a step: its new rows ([T, KVH, D]) and the layer's
    paged cache ([num_blocks, block_size, KVH, D]) they are written into."""

    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


class AttentionBackend:
    """A kernel of attention over the paged cache. Every backend writes the
    step's new K/V into their slots first (``forward``), then attends the
    queries over the cache (``attend``, what a backend implements)."""

    name: str
    # True when a step of decodes reads only the metadata's device tensors
    # (slot_mapping, block_tables, context_lens_tensor, keep), never its host
    # lists, so the step can be captured in a CUDA graph (engine/graphs.py).
    static_decode: bool
    # How many times the KV cache's memory the backend needs: 2 for one that
    # keeps a copy of the cache in a layout of its own.
    kv_copies: int = 1

    def prepare(
        self,
        meta: AttentionMetadata,
        block_tables: list[list[int]],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """Once per step, before any layer: what every layer's call reuses."""

    def step_done(self, meta: AttentionMetadata) -> None:
        """Every layer of the step ran (not called when the forward failed)."""

    def bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The runner's KV cache, once allocated."""

    def track(self, generations: np.ndarray) -> None:
        """The block pool's generations (``BlockPool.generations``), for a
        backend that keeps a copy of the cache."""

    def forward(self, q: torch.Tensor, kv: PagedKV, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D]; writes the step's new K/V into the cache first."""
        write_kv(kv.k, kv.v, kv.k_cache, kv.v_cache, meta.slot_mapping, meta.keep)
        return self.attend(q, kv, meta)

    def attend(self, q: torch.Tensor, kv: PagedKV, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D] over the cache, the step's new K/V in it."""
        raise NotImplementedError


class _HeadedBackend(AttentionBackend):
    """A backend that knows the model's attention heads."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(head_dim)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> None:
    """Write each row's K/V into its slot; a row where ``keep`` is True writes
    back what its slot already holds.

    ``keep`` serves fixed-shape batches: every row must write somewhere, so a
    padding row is given a slot no real row of the step writes, and leaves it
    as it was (an unchanged copy, so duplicates of it agree)."""
    kvh, hd = k_cache.shape[2], k_cache.shape[3]
    k_flat, v_flat = k_cache.view(-1, kvh, hd), v_cache.view(-1, kvh, hd)
    if keep is not None:
        pad = keep[:, None, None]
        k = torch.where(pad, k_flat.index_select(0, slot_mapping), k)
        v = torch.where(pad, v_flat.index_select(0, slot_mapping), v)
    k_flat.index_copy_(0, slot_mapping, k)
    v_flat.index_copy_(0, slot_mapping, v)


class SdpaBackend(_HeadedBackend):
    """torch SDPA on any device: decodes batched in one call, prefills one call each.

    Decodes are padded to the longest context of the batch and masked. GQA
    without repeating K/V: for decodes, the query heads that share a KV head
    are folded into the query axis (``[Bd, kv_heads, group, D]``); prefills
    pass ``enable_gqa``.
    """

    name = "sdpa"
    static_decode = False

    def prepare(
        self,
        meta: AttentionMetadata,
        block_tables: list[list[int]],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        _add_sdpa_indices(meta, block_tables, device, dtype)

    def attend(self, q: torch.Tensor, kv: PagedKV, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv.k_cache, kv.v_cache
        kvh, hd, g = self.num_kv_heads, self.head_dim, self.group
        if meta.decode_seq_ids and not meta.decode_groups:
            raise RuntimeError("SDPA decode metadata was not built")
        if meta.decode_whole:
            # [T, H, D] -> [T, KVH, G, D]: the GQA group plays the query axis.
            qd = q.view(q.shape[0], kvh, g, hd)
            return self._decode(qd, meta.decode_groups[0], k_cache, v_cache).reshape(q.shape)
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            rows = group.rows
            bd = rows.numel()
            qd = q.index_select(0, rows).view(bd, kvh, g, hd)
            od = self._decode(qd, group, k_cache, v_cache)
            out.index_copy_(0, rows, od.reshape(bd, self.num_heads, hd))
        return self._prefills(q, kv, meta, out)

    def _prefills(
        self, q: torch.Tensor, kv: PagedKV, meta: AttentionMetadata, out: torch.Tensor
    ) -> torch.Tensor:
        """Each prefill chunk's attention into its rows of ``out``, one call each."""
        k, v, k_cache, v_cache = kv
        kvh, hd, g = self.num_kv_heads, self.head_dim, self.group
        cu = meta.query_starts
        for i, blocks_i in zip(meta.prefill_seq_ids, meta.prefill_blocks, strict=True):
            lo, hi = cu[i], cu[i + 1]
            start = meta.start_positions[i]
            ctx = meta.context_lens[i]
            # 4-D [1, heads, len, D]: the CPU's fused SDPA kernel takes only
            # 4-D inputs (3-D falls back to the math path, ~10x slower).
            qp = q[lo:hi].transpose(0, 1).unsqueeze(0)
            if blocks_i is None:
                kp, vp = k[lo:hi], v[lo:hi]
            else:
                kp = k_cache.index_select(0, blocks_i).view(-1, kvh, hd)[:ctx]
                vp = v_cache.index_select(0, blocks_i).view(-1, kvh, hd)[:ctx]
            kp = kp.transpose(0, 1).unsqueeze(0)
            vp = vp.transpose(0, 1).unsqueeze(0)
            if blocks_i is None:
                # The chunk is the whole context: plain causal attention.
                op = F.scaled_dot_product_attention(
                    qp, kp, vp, is_causal=True, scale=self.scale, enable_gqa=g > 1
                )
            else:
                # Query at position start + i sees keys 0 .. start + i.
                qpos = torch.arange(start, ctx, device=q.device)
                mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
                op = F.scaled_dot_product_attention(
                    qp, kp, vp, attn_mask=mask, scale=self.scale, enable_gqa=g > 1
                )
            out[lo:hi] = op[0].transpose(0, 1)
        return out

    def _decode(
        self, qd: torch.Tensor, group: DecodeGroup, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """A decode group's attention: queries [Bd, KVH, G, D] -> the same shape."""
        bd, kvh, _g, hd = qd.shape
        # [Bd * nblk, bs, KVH, D] -> [Bd, KVH, nblk * bs, D]
        kd = k_cache.index_select(0, group.blocks).view(bd, -1, kvh, hd).transpose(1, 2)
        vd = v_cache.index_select(0, group.blocks).view(bd, -1, kvh, hd).transpose(1, 2)
        if group.prefix is not None:
            return self._cascade(qd, kd, vd, group, k_cache, v_cache)
        return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask, scale=self.scale)

    def _cascade(
        self,
        qd: torch.Tensor,
        kd: torch.Tensor,
        vd: torch.Tensor,
        group: DecodeGroup,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Decode attention of sequences that share ``group.prefix``: every
        query over the shared keys in one call (the sequences' query heads
        stacked as rows of one batch), each over its own keys, and the two
        softmaxes merged by their log-sum-exp. [Bd, KVH, G, D] like SDPA's."""
        assert group.prefix is not None
        bd, kvh, g, hd = qd.shape
        kp = k_cache.index_select(0, group.prefix).view(1, -1, kvh, hd).transpose(1, 2)
        vp = v_cache.index_select(0, group.prefix).view(1, -1, kvh, hd).transpose(1, 2)
        # [Bd, KVH, G, D] -> [1, KVH, Bd * G, D]
        qp = qd.transpose(0, 1).reshape(1, kvh, bd * g, hd)
        fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o_pre, lse_pre = fused(qp, kp, vp, scale=self.scale)
        o_own, lse_own = fused(qd, kd, vd, attn_mask=group.mask, scale=self.scale)
        o_pre = o_pre.view(kvh, bd, g, hd).transpose(0, 1)
        lse_pre = lse_pre.view(kvh, bd, g).transpose(0, 1)
        # softmax over both parts: o = (e^a o_pre + e^b o_own) / (e^a + e^b),
        # the weight of o_pre being sigmoid(a - b). In float32, as the kernel
        # keeps its running sums.
        w = torch.sigmoid(lse_pre - lse_own).unsqueeze(-1)
        own = o_own.float()
        return own.add_(o_pre.float().sub_(own).mul_(w)).to(qd.dtype)


class FlashBackend(_HeadedBackend):
    """flash-attn 2.6+ on CUDA, reading K/V straight from the paged cache.

    A step of decodes only goes through ``flash_attn_with_kvcache``; any step
    with a prefill chunk goes through one ``flash_attn_varlen_func`` call with
    ``block_table`` (decodes are one-token sequences there). Causal masks in
    flash-attn 2.1+ are aligned to the bottom right, which is exactly "query i
    of a chunk starting at start_pos sees keys 0 .. start_pos + i".
    """

    name = "flash"
    static_decode = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        # Imported here: the package is optional and CUDA-only.
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._kvcache = flash_attn_with_kvcache
        super().__init__(num_heads, num_kv_heads, head_dim)

    def attend(self, q: torch.Tensor, kv: PagedKV, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv.k_cache, kv.v_cache
        if meta.is_all_decode:
            out = self._kvcache(
                q.unsqueeze(1),  # [B, 1, H, D]
                k_cache,
                v_cache,
                cache_seqlens=meta.context_lens_tensor,
                block_table=meta.block_tables,
                softmax_scale=self.scale,
                causal=True,
            )
            return out.squeeze(1)
        return self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_context_len,
            softmax_scale=self.scale,
            causal=True,
            block_table=meta.block_tables,
        )


def flash_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(
    requested: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vllm_cpu_library: str = "",
) -> AttentionBackend:
    """``auto``: flash-attn where it can run (CUDA, fp16/bf16, block_size % 256 == 0);
    on the CPU, vLLM's kernels where they load, else SDPA. ``vllm-cpu``:
    vLLM's CPU kernels for decodes (engine/vllm_cpu.py), from
    ``vllm_cpu_library`` or the vllm package installed here."""
    from mooncaked.engine import vllm_cpu  # it builds on this module's SDPA backend

    shape = (device, dtype, block_size, num_heads, num_kv_heads, head_dim, vllm_cpu_library)
    if requested == "vllm-cpu":
        try:
            return vllm_cpu.make_backend(*shape)
        except vllm_cpu.VllmCpuUnavailable as exc:
            raise ValueError(f"model.attention_backend = 'vllm-cpu': {exc}") from None
    if requested == "auto" and device.type == "cpu":
        try:
            return vllm_cpu.make_backend(*shape)
        except vllm_cpu.VllmCpuUnavailable as exc:
            # The usual case (vLLM's CPU build is not installed): SDPA.
            log.debug("vllm-cpu attention not used", reason=str(exc))
    flash_ok_reason: str | None = None
    if device.type != "cuda":
        flash_ok_reason = "flash-attn needs a CUDA device"
    elif dtype not in (torch.float16, torch.bfloat16):
        flash_ok_reason = f"flash-attn needs float16 or bfloat16, the model runs in {dtype}"
    elif block_size % FLASH_BLOCK_SIZE_MULTIPLE != 0:
        flash_ok_reason = (
            f"flash-attn's paged KV needs kv.block_size divisible by "
            f"{FLASH_BLOCK_SIZE_MULTIPLE}, got {block_size}"
        )
    elif not flash_available():
        flash_ok_reason = "the flash_attn package is not installed"

    if requested == "flash":
        if flash_ok_reason is not None:
            raise ValueError(f"model.attention_backend = 'flash': {flash_ok_reason}")
        return FlashBackend(num_heads, num_kv_heads, head_dim)
    if requested == "sdpa" or (requested == "auto" and flash_ok_reason is not None):
        return SdpaBackend(num_heads, num_kv_heads, head_dim)
    if requested == "auto":
        return FlashBackend(num_heads, num_kv_heads, head_dim)
    raise ValueError(f"unknown attention backend {requested!r}; use auto, sdpa, flash or vllm-cpu")


def paged_attention(q: torch.Tensor, kv: PagedKV, meta: AttentionMetadata) -> torch.Tensor:
    """One layer's attention through the step's backend; writes kv's new rows
    into its cache."""
    if meta.backend is None:
        raise RuntimeError("attention metadata was built without a backend")
    return meta.backend.forward(q, kv, meta)
