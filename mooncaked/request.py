"""Requests as the engine sees them: token ids in, token ids out."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from mooncaked.handoff import NO_HANDOFF, Handoff


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Blocks allocated; its cached prefix is being copied in from the host tiers.
    LOADING = "loading"
    # Preempted: blocks freed, will be recomputed from its tokens so far.
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context limit
    ABORT = "abort"  # cancelled: client gone, drain timeout, error

    @property
    def openai(self) -> str:
        # "abort" rather than OpenAI's "stop": a cut-short answer must not
        # read as a finished one.
        return self.value


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Number of top alternatives to report per token; None: no logprobs.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if len(self.stop) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise ValueError("stop sequences must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # (token_id, logprob) of the most likely tokens, best first.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Tokens whose KV is in the request's blocks (computed or reused).
    num_computed_tokens: int = 0
    # Prompt tokens served from a cache instead of computed (first schedule only).
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    # Disaggregated serving: where the prompt's KV comes from or goes to,
    # and where a resumed stream's output continues from.
    handoff: Handoff = NO_HANDOFF
    # The node whose forward pass computed the prompt, once known.
    prefill_node: str | None = None
    # A stage after the head of a pipelined prefill group: tokens whose input
    # activations have arrived (it computes no further). None: all of them.
    ready_tokens: int | None = None
    # Chained hashes of every full block of the request's tokens so far: the
    # prompt's computed once at entry, extended by the scheduler as output
    # fills blocks. 16-byte ``cache.hashing.BlockHash`` values.
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def memory_node(self) -> str | None:
        """host:port of the memory node placement chose for this request's
        decode attention (None: the node's ``offload`` config decides)."""
        return self.handoff.memory_node or None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole sequence
        (a decode step asks for one token of a long one)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED


@dataclass(frozen=True, slots=True)
class KVSent:
    """A prefill node's handoff of one request's prompt KV: the bytes it wrote
    into the decode node's blocks, and why not all landed (None: they did)."""

    num_bytes: int
    failed: str | None = None


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request, streamed to its caller."""

    request_id: str
    new_token_ids: list[int]
    # Detokenized text of new_token_ids, with stop strings cut off.
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    # Set on the last output when the engine failed the request.
    error: str | None = None
    # The node that computed the prompt (on the first output that knows it).
    prefill_node: str | None = None
    # On the last output of a request that sent its prompt's KV to a decode
    # node (a prefill node's side of a handoff): what became of it.
    kv_sent: KVSent | None = None
