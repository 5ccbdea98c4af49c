from __future__ import annotations

import math

import pytest
import torch

from mooncaked.engine.sampler import Sampler, token_seed
from mooncaked.request import SamplingParams


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _sampler(seed: int = 1234) -> Sampler:
    return Sampler(generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0)] * 6
    out = _sampler().sample(logits, params, [0] * 6)
    assert [t.token_id for t in out] == logits.argmax(dim=-1).tolist()
    assert all(t.logprob is None for t in out)


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = _logits(8, seed=3)
    argmax = logits.argmax(dim=-1).tolist()
    s = _sampler()
    for i in range(5):
        top_k = s.sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 8, [i] * 8)
        assert [t.token_id for t in top_k] == argmax
        top_p = s.sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6, seed=i)] * 8, [i] * 8)
        assert [t.token_id for t in top_p] == argmax


def test_same_seed_same_tokens_and_different_index_differs() -> None:
    logits = torch.zeros(1, 1000)  # uniform: every draw is pure RNG
    p = [SamplingParams(temperature=1.0, seed=42)]
    first = [_sampler(1).sample(logits, p, [i])[0].token_id for i in range(20)]
    again = [_sampler(2).sample(logits, p, [i])[0].token_id for i in range(20)]
    assert first == again
    assert len(set(first)) > 10  # the output index moves the stream
    other_seed = [
        _sampler(1).sample(logits, [SamplingParams(temperature=1.0, seed=43)], [i])[0].token_id
        for i in range(20)
    ]
    assert other_seed != first


def test_seeded_row_is_independent_of_batch_composition() -> None:
    vocab = 300
    row = _logits(1, vocab, seed=9)
    seeded = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=7)
    alone = _sampler(5).sample(row, [seeded], [13])[0].token_id

    others = _logits(4, vocab, seed=10)
    batch = torch.cat([others[:2], row, others[2:]])
    params = [
        SamplingParams(temperature=0.7),  # unseeded: draws from the shared generator
        SamplingParams(temperature=0.0),
        seeded,
        SamplingParams(temperature=1.0, seed=8),
        SamplingParams(temperature=1.2, top_k=5),
    ]
    for gen_seed in range(5):
        out = _sampler(gen_seed).sample(batch, params, [0, 3, 13, 13, 2])
        assert out[2].token_id == alone


def test_unseeded_rows_follow_the_injected_generator() -> None:
    logits = torch.zeros(3, 500)
    params = [SamplingParams(temperature=1.0)] * 3
    a = [t.token_id for t in _sampler(99).sample(logits, params, [0, 0, 0])]
    b = [t.token_id for t in _sampler(99).sample(logits, params, [0, 0, 0])]
    c = [t.token_id for t in _sampler(100).sample(logits, params, [0, 0, 0])]
    assert a == b
    assert a != c


def test_top_k_restricts_to_the_k_best() -> None:
    logits = _logits(1, 40, seed=4)
    best2 = set(logits[0].topk(2).indices.tolist())
    seen = {
        _sampler()
        .sample(logits, [SamplingParams(temperature=2.0, top_k=2, seed=s)], [0])[0]
        .token_id
        for s in range(60)
    }
    assert seen == best2


def test_top_p_keeps_the_nucleus() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two only.
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    seen = {
        _sampler()
        .sample(logits, [SamplingParams(temperature=1.0, top_p=0.7, seed=s)], [0])[0]
        .token_id
        for s in range(80)
    }
    assert seen == {1, 3}


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log()[None, :]
    counts = [0, 0, 0]
    for s in range(2000):
        t = _sampler().sample(logits, [SamplingParams(temperature=1.0, seed=s)], [0])[0]
        counts[t.token_id] += 1
    freqs = [c / 2000 for c in counts]
    for f, p in zip(freqs, probs.tolist(), strict=True):
        assert abs(f - p) < 0.05


def test_logprobs_come_from_the_unmodified_logits() -> None:
    logits = _logits(3, 30, seed=11)
    logp = torch.log_softmax(logits, dim=-1)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=1.9, top_k=3, seed=1, logprobs=0),
        SamplingParams(temperature=0.5, seed=2),
    ]
    out = _sampler().sample(logits, params, [0, 0, 0])
    lp0 = out[0].logprob
    assert lp0 is not None and lp0.token_id == out[0].token_id
    assert math.isclose(lp0.logprob, logp[0].max().item(), abs_tol=1e-6)
    assert len(lp0.top) == 5
    assert [t for t, _ in lp0.top] == logp[0].topk(5).indices.tolist()
    assert all(a[1] >= b[1] for a, b in zip(lp0.top, lp0.top[1:], strict=False))
    lp1 = out[1].logprob
    assert lp1 is not None and lp1.top == []
    assert math.isclose(lp1.logprob, logp[1, out[1].token_id].item(), abs_tol=1e-6)
    assert out[2].logprob is None


def test_shape_mismatch_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="one SamplingParams"):
        _sampler().sample(_logits(2), [SamplingParams()], [0])


def test_token_seed_is_stable() -> None:
    # Pinned: a resumed request on another node must draw the same stream.
    assert token_seed(42, 0) == token_seed(42, 0)
    assert token_seed(42, 0) != token_seed(42, 1)
    assert token_seed(-1, 5) != token_seed(1, 5)
    assert 0 <= token_seed(2**40, 7) < 2**63
