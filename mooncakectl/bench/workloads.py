"""What to send: lists of requests as token ids, made deterministically from a seed.

- ``random_requests``: input and output lengths drawn in ``[len * (1 - r), len * (1 + r)]``
  (vLLM's range ratio) after an optional prefix every request shares;
- ``prefix_requests``: families of prompts that share a long prefix and grow
  turn by turn (multi-turn chat, an agent's tool calls);
- ``trace_requests``: Mooncake trace records, each hash id becoming its own
  block of tokens, so the trace's prefix reuse is prefix reuse at the server.

Every token id falls in ``[0, vocab_size)``. ``fit_context`` then clips what
would not fit the server's context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from mooncakectl.bench.trace import TRACE_BLOCK_TOKENS, TraceRecord

# Ids 0..255 are valid in every tokenizer we may meet (bytes in a byte-level
# vocabulary), so this bound works when the server does not say its vocabulary.
DEFAULT_VOCAB_SIZE = 256

# Domain tags keep the token streams of different uses of one seed apart.
_TAG_TRACE_BLOCK = 0
_TAG_TRACE_TAIL = 1
_TAG_RANDOM = 2
_TAG_PREFIX = 3
_TAG_WARMUP = 4


@dataclass(frozen=True, slots=True)
class BenchRequest:
    index: int
    prompt_ids: tuple[int, ...]
    output_len: int
    # Seconds after the first request, for a trace; None: the load decides.
    arrival_s: float | None = None
    # What the request belongs to: "family-3", "trace:118", "random".
    group: str = ""
    # The prompt or output was cut to fit the server's context.
    clipped: bool = False


def _tokens(seed: int, key: Sequence[int], n: int, vocab_size: int) -> np.ndarray:
    # SeedSequence over a list of ints: the same stream on every platform and run.
    rng = np.random.default_rng([seed, *key])
    return rng.integers(0, vocab_size, size=n, dtype=np.int64)


def _check_vocab(vocab_size: int) -> None:
    if vocab_size < 2:
        raise ValueError(f"--vocab-size must be >= 2, got {vocab_size}")


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int, what: str) -> np.ndarray:
    if mean < 1:
        raise ValueError(f"--{what} must be >= 1, got {mean}")
    lo = max(1, math.floor(mean * (1.0 - ratio)))
    hi = max(lo, math.ceil(mean * (1.0 + ratio)))
    return rng.integers(lo, hi + 1, size=n)


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    *,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[BenchRequest]:
    if num < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {prefix_len}")
    _check_vocab(vocab_size)
    rng = np.random.default_rng([seed, _TAG_RANDOM])
    in_lens = _lengths(rng, input_len, range_ratio, num, "random-input-len")
    out_lens = _lengths(rng, output_len, range_ratio, num, "random-output-len")
    prefix = rng.integers(0, vocab_size, size=prefix_len, dtype=np.int64)
    out = []
    for i in range(num):
        body = rng.integers(0, vocab_size, size=int(in_lens[i]), dtype=np.int64)
        ids = tuple(int(t) for t in np.concatenate([prefix, body]))
        out.append(BenchRequest(i, ids, int(out_lens[i]), group="random"))
    return out


def prefix_requests(
    num_families: int,
    turns: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[BenchRequest]:
    """``num_families * turns`` requests. Turn t of a family is its shared prefix
    (a system prompt, tool definitions) plus t + 1 suffixes: each turn resends
    the conversation so far and adds to it. Turns are interleaved across
    families (every family's turn 0, then every turn 1...), as chats are."""
    for name, v in (
        ("--prefix-families", num_families),
        ("--prefix-turns", turns),
        ("--prefix-len", prefix_len),
        ("--prefix-suffix-len", suffix_len),
        ("--prefix-output-len", output_len),
    ):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    _check_vocab(vocab_size)
    out: list[BenchRequest] = []
    for t in range(turns):
        for f in range(num_families):
            parts = [_tokens(seed, (_TAG_PREFIX, f, 0), prefix_len, vocab_size)]
            parts += [
                _tokens(seed, (_TAG_PREFIX, f, k + 1), suffix_len, vocab_size) for k in range(t + 1)
            ]
            ids = tuple(int(x) for x in np.concatenate(parts))
            out.append(BenchRequest(len(out), ids, output_len, group=f"family-{f}"))
    return out


@dataclass(frozen=True, slots=True)
class TraceScale:
    """How a trace sized for a GPU cluster shrinks to a small machine.

    ``block_tokens``: tokens per hash id (512 in the released traces);
    ``input_scale``: prompt lengths are multiplied by it (None: by
    ``block_tokens / 512``, which keeps every record's block structure);
    ``output_scale`` and ``time_scale`` multiply output lengths and gaps
    between arrivals (0.5: twice the request rate)."""

    block_tokens: int = TRACE_BLOCK_TOKENS
    input_scale: float | None = None
    output_scale: float = 1.0
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError(f"--trace-block-tokens must be >= 1, got {self.block_tokens}")
        if self.input_scale is not None and not self.input_scale > 0:
            raise ValueError(f"--input-scale must be > 0, got {self.input_scale}")
        if not self.output_scale > 0:
            raise ValueError(f"--output-scale must be > 0, got {self.output_scale}")
        if not self.time_scale >= 0:
            raise ValueError(f"--time-scale must be >= 0, got {self.time_scale}")

    @property
    def effective_input_scale(self) -> float:
        if self.input_scale is not None:
            return self.input_scale
        return self.block_tokens / TRACE_BLOCK_TOKENS


class TraceTokens:
    """Token blocks for hash ids: the same id gives the same block, every time.

    Blocks are memoised: in a conversation trace most ids recur."""

    __slots__ = ("_blocks", "block_tokens", "seed", "vocab_size")

    def __init__(self, block_tokens: int, vocab_size: int, seed: int) -> None:
        _check_vocab(vocab_size)
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self.seed = seed
        self._blocks: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> np.ndarray:
        blk = self._blocks.get(hash_id)
        if blk is None:
            # Hash ids may be any integer; SeedSequence wants non-negative words.
            key = (_TAG_TRACE_BLOCK, 0 if hash_id >= 0 else 1, abs(hash_id))
            blk = _tokens(self.seed, key, self.block_tokens, self.vocab_size)
            self._blocks[hash_id] = blk
        return blk

    def prompt(self, rec: TraceRecord, length: int) -> tuple[int, ...]:
        """``length`` tokens: the record's blocks in order, the last one cut.
        A prompt longer than its hash ids cover continues with blocks of its
        own (keyed by its line), shared with no other request."""
        num_blocks = math.ceil(length / self.block_tokens)
        parts = [self.block(h) for h in rec.hash_ids[:num_blocks]]
        for k in range(len(parts), num_blocks):
            parts.append(
                _tokens(
                    self.seed, (_TAG_TRACE_TAIL, rec.line, k), self.block_tokens, self.vocab_size
                )
            )
        return tuple(int(t) for t in np.concatenate(parts)[:length])


def trace_requests(
    records: Sequence[TraceRecord],
    scale: TraceScale | None = None,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[BenchRequest]:
    """One request per record; arrivals relative to the first record, scaled."""
    scale = scale or TraceScale()
    tokens = TraceTokens(scale.block_tokens, vocab_size, seed)
    if not records:
        return []
    t0 = records[0].timestamp_ms
    out = []
    for i, rec in enumerate(records):
        length = max(1, math.ceil(rec.input_length * scale.effective_input_scale))
        out_len = max(1, round(rec.output_length * scale.output_scale))
        arrival = max(0.0, rec.timestamp_ms - t0) / 1000.0 * scale.time_scale
        out.append(
            BenchRequest(i, tokens.prompt(rec, length), out_len, arrival, group=f"trace:{rec.line}")
        )
    return out


def fit_context(requests: Sequence[BenchRequest], max_model_len: int) -> list[BenchRequest]:
    """Requests cut so prompt + output fits ``max_model_len``, marked ``clipped``.

    The prompt keeps at least half the context (cut from its end: its prefix,
    the part shared between requests, survives); the output gets the rest."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    out = []
    for r in requests:
        if len(r.prompt_ids) + r.output_len <= max_model_len:
            out.append(r)
            continue
        keep = min(len(r.prompt_ids), max(max_model_len - r.output_len, max_model_len // 2))
        out_len = min(r.output_len, max_model_len - keep)
        prompt = r.prompt_ids[:keep]
        out.append(replace(r, prompt_ids=prompt, output_len=out_len, clipped=True))
    return out


def warmup_requests(
    num: int, like: Sequence[BenchRequest], *, vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0
) -> list[BenchRequest]:
    """Requests shaped like the first of ``like`` but with tokens of their own:
    they warm the server up without putting the workload's prefixes in its cache."""
    if num < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {num}")
    out = []
    for i in range(num if like else 0):
        r = like[i % len(like)]
        ids = _tokens(seed, (_TAG_WARMUP, i), len(r.prompt_ids), vocab_size)
        out.append(BenchRequest(-1 - i, tuple(int(t) for t in ids), r.output_len, group="warmup"))
    return out
