"""vLLM's CPU paged KV layout <-> mooncaked's block rows, without vLLM: the
cache writes below place elements as vLLM's ``vec`` kernel does (checked
against the real kernel by tests/vllm/) and as a packing kernel might."""

from __future__ import annotations

import pytest
import torch

from mooncaked.cache.layout import BlockLayout
from mooncaked.integrations.vllm_layout import Affine, PagedLayout, RowMap

HEADS, DIM, KBS = 2, 4, 8


def vec_write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor):
    """vLLM's ``vec`` ISA: per head, K as [dim, tokens], then V as [tokens, dim]."""
    nb, heads, kbs, two_dim = cache.shape
    dim = two_dim // 2
    planes = cache.view(nb, heads, 2, kbs * dim)
    k = planes[:, :, 0].view(nb, heads, dim, kbs)
    v = planes[:, :, 1].view(nb, heads, kbs, dim)
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(slot, kbs)
        k[b, :, :, t] = key[i]
        v[b, :, t, :] = value[i]


def paired_write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor):
    """A packing kernel: tokens in pairs, each pair's dims interleaved (not affine)."""
    nb, heads, kbs, two_dim = cache.shape
    dim = two_dim // 2
    planes = cache.view(nb, heads, 2, kbs // 2, dim, 2)
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(slot, kbs)
        planes[b, :, 0, t // 2, :, t % 2] = key[i]
        planes[b, :, 1, t // 2, :, t % 2] = value[i]


def lossy_write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor):
    vec_write(key * 2, value, cache, slots)


def probe(write, dtype: torch.dtype = torch.bfloat16) -> PagedLayout:
    return PagedLayout.probe(
        write, num_kv_heads=HEADS, head_dim=DIM, kernel_block_size=KBS, dtype=dtype
    )


def test_the_probe_learns_vecs_placement_as_strides() -> None:
    paged = probe(vec_write)
    k_plane = KBS * DIM
    assert paged.affine == (
        Affine(base=0, token=1, head=2 * k_plane, dim=KBS),
        Affine(base=k_plane, token=DIM, head=2 * k_plane, dim=1),
    )
    # Element (V, token 3, head 1, dim 2): head 1's planes, V's, row 3, column 2.
    assert int(paged.offsets[1, 3, 1, 2]) == 2 * k_plane + k_plane + 3 * DIM + 2


def test_a_packed_placement_is_learnt_but_not_strided() -> None:
    paged = probe(paired_write, torch.float32)
    assert paged.affine is None
    assert int(paged.offsets[0, 5, 0, 1]) == (5 // 2) * DIM * 2 + 1 * 2 + 1


def test_a_write_that_changes_values_is_refused() -> None:
    with pytest.raises(ValueError, match="did not keep the probe's values"):
        probe(lossy_write)
    with pytest.raises(ValueError, match="exactly once"):
        PagedLayout.of_offsets(torch.zeros((2, KBS, HEADS, DIM), dtype=torch.int64), torch.float16)


def vllm_caches(
    write, num_layers: int, num_kernel_blocks: int, tokens: dict[int, torch.Tensor], dtype
) -> list[torch.Tensor]:
    """Per layer, a cache whose kernel blocks hold ``tokens[block]``
    ([layers, 2, KBS, heads, dim]) written through ``write``."""
    caches = [torch.zeros((num_kernel_blocks, HEADS, KBS, 2 * DIM), dtype=dtype)]
    caches += [torch.zeros_like(caches[0]) for _ in range(num_layers - 1)]
    for b, kv in tokens.items():
        slots = torch.arange(b * KBS, (b + 1) * KBS)
        for layer, cache in enumerate(caches):
            write(kv[layer, 0], kv[layer, 1], cache, slots)
    return caches


@pytest.mark.parametrize("write", [vec_write, paired_write], ids=["strided", "indexed"])
@pytest.mark.parametrize("node_block", [2, 4, 8])
def test_gather_then_scatter_moves_exactly_the_node_blocks(write, node_block: int) -> None:
    dtype = torch.float32 if write is paired_write else torch.bfloat16
    num_layers, vllm_block = 3, 2 * KBS  # two kernel blocks per vLLM block
    node = BlockLayout(num_layers, node_block, HEADS, DIM, dtype)
    rmap = RowMap(probe(write, dtype), node, vllm_block)
    g = torch.Generator().manual_seed(7)
    # The request's vLLM blocks are 2 then 0 (kernel blocks 4, 5 then 0, 1).
    truth = {kb: torch.randn((num_layers, 2, KBS, HEADS, DIM), generator=g) for kb in (4, 5, 0, 1)}
    truth = {kb: t.to(dtype) for kb, t in truth.items()}
    src = vllm_caches(write, num_layers, 8, truth, dtype)
    rmap.check_layers(src)
    r = vllm_block // node_block
    first, count = r - 1, r + 1  # from the last node block of vLLM block 2 into block 0
    places = rmap.places([2, 0], first, count)
    rows = torch.zeros((count, node.block_bytes), dtype=torch.uint8)
    rmap.gather(src, places, rows)
    typed = node.typed(rows)
    for i, k in enumerate(range(first, first + count)):
        token = k * node_block  # of the request
        kb = [4, 5, 0, 1][token // KBS]
        t0 = token % KBS
        # Row i holds node block k: every layer's K and V of its tokens, token-major.
        expected = truth[kb][:, :, t0 : t0 + node_block]
        assert torch.equal(typed[i], expected), f"node block {k}"
    # Into another instance's cache at other block ids (3 then 1): the same
    # values land at the same tokens, nothing else is touched.
    dst = vllm_caches(write, num_layers, 8, {}, dtype)
    dst_places = rmap.places([3, 1], first, count)
    rmap.scatter(dst, dst_places, rows)
    again = torch.zeros_like(rows)
    rmap.gather(dst, dst_places, again)
    assert torch.equal(again, rows)
    written = sum(int((t != 0).sum()) for t in dst)
    assert written == count * node_block * num_layers * 2 * HEADS * DIM


def test_a_row_map_refuses_what_does_not_fit() -> None:
    paged = probe(vec_write)
    with pytest.raises(ValueError, match="KV heads"):
        RowMap(paged, BlockLayout(2, 4, HEADS + 1, DIM, torch.bfloat16), KBS)
    with pytest.raises(ValueError, match="must divide"):
        RowMap(paged, BlockLayout(2, 16, HEADS, DIM, torch.bfloat16), KBS)
    rmap = RowMap(paged, BlockLayout(2, 4, HEADS, DIM, torch.bfloat16), KBS)
    with pytest.raises(ValueError, match="3 layers"):
        rmap.check_layers([torch.zeros((4, HEADS, KBS, 2 * DIM), dtype=torch.bfloat16)] * 3)
    with pytest.raises(ValueError, match="layer 1"):
        rmap.check_layers(
            [
                torch.zeros((4, HEADS, KBS, 2 * DIM), dtype=torch.bfloat16),
                torch.zeros((4, HEADS, KBS, 2 * DIM), dtype=torch.float16),
            ]
        )
