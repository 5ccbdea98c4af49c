"""The plain data passed from the scheduler to the runner and back."""

from __future__ import annotations

from dataclasses import dataclass, field

from mooncaked.cache.hashing import BlockHash
from mooncaked.request import Request, TokenLogprob


@dataclass(slots=True)
class ScheduledChunk:
    """One request's work in one step: a prefill chunk or one decode token."""

    request: Request
    # Tokens whose KV is computed this step, at positions start_pos, start_pos+1, ...
    token_ids: list[int]
    start_pos: int
    # The request's block table; covers at least start_pos + len(token_ids) tokens.
    block_ids: list[int]
    # Sample the next token from the last position (the prompt's last chunk, or a decode).
    sample: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class LoadJob:
    """Copy cached blocks from the host tiers into a request's device blocks."""

    request: Request
    hashes: list[BlockHash]
    # block_ids[i] receives hashes[i].
    block_ids: list[int]


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Loads to start now; their requests join the running set when done.
    loads: list[LoadJob] = field(default_factory=list)
    # Requests that lost their blocks this step; they rejoin the waiting queue.
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None
