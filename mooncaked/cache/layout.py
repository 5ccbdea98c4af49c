"""The byte layout of a KV block, and the copies between device blocks and host rows.

A block is every layer's K and V for ``block_size`` tokens, laid out in a row
as ``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``: one
contiguous byte range per block, the same in every host tier (a DRAM slot,
an SSD slot, a peer's slot, a replica inbox row). ``gather_blocks`` and
``scatter_blocks`` move blocks between a device KV cache
(``[num_blocks, block_size, kv_heads, head_dim]`` per layer and K/V) and such
rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The shape of one KV block: what a slot holds, on every tier."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"BlockLayout.{name} must be > 0, got {value}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"BlockLayout.dtype must be a torch.dtype, got {self.dtype!r}")

    @classmethod
    def from_kv_caches(cls, kv_caches: KVCaches) -> BlockLayout:
        if not kv_caches:
            raise ValueError("kv_caches is empty: need at least one layer")
        k, _ = kv_caches[0]
        if k.dim() != 4:
            raise ValueError(
                f"KV cache tensors must be [num_blocks, block_size, kv_heads, head_dim], "
                f"got shape {tuple(k.shape)}"
            )
        _, block_size, num_kv_heads, head_dim = k.shape
        return cls(len(kv_caches), block_size, num_kv_heads, head_dim, k.dtype)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.itemsize

    def fingerprint(self) -> bytes:
        """16 bytes that differ whenever the byte layout of a block differs."""
        text = (
            f"{self.num_layers}/{self.block_size}/{self.num_kv_heads}/{self.head_dim}/{self.dtype}"
        )
        return hashlib.blake2b(text.encode(), digest_size=16).digest()

    def typed(self, rows: torch.Tensor) -> torch.Tensor:
        """A uint8 ``[n, block_bytes]`` tensor seen as ``[n, *block_shape]`` of dtype."""
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != self.block_bytes:
            raise ValueError(
                f"expected a uint8 tensor [n, {self.block_bytes}], "
                f"got {rows.dtype} {tuple(rows.shape)}"
            )
        return rows.view(self.dtype).view(rows.shape[0], *self.block_shape)

    def check_kv_caches(self, kv_caches: KVCaches) -> None:
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layers of KV cache, got {len(kv_caches)}")
        want = (self.block_size, self.num_kv_heads, self.head_dim)
        for i, (k, v) in enumerate(kv_caches):
            for t in (k, v):
                if tuple(t.shape[1:]) != want or t.dtype != self.dtype:
                    raise ValueError(
                        f"layer {i}: KV tensor {t.dtype} {tuple(t.shape)} does not match "
                        f"[num_blocks, {', '.join(map(str, want))}] {self.dtype}"
                    )


def _runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both index lists step by one."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out:
            s0, d0, n = out[-1]
            if s == s0 + n and d == d0 + n:
                out[-1] = (s0, d0, n + 1)
                continue
        out.append((s, d, 1))
    return out


def _host_rows(t: torch.Tensor) -> np.ndarray | None:
    """A contiguous CPU tensor's bytes as a ``[dim 0, rest]`` uint8 array (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    return t.view(torch.uint8).numpy().reshape(t.shape[0], -1)


def _host_kv(kv_caches: KVCaches) -> list[tuple[np.ndarray, np.ndarray]] | None:
    out: list[tuple[np.ndarray, np.ndarray]] = []
    for k, v in kv_caches:
        kr, vr = _host_rows(k), _host_rows(v)
        if kr is None or vr is None:
            return None
        out.append((kr, vr))
    return out


def _indices(values: Sequence[int], limit: int, what: str) -> np.ndarray:
    idx = np.asarray(values, dtype=np.intp)
    # numpy would wrap a negative index around silently.
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= limit):
        raise ValueError(f"{what} out of range 0..{limit - 1}: {sorted(set(values))[:8]}")
    return idx


def _buffer_rows(block_ids: Sequence[int], rows: Sequence[int] | None, what: str) -> list[int]:
    """The buffer row of each block: ``rows``, or ``0..n-1`` when None."""
    out = list(range(len(block_ids))) if rows is None else list(rows)
    if len(out) != len(block_ids):
        raise ValueError(f"{len(block_ids)} block ids but {len(out)} {what}")
    return out


_HostViews = tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray, np.ndarray]


def _host_views(
    kv_caches: KVCaches,
    block_ids: Sequence[int],
    buf: torch.Tensor,
    rows: Sequence[int],
    what: str,
) -> _HostViews | None:
    """With the caches and ``buf`` all contiguous CPU memory: the caches' numpy rows,
    the block and row indices, ``buf`` as ``[rows, layer, K/V, bytes]``; else None."""
    if (host_buf := _host_rows(buf)) is None or (host_kv := _host_kv(kv_caches)) is None:
        return None
    ids = _indices(block_ids, kv_caches[0][0].shape[0], "block ids")
    idx = _indices(rows, buf.shape[0], what)
    return host_kv, ids, idx, host_buf.reshape(buf.shape[0], len(host_kv), 2, -1)


# On CPU the copies go through numpy: one fancy-indexed assignment per layer
# and K/V runs near memcpy speed, where torch's index_select/index_copy on
# bf16 rows ran at a fifth of it (tools/bench_cache.py).


def gather_blocks(
    kv_caches: KVCaches,
    block_ids: Sequence[int],
    out: torch.Tensor,
    out_rows: Sequence[int] | None = None,
) -> None:
    """Copy device blocks ``block_ids`` into rows of ``out`` (uint8 ``[n, block_bytes]``).

    Row ``out_rows[i]`` (``i`` when None) receives block ``block_ids[i]``; pass a
    pool's ``slots`` and slot ids to fill DRAM slots in one call. Returns when
    the bytes are in ``out``.
    """
    layout = BlockLayout.from_kv_caches(kv_caches)
    rows = _buffer_rows(block_ids, out_rows, "output rows")
    if not block_ids:
        return
    dst = layout.typed(out)
    host = _host_views(kv_caches, block_ids, out, rows, "output rows")
    if host is not None:
        host_kv, ids, idx, d = host
        for layer, (k, v) in enumerate(host_kv):
            d[idx, layer, 0] = k[ids]
            d[idx, layer, 1] = v[ids]
        return
    device = kv_caches[0][0].device
    ids_t = torch.tensor(block_ids, dtype=torch.long, device=device)
    if device == out.device:
        idx_t = torch.tensor(rows, dtype=torch.long, device=device)
        for layer, (k, v) in enumerate(kv_caches):
            dst[:, layer, 0].index_copy_(0, idx_t, k.index_select(0, ids_t))
            dst[:, layer, 1].index_copy_(0, idx_t, v.index_select(0, ids_t))
        return
    # Across devices: gather on the device into one contiguous staging buffer,
    # then one copy per run of destination rows (a DMA each when out is pinned).
    staged = torch.empty((len(block_ids), layout.block_bytes), dtype=torch.uint8, device=device)
    staged_t = layout.typed(staged)
    for layer, (k, v) in enumerate(kv_caches):
        staged_t[:, layer, 0] = k.index_select(0, ids_t)
        staged_t[:, layer, 1] = v.index_select(0, ids_t)
    for s, d0, n in _runs(range(len(rows)), rows):
        out[d0 : d0 + n].copy_(staged[s : s + n], non_blocking=out.is_pinned())
    _synchronize(device)


def scatter_blocks(
    kv_caches: KVCaches,
    block_ids: Sequence[int],
    src: torch.Tensor,
    src_rows: Sequence[int] | None = None,
) -> None:
    """Copy rows of ``src`` (uint8 ``[n, block_bytes]``) into device blocks ``block_ids``.

    Block ``block_ids[i]`` receives row ``src_rows[i]`` (``i`` when None).
    Returns when the bytes are in the device blocks.
    """
    layout = BlockLayout.from_kv_caches(kv_caches)
    rows = _buffer_rows(block_ids, src_rows, "source rows")
    if not block_ids:
        return
    srct = layout.typed(src)
    host = _host_views(kv_caches, block_ids, src, rows, "source rows")
    if host is not None:
        host_kv, ids, idx, s = host
        for layer, (k, v) in enumerate(host_kv):
            k[ids] = s[idx, layer, 0]
            v[ids] = s[idx, layer, 1]
        return
    device = kv_caches[0][0].device
    ids_t = torch.tensor(block_ids, dtype=torch.long, device=device)
    if device == src.device:
        idx_t = torch.tensor(rows, dtype=torch.long, device=device)
        for layer, (k, v) in enumerate(kv_caches):
            k.index_copy_(0, ids_t, srct[:, layer, 0].index_select(0, idx_t))
            v.index_copy_(0, ids_t, srct[:, layer, 1].index_select(0, idx_t))
        return
    # Across devices: one copy per run of source rows into a device staging
    # buffer, then a device-side scatter per layer.
    staged = torch.empty((len(rows), layout.block_bytes), dtype=torch.uint8, device=device)
    for s0, d, n in _runs(rows, range(len(rows))):
        staged[d : d + n].copy_(src[s0 : s0 + n], non_blocking=src.is_pinned())
    staged_t = layout.typed(staged)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, ids_t, staged_t[:, layer, 0])
        v.index_copy_(0, ids_t, staged_t[:, layer, 1])
    _synchronize(device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
