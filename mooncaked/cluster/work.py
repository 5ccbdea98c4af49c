"""A node's work as plain data, and the load it gossips: one pure function for
the daemon's load meter and the simulated node, so both publish alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mooncaked.cluster.costs import NodeCosts
from mooncaked.cluster.forecast import (
    DecodeForecast,
    DecodeWork,
    DepartureRate,
    OutputLengths,
    PrefillWork,
    forecast_decode,
    predicted_queue_s,
)
from mooncaked.cluster.state import NodeLoad


@dataclass(frozen=True, slots=True)
class NodeWork:
    """What a node has to do, as its scheduler holds it now."""

    # Prompts still to compute, in queue order.
    prefill: Sequence[PrefillWork] = ()
    # Requests decoding, or about to once their KV is in (a decode node's handoffs).
    decode: Sequence[DecodeWork] = ()
    # Of ``decode``, those in the batch that steps run now.
    running_decode_batch: int = 0
    # Share of the node's KV capacity in use, 0..1.
    kv_usage: float = 0.0
    # Free slots of its DRAM tier (the KV store).
    dram_free_blocks: int = 0


def queue_s(costs: NodeCosts, work: NodeWork) -> float:
    """How long a prompt queued now waits before it starts (0 with no costs
    known): what the node gossips, and what it judges an offer by."""
    return predicted_queue_s(costs, work.prefill, decode_seqs=work.running_decode_batch)


def gossiped_load(
    costs: NodeCosts,
    work: NodeWork,
    lengths: OutputLengths,
    departures: DepartureRate,
    now: float,
    *,
    forecast: bool = True,
) -> tuple[NodeLoad, DecodeForecast]:
    """The load a node publishes and its decode forecast (empty when
    ``forecast`` is False: nobody reads it). ``now`` is the node's clock,
    for the rate at which requests have been leaving its batch."""
    running = work.running_decode_batch
    load = NodeLoad(
        queued_prefill_tokens=sum(w.new_tokens for w in work.prefill),
        running_decode_batch=running,
        # Rounded: gossip announces every change, and noise is no news.
        kv_usage=round(min(1.0, max(0.0, work.kv_usage)), 3),
        predicted_queue_s=round(queue_s(costs, work), 3),
        decode_context_tokens=sum(w.context_tokens for w in work.decode),
        pending_decode=len(work.decode),
        dram_free_blocks=work.dram_free_blocks,
    )
    if not forecast:
        return load, DecodeForecast()
    return load, forecast_decode(
        costs,
        work.decode,
        lengths,
        arrival_rate=departures.rate(now),
        arrival_context_tokens=departures.mean_prompt_tokens,
    )
