"""vLLM's paged KV cache on the CPU, converted to and from mooncaked's block rows.

vLLM's CPU attention keeps, per layer, one tensor ``[num_kernel_blocks,
kv_heads, kernel_block_size, 2 * head_dim]``. Where each K and V element of
a block sits in it is the attention kernel's choice, by ISA: with ``vec``
(AVX-512 or AVX2 without AMX), each head holds K transposed, ``[head_dim,
tokens]``, then V, ``[tokens, head_dim]``; AMX packs otherwise. mooncaked keeps
a block of ``block_size`` tokens as one row ``[layers, 2 (K, V), block_size,
kv_heads, head_dim]`` (``cache/layout.py``), the same on every tier and node.

``PagedLayout.probe`` learns the placement from vLLM's own cache write
(``cpu_attn_reshape_and_cache``) on one scratch block, so the conversion
follows whatever the running build picked and never guesses. Where K's and
V's placements are affine in (token, head, dim) (``vec``, ``vec16``), a
block's K or V is a strided view and a copy is one strided torch copy per
layer and K/V; otherwise an element index does it, a gather per element:
slower, but right for any placement the probe finds.

``RowMap`` addresses node blocks in vLLM's cache: a vLLM block of
``vllm_block_size`` tokens holds ``vllm_block_size / block_size`` node blocks,
each inside one kernel block. ``gather`` copies such blocks into rows,
``scatter`` rows into them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mooncaked.cache.layout import BlockLayout

# vLLM's cache write of one layer: key and value ``[tokens, kv_heads,
# head_dim]`` into ``cache`` ``[kernel blocks, kv_heads, kernel_block_size,
# 2 * head_dim]`` at ``slots`` (kernel block * kernel_block_size + token).
CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

# Probe values are bit patterns of normal, finite numbers, so a kernel that
# converts on its way (bf16 -> fp32 -> bf16) keeps them: (first pattern, how many).
_CODES = {2: (0x0800, 0x7000), 4: (0x3F800000, 1 << 22)}
_INT_OF_SIZE = {2: torch.int16, 4: torch.int32}


def _encode(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    base, _ = _CODES[size]
    return (values + base).to(_INT_OF_SIZE[size]).view(dtype)


def _decode(t: torch.Tensor) -> torch.Tensor:
    size = t.element_size()
    base, _ = _CODES[size]
    raw = t.contiguous().view(_INT_OF_SIZE[size]).to(torch.int64)
    return (raw & ((1 << (8 * size)) - 1)) - base


@dataclass(frozen=True, slots=True)
class Affine:
    """One of K or V inside a kernel block: element (t, h, d) at
    ``base + t * token + h * head + d * dim``."""

    base: int
    token: int
    head: int
    dim: int


def _affine(offsets: torch.Tensor) -> Affine | None:
    """``offsets[t, h, d]`` as strides, if it is affine."""
    n_t, n_h, n_d = offsets.shape
    base = int(offsets[0, 0, 0])
    a = Affine(
        base,
        int(offsets[1, 0, 0]) - base if n_t > 1 else 0,
        int(offsets[0, 1, 0]) - base if n_h > 1 else 0,
        int(offsets[0, 0, 1]) - base if n_d > 1 else 0,
    )
    t = torch.arange(n_t).view(-1, 1, 1)
    h = torch.arange(n_h).view(1, -1, 1)
    d = torch.arange(n_d).view(1, 1, -1)
    expected = a.base + t * a.token + h * a.head + d * a.dim
    return a if torch.equal(expected, offsets) else None


@dataclass(frozen=True)
class PagedLayout:
    """Where vLLM puts each K and V element of one kernel block of one layer."""

    num_kv_heads: int
    head_dim: int
    kernel_block_size: int
    dtype: torch.dtype
    # offsets[kv, t, h, d]: element (K or V, token t, head h, dim d) sits this
    # many elements from the start of its kernel block.
    offsets: torch.Tensor
    # K's and V's placements as strides, where both are affine.
    affine: tuple[Affine, Affine] | None

    @property
    def block_elems(self) -> int:
        return 2 * self.kernel_block_size * self.num_kv_heads * self.head_dim

    @classmethod
    def of_offsets(cls, offsets: torch.Tensor, dtype: torch.dtype) -> PagedLayout:
        """ValueError unless ``offsets`` (``[2, tokens, kv_heads, head_dim]``)
        places every element of a block exactly once."""
        if offsets.dim() != 4 or offsets.shape[0] != 2:
            raise ValueError(f"offsets must be [2, tokens, heads, dim], got {tuple(offsets.shape)}")
        _, kbs, heads, dim = offsets.shape
        n = offsets.numel()
        flat = offsets.reshape(-1).to(torch.int64)
        if int(flat.min()) < 0 or int(flat.max()) >= n or torch.unique(flat).numel() != n:
            raise ValueError("offsets do not place each element of a block exactly once")
        k, v = _affine(offsets[0]), _affine(offsets[1])
        affine = (k, v) if k is not None and v is not None else None
        return cls(heads, dim, kbs, dtype, offsets.to(torch.int64), affine)

    @classmethod
    def probe(
        cls,
        write: CacheWrite,
        *,
        num_kv_heads: int,
        head_dim: int,
        kernel_block_size: int,
        dtype: torch.dtype,
    ) -> PagedLayout:
        """The placement ``write`` gives one block, learnt from two writes of
        coded values: one codes each element's token, one its head and dim.
        ValueError when the write loses the codes or misplaces an element."""
        size = torch.empty((), dtype=dtype).element_size()
        if size not in _CODES:
            raise ValueError(f"cannot probe a KV cache of {dtype} (2- or 4-byte dtypes only)")
        kbs, heads, dim = kernel_block_size, num_kv_heads, head_dim
        if 2 * max(kbs, heads * dim) > _CODES[size][1]:
            raise ValueError(f"a block of {kbs} x {heads} x {dim} is too wide to probe in {dtype}")
        shape = (kbs, heads, dim)

        def written(k_codes: torch.Tensor, v_codes: torch.Tensor) -> torch.Tensor:
            cache = torch.zeros((1, heads, kbs, 2 * dim), dtype=dtype)
            key = _encode(k_codes.expand(shape).contiguous(), dtype)
            value = _encode(v_codes.expand(shape).contiguous(), dtype)
            write(key, value, cache, torch.arange(kbs, dtype=torch.int64))
            return _decode(cache).reshape(-1)

        tokens = torch.arange(kbs).view(-1, 1, 1)
        head_dims = torch.arange(heads * dim).view(1, heads, dim)
        by_token = written(tokens, tokens + kbs)
        by_head_dim = written(head_dims, head_dims + heads * dim)
        kv_a, t = by_token // kbs, by_token % kbs
        kv_b, hd = by_head_dim // (heads * dim), by_head_dim % (heads * dim)
        ok = (by_token >= 0) & (kv_a < 2) & (by_head_dim >= 0) & (kv_b < 2) & (kv_a == kv_b)
        if not bool(ok.all()):
            raise ValueError(
                "the cache write did not keep the probe's values (a converting kernel?)"
            )
        logical = (kv_a * kbs + t) * (heads * dim) + hd
        offsets = torch.full((logical.numel(),), -1, dtype=torch.int64)
        offsets[logical] = torch.arange(logical.numel())
        return cls.of_offsets(offsets.view(2, kbs, heads, dim), dtype)


class RowMap:
    """Node blocks in vLLM's per-layer caches, copied to and from rows.

    A request's node block ``k`` (tokens ``k * block_size`` on) lies in its
    vLLM block ``k // r`` (``r = vllm_block_size / block_size``), in kernel
    block ``b * m + ...`` (``m`` kernel blocks per vLLM block).
    """

    def __init__(self, paged: PagedLayout, node: BlockLayout, vllm_block_size: int) -> None:
        if (node.num_kv_heads, node.head_dim, node.dtype) != (
            paged.num_kv_heads,
            paged.head_dim,
            paged.dtype,
        ):
            raise ValueError(
                f"vLLM's cache holds {paged.num_kv_heads} KV heads x {paged.head_dim} "
                f"{paged.dtype}, the node's blocks {node.num_kv_heads} x {node.head_dim} "
                f"{node.dtype}"
            )
        kbs = paged.kernel_block_size
        if kbs % node.block_size or vllm_block_size % kbs:
            raise ValueError(
                f"the node's block size ({node.block_size}) must divide vLLM's kernel block "
                f"size ({kbs}), which must divide vLLM's block size ({vllm_block_size})"
            )
        self.paged = paged
        self.node = node
        self.vllm_block_size = vllm_block_size
        self.per_vllm_block = vllm_block_size // node.block_size
        self._kernel_per_block = vllm_block_size // kbs
        self._subs = kbs // node.block_size
        # Element offsets of each node sub-block of a kernel block:
        # [sub, K/V, block_size, heads, dim].
        o = paged.offsets.view(2, self._subs, node.block_size, paged.num_kv_heads, paged.head_dim)
        self._sub_offsets = o.permute(1, 0, 2, 3, 4).contiguous()

    def check_layers(self, layers: Sequence[torch.Tensor]) -> None:
        """ValueError unless ``layers`` are the node layout's layers of this cache."""
        p = self.paged
        if len(layers) != self.node.num_layers:
            raise ValueError(
                f"{len(layers)} layers of KV cache, the node's blocks hold {self.node.num_layers}"
            )
        for i, t in enumerate(layers):
            want = (p.num_kv_heads, p.kernel_block_size, 2 * p.head_dim)
            if tuple(t.shape[1:]) != want or t.dtype != p.dtype or not t.is_contiguous():
                raise ValueError(
                    f"layer {i}: a contiguous [blocks, {', '.join(map(str, want))}] {p.dtype} "
                    f"cache expected, got {t.dtype} {tuple(t.shape)}"
                )

    def places(
        self, block_ids: Sequence[int], first: int, count: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Kernel block and sub-block of a request's node blocks ``first`` to
        ``first + count - 1``, its vLLM blocks being ``block_ids``."""
        bs, kbs = self.node.block_size, self.paged.kernel_block_size
        kernel, sub = [], []
        for k in range(first, first + count):
            token = (k % self.per_vllm_block) * bs
            kernel.append(
                block_ids[k // self.per_vllm_block] * self._kernel_per_block + token // kbs
            )
            sub.append((token % kbs) // bs)
        return torch.tensor(kernel, dtype=torch.int64), torch.tensor(sub, dtype=torch.int64)

    def gather(
        self,
        layers: Sequence[torch.Tensor],
        places: tuple[torch.Tensor, torch.Tensor],
        rows: torch.Tensor,
    ) -> None:
        """Node blocks at ``places`` into ``rows`` (uint8 ``[n, block_bytes]``)."""
        kernel, sub = places
        typed = self.node.typed(rows)
        if self.paged.affine is not None:
            for layer, t in enumerate(layers):
                for kv, a in enumerate(self.paged.affine):
                    typed[:, layer, kv] = self._strided(t, a)[kernel, sub]
            return
        idx = self._element_index(kernel, sub)
        for layer, t in enumerate(layers):
            typed[:, layer] = t.view(-1)[idx]

    def scatter(
        self,
        layers: Sequence[torch.Tensor],
        places: tuple[torch.Tensor, torch.Tensor],
        rows: torch.Tensor,
    ) -> None:
        """``rows`` (uint8 ``[n, block_bytes]``) into the node blocks at ``places``."""
        kernel, sub = places
        typed = self.node.typed(rows)
        if self.paged.affine is not None:
            for layer, t in enumerate(layers):
                for kv, a in enumerate(self.paged.affine):
                    self._strided(t, a).index_put_((kernel, sub), typed[:, layer, kv])
            return
        idx = self._element_index(kernel, sub).reshape(-1)
        for layer, t in enumerate(layers):
            t.view(-1).index_put_((idx,), typed[:, layer].reshape(-1))

    def _strided(self, layer: torch.Tensor, a: Affine) -> torch.Tensor:
        """K or V (placed as ``a``) of ``layer`` as ``[kernel block, sub-block,
        token, head, dim]``."""
        bs = self.node.block_size
        return torch.as_strided(
            layer,
            (layer.shape[0], self._subs, bs, self.paged.num_kv_heads, self.paged.head_dim),
            (self.paged.block_elems, bs * a.token, a.token, a.head, a.dim),
            layer.storage_offset() + a.base,
        )

    def _element_index(self, kernel: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
        """Element index of each node block's values in a layer's flat cache:
        ``[n, K/V, block_size, heads, dim]``."""
        base = (kernel * self.paged.block_elems).view(-1, 1, 1, 1, 1)
        return base + self._sub_offsets[sub]
