"""What an engine tells about itself: its counters and its requests in flight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mooncaked.request import RequestState

if TYPE_CHECKING:
    from mooncaked.engine.core import EngineCore

__all__ = ["EngineStats", "engine_stats", "requests_in_flight"]


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_num_blocks: int
    kv_num_used_blocks: int
    kv_usage: float
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_preemptions_total: int
    num_steps: int
    num_loading: int = 0
    num_loads_total: int = 0
    num_offloads_total: int = 0
    num_integrity_failures: int = 0


def requests_in_flight(engine: EngineCore, now: float) -> list[dict[str, object]]:
    """Every unfinished request with its phase: queued, transferring (its KV
    comes from a prefill node), loading (from the host tiers), prefilling,
    decoding; oldest first."""
    out: list[dict[str, object]] = []
    for rid in engine.outputs.request_ids():
        req = engine.outputs.request(rid)
        if req is None:
            continue
        if req.state is RequestState.LOADING:
            phase = "transferring" if req.handoff.source is not None else "loading"
        elif req.state is RequestState.RUNNING:
            phase = "decoding" if req.output_token_ids else "prefilling"
        else:
            phase = "queued"
        out.append(
            {
                "id": rid,
                "phase": phase,
                "prompt_tokens": req.num_prompt_tokens,
                "output_tokens": req.handoff.output_offset + req.num_output_tokens,
                "prefill_node": req.prefill_node,
                "age_s": round(now - req.arrival_time, 3),
            }
        )
    out.sort(key=lambda r: -float(r["age_s"]))  # type: ignore[arg-type]
    return out


def engine_stats(engine: EngineCore) -> EngineStats:
    """Counters for /metrics; EngineClosedError before the engine starts."""
    s = engine.scheduler
    queried = s.prefix_queried_tokens
    return EngineStats(
        num_running=len(s.running),
        num_waiting=len(s.waiting),
        kv_num_blocks=engine.pool.num_blocks,
        kv_num_used_blocks=engine.pool.num_used_blocks,
        kv_usage=engine.pool.usage,
        prefix_queried_tokens=queried,
        prefix_hit_tokens=s.prefix_hit_tokens,
        prefix_hit_rate=s.prefix_hit_tokens / queried if queried else 0.0,
        num_prompt_tokens_total=engine.num_prompt_tokens_total,
        num_generation_tokens_total=engine.num_generation_tokens_total,
        num_preemptions_total=s.num_preemptions,
        num_steps=engine.num_steps,
        num_loading=len(s.loading),
        num_loads_total=engine.num_loads_total,
        num_offloads_total=engine.connector.num_saves(),
        num_integrity_failures=engine.num_integrity_failures,
    )
