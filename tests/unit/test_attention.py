"""Paged SDPA decode attention: groups of decodes, and decodes that share a
prompt prefix attending to its blocks once (cascade), against attention
computed sequence by sequence in float64."""

from __future__ import annotations

import pytest
import torch

from mooncaked.config import ModelConfig
from mooncaked.engine.attention import (
    _MIN_SHARED_BLOCKS,
    AttentionMetadata,
    PagedKV,
    SdpaBackend,
    build_metadata,
    shared_prefixes,
)
from mooncaked.engine.loader import LoadedModel, load_model
from mooncaked.engine.plan import StepPlan, chunk_of
from mooncaked.engine.runner import ModelRunner
from mooncaked.request import Request, SamplingParams

BS = 16
HEADS, KV_HEADS, DIM = 6, 2, 32
CPU = torch.device("cpu")


def _meta(
    contexts: list[int], tables: list[list[int]], dtype: torch.dtype = torch.float32
) -> AttentionMetadata:
    """A step of decodes: one new token per sequence, at position context - 1."""
    return build_metadata(
        query_lens=[1] * len(contexts),
        start_positions=[c - 1 for c in contexts],
        block_tables=tables,
        block_size=BS,
        device=CPU,
        backend=SdpaBackend(HEADS, KV_HEADS, DIM),
        dtype=dtype,
    )


def _reference(
    q: torch.Tensor, kv: PagedKV, contexts: list[int], tables: list[list[int]]
) -> torch.Tensor:
    """Each sequence's query over its keys, one at a time, in float64."""
    group = HEADS // KV_HEADS
    out = []
    for i, (ctx, table) in enumerate(zip(contexts, tables, strict=True)):
        blocks = torch.tensor(table[: -(-ctx // BS)])
        k = kv.k_cache[blocks].reshape(-1, KV_HEADS, DIM)[:ctx].double()
        v = kv.v_cache[blocks].reshape(-1, KV_HEADS, DIM)[:ctx].double()
        k = k.repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].double(), k) / DIM**0.5
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def _tables(shared: int, own: list[int], num_blocks: int) -> list[list[int]]:
    """Block tables that start with the same ``shared`` blocks, then each its
    own, from a shuffled pool (the pool hands out blocks in any order)."""
    pool = torch.randperm(num_blocks).tolist()
    common, pool = pool[:shared], pool[shared:]
    tables = []
    for n in own:
        tables.append(common + pool[:n])
        pool = pool[n:]
    return tables


def test_decodes_that_start_with_the_same_blocks_are_one_family() -> None:
    k = _MIN_SHARED_BLOCKS
    tables = _tables(k + 2, [2, 3, 1], 56)
    alone = [60, 61, 62, 63]  # a block table of its own
    short = [*tables[0][:k], 59]  # shares only k blocks with the others
    contexts = [(k + 3) * BS, (k + 4) * BS - 5, (k + 3) * BS - 1, 3 * BS, (k + 1) * BS - 2]
    meta = _meta(contexts, [*tables, alone, short])
    families, rest = shared_prefixes(meta, meta.decode_seq_ids, [*tables, alone, short])
    # "short" shares k blocks with the others, so the family shares k; the
    # sequence with a context of 3 blocks has too few to share any.
    assert families == [([0, 1, 2, 4], k)]
    assert rest == [3]
    # Without "short", the family shares every block before the ones written.
    families, rest = shared_prefixes(meta, [0, 1, 2], tables)
    assert families == [([0, 1, 2], k + 2)]
    assert rest == []


def test_a_block_being_written_or_a_short_run_is_not_shared() -> None:
    k = _MIN_SHARED_BLOCKS
    tables = _tables(k, [1, 1], 32)
    # Context k * 16 + 1: the k-th block (index k - 1) is whole, so k are shared.
    meta = _meta([k * BS + 1, k * BS + 1], tables)
    assert shared_prefixes(meta, [0, 1], tables)[0] == [([0, 1], k)]
    # Context k * 16: the newest token is in block k - 1, so only k - 1 whole
    # blocks come before it: too few to share.
    tables = [t[:k] for t in tables]
    meta = _meta([k * BS, k * BS], tables)
    assert shared_prefixes(meta, [0, 1], tables) == ([], [0, 1])
    # A lone sequence is no family.
    tables = _tables(k, [1], 32)
    meta = _meta([k * BS + 1], tables)
    assert shared_prefixes(meta, [0], tables) == ([], [0])


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_attention_with_shared_prefixes_matches_each_sequence_alone(
    dtype: torch.dtype, tol: float
) -> None:
    torch.manual_seed(0)
    num_blocks = 96
    k_cache = torch.randn(num_blocks, BS, KV_HEADS, DIM).to(dtype)
    v_cache = torch.randn(num_blocks, BS, KV_HEADS, DIM).to(dtype)
    # Two families (shared runs of 6 and 5 blocks, own tails of different
    # lengths) and two sequences of their own, in a mixed order.
    fam_a = _tables(6, [3, 1, 2], 40)
    fam_b = [[40 + b for b in t] for t in _tables(5, [2, 4], 40)]
    own = [[80, 81, 82], [83, 84, 85, 86, 87, 88, 89, 90, 91]]
    tables = [fam_a[0], own[0], fam_b[0], fam_a[1], fam_b[1], own[1], fam_a[2]]
    contexts = [9 * BS - 3, 3 * BS - 7, 7 * BS - 1, 6 * BS + 5, 9 * BS, 9 * BS - 11, 8 * BS - 15]
    meta = _meta(contexts, tables, dtype)
    assert sum(g.prefix is not None for g in meta.decode_groups) == 2
    q = torch.randn(len(contexts), HEADS, DIM).to(dtype)
    # The step's new K/V are the ones already in their slots: attend reads the cache.
    kv = PagedKV(torch.empty(0), torch.empty(0), k_cache, v_cache)
    got = SdpaBackend(HEADS, KV_HEADS, DIM).attend(q, kv, meta)
    want = _reference(q, kv, contexts, tables)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(ModelConfig(seed=0))


def _decode_greedy(
    runner: ModelRunner, reqs: list[Request], tables: list[list[int]], steps: int
) -> None:
    """Decode the prefilled ``reqs`` together for ``steps`` greedy tokens."""
    for _ in range(steps):
        chunks = [
            chunk_of(r, [r.output_token_ids[-1]], r.num_tokens - 1, t, True)
            for r, t in zip(reqs, tables, strict=True)
        ]
        for r, tok in zip(reqs, runner.execute(StepPlan(chunks)), strict=True):
            assert tok is not None
            r.output_token_ids.append(tok.token_id)


def test_requests_sharing_prompt_blocks_decode_as_each_alone(tiny: LoadedModel) -> None:
    """Three requests on one prefix held once (as the prefix cache shares it):
    the first prefills it, the others only their tails into blocks of their
    own; decoded together, each gives the tokens it gives alone."""
    steps = 24
    prefix = [(7 * i + 3) % 200 + 1 for i in range(6 * BS)]  # 6 whole blocks
    tails = [[11, 12, 13], list(range(21, 38)), [41]]
    prompts = [prefix + t for t in tails]
    runner = ModelRunner(tiny, num_blocks=64, block_size=BS)
    own_blocks = 4
    tables = [
        list(range(6)) + list(range(6 + own_blocks * i, 6 + own_blocks * (i + 1))) for i in range(3)
    ]
    reqs = [Request(f"s{i}", p, SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)]
    first = runner.execute(StepPlan([chunk_of(reqs[0], prompts[0], 0, tables[0], True)]))[0]
    assert first is not None
    reqs[0].output_token_ids.append(first.token_id)
    for r, t in zip(reqs[1:], tables[1:], strict=True):
        start = len(prefix)
        tok = runner.execute(StepPlan([chunk_of(r, r.prompt_token_ids[start:], start, t, True)]))[0]
        assert tok is not None
        r.output_token_ids.append(tok.token_id)
    _decode_greedy(runner, reqs, tables, steps)

    for prompt, shared in zip(prompts, reqs, strict=True):
        alone = ModelRunner(tiny, num_blocks=64, block_size=BS)
        req = Request("alone", prompt, SamplingParams(temperature=0.0))
        table = list(range(10))
        tok = alone.execute(StepPlan([chunk_of(req, prompt, 0, table, True)]))[0]
        assert tok is not None
        req.output_token_ids.append(tok.token_id)
        _decode_greedy(alone, [req], [table], steps)
        assert req.output_token_ids == shared.output_token_ids


@pytest.mark.parametrize("num_seqs", [1, 5, 40])
def test_decodes_without_shared_blocks_match_each_sequence_alone(num_seqs: int) -> None:
    """One group of every row in step order (no gather of queries or outputs),
    or several groups by length once there are enough sequences."""
    torch.manual_seed(num_seqs)
    k_cache = torch.randn(8 * num_seqs, BS, KV_HEADS, DIM)
    v_cache = torch.randn(8 * num_seqs, BS, KV_HEADS, DIM)
    pool = torch.randperm(8 * num_seqs).tolist()
    # Lengths out of order, long and short mixed: a short one (too few
    # blocks to share anything) before and after long ones.
    contexts = [(7 * i) % 100 + 5 for i in range(num_seqs)]
    tables = [pool[8 * i : 8 * i + -(-c // BS)] for i, c in enumerate(contexts)]
    meta = _meta(contexts, tables)
    assert meta.decode_whole == (num_seqs < 32)
    assert len(meta.decode_groups) == (1 if num_seqs < 32 else 2)
    q = torch.randn(num_seqs, HEADS, DIM)
    # A query that is a slice of a wider projection, as the model's is.
    q = torch.cat([q, torch.randn(num_seqs, 2, DIM)], dim=1)[:, :HEADS]
    kv = PagedKV(torch.empty(0), torch.empty(0), k_cache, v_cache)
    got = SdpaBackend(HEADS, KV_HEADS, DIM).attend(q, kv, meta)
    torch.testing.assert_close(
        got.double(), _reference(q, kv, contexts, tables), atol=1e-5, rtol=1e-5
    )
