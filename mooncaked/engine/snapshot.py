"""What the engine publishes of itself, once per scheduling pass.

Readers on schedules of their own (gossip's load meter every round, the
cost model) read the last ``EngineSnapshot`` and never the scheduler's
queues, the runner or the model: frozen values, taken together on the
event loop, so they agree with each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mooncaked.config import Config
from mooncaked.engine.scheduler import DecodeEntry, PrefillEntry

if TYPE_CHECKING:
    # The runner pulls in torch and the model: only the annotation needs it.
    from mooncaked.engine.runner import ModelRunner

__all__ = ["EngineLoad", "EngineSnapshot", "ModelFacts", "model_facts"]


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


def model_facts(config: Config, runner: ModelRunner, num_blocks: int) -> ModelFacts:
    """The facts of an engine with ``runner`` and a pool of ``num_blocks`` blocks."""
    loaded, arch, sched = runner.loaded, runner.arch, config.scheduler
    return ModelFacts(
        model_id=loaded.model_id,
        vocab_size=arch.vocab_size,
        max_model_len=loaded.max_model_len,
        num_layers=arch.num_layers,
        dtype=str(loaded.dtype).removeprefix("torch."),
        device=str(loaded.device),
        block_size=runner.block_size,
        num_blocks=num_blocks,
        kv_bytes_per_token=runner.block_bytes // runner.block_size,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs,
    )
