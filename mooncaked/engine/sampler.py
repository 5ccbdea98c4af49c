"""Batched next-token sampling: greedy, temperature, top-k, top-p, seeds, logprobs.

A seeded request's token at output index ``i`` depends only on ``(seed, i,
logits)``: its noise comes from a generator seeded with a hash of the pair, so
the token is the same whatever else shares the batch, after a preemption, and
on another node that resumes the request (disaggregated decode). Unseeded
requests draw from one process-wide generator. Greedy is argmax, with no RNG.

Sampling draws with the exponential race: ``argmax(p / E)`` with
``E ~ Exp(1)`` per token picks token ``j`` with probability ``p_j``, and needs
only one vector of noise per row (no cumulative search).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from mooncaked.engine.plan import SampledToken
from mooncaked.request import SamplingParams, TokenLogprob


def token_seed(seed: int, output_index: int) -> int:
    """A 63-bit generator seed for one output position of a seeded request."""
    h = hashlib.blake2b(digest_size=8, person=b"mooncaked.smpl")
    # Any Python int: reduced to 128 bits, two's complement for negatives.
    h.update((seed % (1 << 128)).to_bytes(16, "little"))
    h.update(output_index.to_bytes(8, "little", signed=False))
    return int.from_bytes(h.digest(), "little") >> 1


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        # Unseeded requests share this one; tests inject a seeded generator.
        self._generator = generator if generator is not None else torch.Generator(device="cpu")
        if generator is None:
            self._generator.seed()

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
    ) -> list[SampledToken]:
        """One token per row of ``logits`` [B, V]; ``output_indices[i]`` is row i's
        index in its request's output (the seeded RNG stream position)."""
        if (
            logits.dim() != 2
            or logits.shape[0] != len(params)
            or len(params) != len(output_indices)
        ):
            raise ValueError(
                f"sample needs logits [B, V] with one SamplingParams and output index per "
                f"row, got logits {tuple(logits.shape)}, {len(params)} params, "
                f"{len(output_indices)} indices"
            )
        num_rows, vocab = logits.shape
        logits = logits.float()
        chosen = torch.empty(num_rows, dtype=torch.int64, device=logits.device)

        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if greedy_rows:
            idx = torch.tensor(greedy_rows, device=logits.device)
            chosen[idx] = logits.index_select(0, idx).argmax(dim=-1)
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            probs = self._probs(logits.index_select(0, idx), [params[i] for i in random_rows])
            noise = torch.empty(len(random_rows), vocab, dtype=torch.float32)
            for j, i in enumerate(random_rows):
                seed = params[i].seed
                if seed is None:
                    noise[j].exponential_(generator=self._generator)
                else:
                    g = torch.Generator(device="cpu").manual_seed(
                        token_seed(seed, output_indices[i])
                    )
                    noise[j].exponential_(generator=g)
            chosen[idx] = (probs / noise.to(logits.device)).argmax(dim=-1)

        chosen_host = chosen.tolist()
        out = [SampledToken(token_id=t) for t in chosen_host]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if lp_rows:
            idx = torch.tensor(lp_rows, device=logits.device)
            # From the unmodified logits: what the model thinks, not what the
            # sampling settings made of it (the OpenAI API's meaning).
            logp = torch.log_softmax(logits.index_select(0, idx), dim=-1)
            top_n = max(params[i].logprobs or 0 for i in lp_rows)
            top_vals = top_ids = None
            if top_n > 0:
                top_vals, top_ids = logp.topk(min(top_n, vocab), dim=-1)
                top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            chosen_lp = logp.gather(1, chosen[idx][:, None]).squeeze(1).tolist()
            for j, i in enumerate(lp_rows):
                n = params[i].logprobs or 0
                top: list[tuple[int, float]] = []
                if n > 0 and top_ids is not None and top_vals is not None:
                    top = list(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
                out[i].logprob = TokenLogprob(
                    token_id=chosen_host[i], logprob=chosen_lp[j], top=top
                )
        return out

    @staticmethod
    def _probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Softmax of temperature-scaled logits with top-k and top-p applied."""
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temps[:, None]
        vocab = logits.shape[1]

        top_ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        if any(top_ks):
            k_max = max(top_ks)
            kth_vals = logits.topk(k_max, dim=-1).values
            ks = torch.tensor([k if k > 0 else k_max for k in top_ks], device=device)
            threshold = kth_vals.gather(1, (ks - 1)[:, None])
            use = torch.tensor([k > 0 for k in top_ks], device=device)[:, None]
            logits = torch.where(use & (logits < threshold), float("-inf"), logits)

        probs = torch.softmax(logits, dim=-1)
        top_ps = [p.top_p for p in params]
        if any(p < 1.0 for p in top_ps):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            cum = sorted_probs.cumsum(dim=-1)
            ps = torch.tensor([p if p < 1.0 else 2.0 for p in top_ps], device=device)[:, None]
            # Drop a token when the tokens before it already reach top_p; the
            # most likely token always stays.
            drop_sorted = (cum - sorted_probs) >= ps
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        return probs
