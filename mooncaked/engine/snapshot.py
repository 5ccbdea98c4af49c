"""What the engine publishes of itself, once per scheduling pass.

Readers on schedules of their own (gossip's load meter every round, the
cost model) read the last ``EngineSnapshot`` and never the scheduler's
queues, the runner or the model: frozen values, taken together on the
event loop, so they agree with each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncaked.engine.scheduler import DecodeEntry, PrefillEntry

__all__ = ["EngineLoad", "EngineSnapshot", "ModelFacts"]


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What stays as it is while the engine lives: its model, its KV cache, its limits."""

    model_id: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    dtype: str
    device: str
    block_size: int
    num_blocks: int
    # KV bytes of one token: every layer, K and V.
    kv_bytes_per_token: int
    # The scheduler's limits: tokens one step computes, requests one batch runs.
    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's load as counts."""

    # Prompt tokens (and preempted tokens) still to compute.
    queued_prefill_tokens: int = 0
    # Requests decoding (one token left to compute after a sample).
    running_decode_batch: int = 0
    kv_usage: float = 0.0
    num_steps: int = 0
    num_waiting: int = 0
    num_running: int = 0


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    model: ModelFacts
    load: EngineLoad = EngineLoad()
    # The scheduler's work (``Scheduler.work``): prompts still to compute, in
    # queue order, and requests that decode or will once their KV is in.
    prefill: tuple[PrefillEntry, ...] = ()
    decode: tuple[DecodeEntry, ...] = ()
