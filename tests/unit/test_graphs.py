"""Decode steps through fixed-shape buckets (engine/graphs.py), without a GPU.

The CUDA capture itself is tested in tests/cuda. Here the same fixed-shape
forward runs eagerly (``capture=False``) over a reference of flash-attn's
paged decode kernel (attention from the block table and context lengths
alone), so what the graph path adds is checked on the CPU: bucket choice,
the buffer layout, padding rows that leave the cache exactly as it was, and
greedy output identical to the eager runner's as the batch shrinks through
the buckets.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from mooncaked.config import ModelConfig
from mooncaked.engine.attention import AttentionBackend, AttentionMetadata, PagedKV, write_kv
from mooncaked.engine.connector import KVConnector
from mooncaked.engine.graphs import (
    MAX_GRAPH_BATCH,
    DecodeGraphs,
    bucket_sizes,
    graph_unavailable_reason,
)
from mooncaked.engine.loader import LoadedModel, load_model
from mooncaked.engine.plan import StepPlan, chunk_of
from mooncaked.engine.runner import ModelRunner
from mooncaked.request import Request, SamplingParams

BLOCK = 16
NUM_BLOCKS = 48


class PagedDecodeReference(AttentionBackend):
    """What ``flash_attn_with_kvcache`` computes for one-token queries, in torch:
    each row attends to the first ``context_lens[i]`` keys its block table
    names. Reads only the metadata's tensors, like the kernel."""

    name = "paged-decode-reference"
    static_decode = True

    def attend(self, q: torch.Tensor, kv: PagedKV, meta: AttentionMetadata) -> torch.Tensor:
        b, w = meta.block_tables.shape
        bs, kvh, d = kv.k_cache.shape[1:]
        blocks = meta.block_tables.long().flatten()
        keys = kv.k_cache.index_select(0, blocks).view(b, w * bs, kvh, d).transpose(1, 2)
        values = kv.v_cache.index_select(0, blocks).view(b, w * bs, kvh, d).transpose(1, 2)
        real = torch.arange(w * bs)[None, :] < meta.context_lens_tensor.long()[:, None]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, H, 1, D]
            keys,
            values,
            attn_mask=real[:, None, None, :],
            scale=d**-0.5,
            enable_gqa=True,
        )
        return out.squeeze(2)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(ModelConfig(seed=0))


def _graphed(loaded: LoadedModel, max_batch: int = 8) -> ModelRunner:
    runner = ModelRunner(loaded, num_blocks=NUM_BLOCKS, block_size=BLOCK, cuda_graphs="off")
    runner.graphs = DecodeGraphs(
        runner._decode_forward,
        backend=PagedDecodeReference(),
        device=runner.device,
        block_size=BLOCK,
        max_model_len=runner.max_model_len,
        max_batch=max_batch,
        capture=False,
    )
    return runner


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert bucket_sizes(1000)[-1] == MAX_GRAPH_BATCH
    with pytest.raises(ValueError, match="max_batch"):
        bucket_sizes(0)


def test_cpu_runs_eagerly_and_on_says_why(tiny: LoadedModel) -> None:
    runner = ModelRunner(tiny, num_blocks=4, block_size=BLOCK)
    assert runner.graphs is None
    assert "CUDA device" in runner.graphs_off_reason
    assert "CUDA device" in (graph_unavailable_reason(runner.device, runner.backend) or "")
    with pytest.raises(ValueError, match=r"model\.cuda_graphs = 'on': CUDA graphs need a CUDA"):
        ModelRunner(tiny, num_blocks=4, block_size=BLOCK, cuda_graphs="on")
    with pytest.raises(ValueError, match=r"model\.cuda_graphs = 'sometimes'"):
        ModelRunner(tiny, num_blocks=4, block_size=BLOCK, cuda_graphs="sometimes")
    off = ModelRunner(tiny, num_blocks=4, block_size=BLOCK, cuda_graphs="off")
    assert off.graphs is None and off.graphs_off_reason == "model.cuda_graphs = off"
    # A prefill-only node: auto captures nothing; on still tries (and says why not).
    prefill = ModelRunner(tiny, num_blocks=4, block_size=BLOCK, decodes=False)
    assert prefill.graphs_off_reason == "a prefill-only node does not decode"
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA"):
        ModelRunner(tiny, num_blocks=4, block_size=BLOCK, cuda_graphs="on", decodes=False)


def test_sdpa_backend_cannot_be_captured(tiny: LoadedModel) -> None:
    runner = ModelRunner(tiny, num_blocks=4, block_size=BLOCK)
    reason = graph_unavailable_reason(torch.device("cuda"), runner.backend)
    assert reason is not None and "sdpa" in reason and "flash" in reason
    assert graph_unavailable_reason(torch.device("cuda"), PagedDecodeReference()) is None


def test_write_kv_keep_leaves_the_slot_as_it_was() -> None:
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4, BLOCK, 2, 8, generator=g)
    v_cache = torch.randn(4, BLOCK, 2, 8, generator=g)
    k0, v0 = k_cache.clone(), v_cache.clone()
    k = torch.randn(4, 2, 8, generator=g)
    v = torch.randn(4, 2, 8, generator=g)
    # Rows 2 and 3 pad, both pointed at slot 5; rows 0 and 1 are real.
    slots = torch.tensor([17, 40, 5, 5])
    keep = torch.tensor([False, False, True, True])
    write_kv(k, v, k_cache, v_cache, slots, keep)
    kf, vf = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    assert torch.equal(kf[17], k[0]) and torch.equal(vf[40], v[1])
    changed = (k_cache != k0).any(-1).any(-1).flatten().nonzero().flatten().tolist()
    assert changed == [17, 40]
    assert torch.equal(v_cache.view(-1, 2, 8)[5], v0.view(-1, 2, 8)[5])


def _decode_all(
    runner: ModelRunner, prompts: list[list[int]], lengths: list[int], seed: int
) -> tuple[list[list[int]], list[int]]:
    """Greedy decode; sequence i stops after lengths[i] tokens, so the batch
    shrinks. Block tables are shuffled block ids. Returns the outputs and the
    batch size of each decode step."""
    rng = random.Random(seed)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    reqs, tables = [], []
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        k = (len(p) + n + BLOCK - 1) // BLOCK
        tables.append([free.pop() for _ in range(k)])
        reqs.append(Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n)))
    plan = StepPlan(
        [chunk_of(r, r.prompt_token_ids, 0, t, True) for r, t in zip(reqs, tables, strict=True)]
    )
    live = list(range(len(reqs)))
    sizes: list[int] = []
    while live:
        for i, tok in zip(live, runner.execute(plan), strict=True):
            assert tok is not None
            reqs[i].output_token_ids.append(tok.token_id)
        live = [i for i in live if len(reqs[i].output_token_ids) < lengths[i]]
        plan = StepPlan(
            [
                chunk_of(
                    reqs[i], [reqs[i].output_token_ids[-1]], reqs[i].num_tokens - 1, tables[i], True
                )
                for i in live
            ]
        )
        if live:
            sizes.append(len(live))
    return [r.output_token_ids for r in reqs], sizes


@pytest.mark.slow
def test_bucketed_decode_matches_eager_and_leaves_no_trace(tiny: LoadedModel) -> None:
    g = torch.Generator().manual_seed(3)
    lens = [5, 37, 16, 1, 60, 23, 9]
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lens]
    out_lens = [12, 3, 20, 7, 16, 1, 25]
    eager = ModelRunner(tiny, num_blocks=NUM_BLOCKS, block_size=BLOCK)
    graphed = _graphed(tiny)
    want, sizes = _decode_all(eager, prompts, out_lens, seed=1)
    got, sizes_g = _decode_all(graphed, prompts, out_lens, seed=1)
    assert sizes == sizes_g
    # The batch passed through buckets 8, 4, 2 and 1, padded in most steps.
    assert graphed.graphs is not None
    assert {graphed.graphs.bucket(n) for n in sizes} == {8, 4, 2, 1}
    assert any(graphed.graphs.bucket(n) != n for n in sizes)
    assert graphed.graphs.num_replays == len(sizes)
    assert got == want
    # Every K/V either runner wrote agrees, and the padding rows wrote nothing:
    # blocks no sequence owns are still zero.
    # (Within float32 rounding: the two attention kernels sum in different orders.)
    torch.testing.assert_close(graphed.kv_buffer, eager.kv_buffer, atol=1e-3, rtol=1e-3)
    assert torch.equal(graphed.kv_buffer == 0, eager.kv_buffer == 0)


def test_logits_match_eager_per_step(tiny: LoadedModel) -> None:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (20, 33, 8)]
    runners = (ModelRunner(tiny, num_blocks=NUM_BLOCKS, block_size=BLOCK), _graphed(tiny))
    tables = [[0, 1, 2], [9, 4, 7], [30, 31, 32]]
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)]
    prefill = StepPlan(
        [chunk_of(r, r.prompt_token_ids, 0, t, True) for r, t in zip(reqs, tables, strict=True)]
    )
    for r in runners:
        r.forward_logits(prefill)
    step = StepPlan(
        [
            chunk_of(r, [7 + i], len(r.prompt_token_ids), t, True)
            for i, (r, t) in enumerate(zip(reqs, tables, strict=True))
        ]
    )
    want = runners[0].forward_logits(step)
    got = runners[1].forward_logits(step)
    assert runners[1].graphs is not None and runners[1].graphs.num_replays == 1
    # float32 rounding: a padded batch of 4 and a batch of 3 take different
    # GEMM blockings, and the attention kernels sum in different orders.
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


class _Recorder(KVConnector):
    def __init__(self) -> None:
        self.layers: list[int] = []

    def save_layer(self, layer: int, meta: object) -> None:
        self.layers.append(layer)


def test_prefill_and_per_layer_connector_work_run_eagerly(tiny: LoadedModel) -> None:
    runner = _graphed(tiny, max_batch=2)
    graphs = runner.graphs
    assert graphs is not None
    reqs = [Request(f"r{i}", [5, 6, 7], SamplingParams(temperature=0.0)) for i in range(3)]
    tables = [[0], [1], [2]]
    runner.execute(StepPlan([chunk_of(reqs[0], [5, 6, 7], 0, tables[0], True)]))
    assert graphs.num_replays == 0  # a prefill
    one = StepPlan([chunk_of(reqs[0], [8], 3, tables[0], True)])
    one.connector_meta = "sends"
    connector = _Recorder()
    runner.run(one, connector)
    assert graphs.num_replays == 0 and connector.layers == list(range(tiny.arch.num_layers))
    for r, t in zip(reqs[1:], tables[1:], strict=True):
        runner.execute(StepPlan([chunk_of(r, [5, 6, 7], 0, t, True)]))
    three = StepPlan([chunk_of(r, [8], 3, t, True) for r, t in zip(reqs, tables, strict=True)])
    runner.execute(three)
    assert graphs.num_replays == 0  # three decodes: past the largest bucket
    runner.execute(
        StepPlan([chunk_of(r, [9], 4, t, True) for r, t in zip(reqs, tables[:2], strict=False)])
    )
    assert graphs.num_replays == 1


def test_run_rejects_bad_rows(tiny: LoadedModel) -> None:
    runner = _graphed(tiny, max_batch=2)
    graphs = runner.graphs
    assert graphs is not None
    with pytest.raises(ValueError, match=r"1\.\.2 rows"):
        graphs.run([1, 2, 3], [0, 0, 0], [[0], [1], [2]])
    with pytest.raises(ValueError, match=r"1\.\.2 rows"):
        graphs.run([], [], [])
    with pytest.raises(ValueError, match="sequence 0: block table has 1 blocks, 2 are needed"):
        graphs.run([1], [BLOCK], [[0]])
    assert graphs.num_replays == 0
