"""The plain data passed from the scheduler to the runner and back.

A plan crosses the thread boundary (the runner executes it in the step
thread) and could cross a process boundary: it carries values, never the
live ``Request`` the event loop owns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mooncaked.request import Request, SamplingParams, TokenLogprob


@dataclass(slots=True)
class ScheduledChunk:
    """One request's work in one step: a prefill chunk or one decode token."""

    request_id: str
    # Tokens whose KV is computed this step, at positions start_pos, start_pos+1, ...
    token_ids: list[int]
    start_pos: int
    # The request's block table; covers at least start_pos + len(token_ids) tokens.
    block_ids: list[int]
    # Sample the next token from the last position (the prompt's last chunk, or a decode).
    sample: bool
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Tokens the request had sampled before this step (a seeded sampler's counter).
    num_output_tokens: int = 0
    # A stage after the first of a pipelined prefill group: the rows of its
    # inbound activations that hold these tokens' input (None: token ids).
    act_rows: list[int] | None = None
    # The request's KV lives on a memory node (attention offloading): no
    # local blocks (``block_ids`` is empty), its attention runs there only.
    kv_remote: bool = False
    # host:port of the memory node placement chose for the request's decode
    # attention ("": the node's ``offload.memory_node`` decides).
    memory_node: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


def chunk_of(
    req: Request, token_ids: list[int], start_pos: int, block_ids: list[int], sample: bool
) -> ScheduledChunk:
    """A chunk of ``req`` with the request's values copied in. On a stage of a
    pipelined prefill group, only the last samples, and every stage after
    the head reads its input from the rows the stage before wrote."""
    stage = req.handoff.stage
    act_in = stage.act_in if stage is not None else None
    end = start_pos + len(token_ids)
    return ScheduledChunk(
        request_id=req.request_id,
        token_ids=token_ids,
        start_pos=start_pos,
        block_ids=list(block_ids),
        sample=sample and (stage is None or stage.last),
        sampling=req.sampling,
        num_output_tokens=req.handoff.output_offset + len(req.output_token_ids),
        act_rows=act_in.rows(start_pos, end) if act_in is not None else None,
        memory_node=req.memory_node or "",
    )


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Bring a request's tokens from outside the device into its blocks (event loop side).

    ``block_ids[i]`` is the request's logical block ``first_block + i``; the
    connector fills tokens ``first_block * block_size`` up to ``num_tokens`` more.
    ``source`` and ``cancellable`` are the lookup's answer (``KVHit``): which
    connector serves the load, and whether an abort may cut it short.
    """

    request_id: str
    first_block: int
    block_ids: list[int]
    num_tokens: int
    source: int = 0
    cancellable: bool = False


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Loads to start now; their requests join the running set when done.
    loads: list[LoadJob] = field(default_factory=list)
    # Requests that lost their blocks this step; they rejoin the waiting queue.
    preempted: list[str] = field(default_factory=list)
    # What the KV connector's worker side does during this step (plain data the
    # connector built; None when it has nothing to do).
    connector_meta: Any = None

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


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What the runner hands back for one step."""

    # One entry per chunk, in plan order: a token where ``chunk.sample``.
    tokens: list[SampledToken | None]
    # The KV connector worker side's report of the step (plain data; None:
    # it had nothing to do), applied on the event loop after the step.
    kv_report: Any = None
    # A stage before the last of a pipelined prefill group: the step's output
    # rows [tokens, hidden], in plan order, for the next stage (None elsewhere).
    hidden: Any = None
    # Attention offloading: requests whose KV the memory node holds since this
    # step (their local blocks can go), and requests whose KV there was lost
    # (the memory node failed: they are recomputed; their tokens of this step
    # are void).
    kv_moved: tuple[str, ...] = ()
    kv_lost: tuple[str, ...] = ()
