"""Greedy runs through our runner and their comparison with a reference's logits."""

from __future__ import annotations

from typing import Any

import torch

from mooncaked.engine.loader import LoadedModel
from mooncaked.engine.plan import StepPlan, chunk_of
from mooncaked.engine.runner import ModelRunner
from mooncaked.request import Request, SamplingParams

BLOCK = 16


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(ids), vocab] over one sequence, in float32."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def greedy_logits(
    loaded: LoadedModel,
    prompt: list[int],
    new_tokens: int,
    *,
    block_size: int = BLOCK,
    backend: str = "auto",
    cuda_graphs: str = "off",
) -> torch.Tensor:
    """Our logits [len(prompt) + new_tokens - 1, vocab]: one prefill, then greedy
    decode steps through the paged cache, each step's single row appended."""
    runner = ModelRunner(
        loaded, num_blocks=16, block_size=block_size, backend=backend, cuda_graphs=cuda_graphs
    )
    if cuda_graphs == "on" and runner.graphs is None:
        raise RuntimeError(f"no CUDA graphs: {runner.graphs_off_reason}")
    table = list(range((len(prompt) + new_tokens + block_size - 1) // block_size))
    req = Request("g", prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens))
    (logits,) = runner.forward_logits(StepPlan([chunk_of(req, prompt, 0, table, True)]))
    rows = [logits]
    ids = list(prompt)
    for _ in range(new_tokens - 1):
        ids.append(int(rows[-1][-1].argmax()))
        (step,) = runner.forward_logits(
            StepPlan([chunk_of(req, [ids[-1]], len(ids) - 1, table, True)])
        )
        rows.append(step)
    return torch.cat(rows)


def greedy_together(
    runner: ModelRunner, prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    """Our greedy tokens for every prompt: one step prefills them all, the
    next ones decode them together; block ids handed out in order. The
    runner must not touch the requests: the sampled tokens are appended here."""
    block_size = runner.block_size
    reqs = [
        Request(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=new_tokens))
        for i, p in enumerate(prompts)
    ]
    tables: list[list[int]] = []
    next_block = 0
    for p in prompts:
        n = (len(p) + new_tokens + block_size - 1) // block_size
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    chunks = [
        chunk_of(r, r.prompt_token_ids, 0, t, True) for r, t in zip(reqs, tables, strict=True)
    ]
    for _ in range(new_tokens):
        for r, tok in zip(reqs, runner.execute(StepPlan(chunks)), strict=True):
            if tok is None:
                raise AssertionError(f"{r.request_id}: a complete chunk sampled nothing")
            r.output_token_ids.append(tok.token_id)
        chunks = [
            chunk_of(r, [r.output_token_ids[-1]], r.num_tokens - 1, t, True)
            for r, t in zip(reqs, tables, strict=True)
        ]
    return [r.output_token_ids for r in reqs]


def hf_greedy(
    hf: Any, prompt: list[int], new_tokens: int, *, pad_token_id: int, past_eos: bool
) -> list[int]:
    """transformers' greedy ``generate`` of up to ``new_tokens`` (all of them
    with ``past_eos``; else it stops at EOS)."""
    least = {"min_new_tokens": new_tokens} if past_eos else {}
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=new_tokens,
            pad_token_id=pad_token_id,
            **least,
        )
    return out[0, len(prompt) :].tolist()


def check_greedy_parity(ours: torch.Tensor, theirs: torch.Tensor, tol: float) -> int:
    """Number of positions where the top-1 tokens differ; each one must be a near tie."""
    mine, best = ours.argmax(-1), theirs.argmax(-1)
    differ = (mine != best).nonzero().flatten().tolist()
    for pos in differ:
        margin = float(theirs[pos, best[pos]] - theirs[pos, mine[pos]])
        assert margin <= tol, f"position {pos}: top-1 differs by a logit margin of {margin:.3f}"
    return len(differ)
