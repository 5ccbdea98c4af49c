"""Where a request decodes when attention is offloaded: a compute node and a
memory node, chosen together.

A memory node holds the KV of the sequences it serves and computes their
decode attention; a compute node runs the rest of the model for a batch much
larger than its own memory could hold the KV of. The pair's TBT is the
compute node's step with the request added (``costs.offloaded_step``): its
dense part grows with its batch, the attention with what the memory node
reads each round (the compute node's context and what it holds for others).
Pure: the Conductor and the simulator call it with what they know.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mooncaked.cluster.costs import (
    AttentionTraffic,
    MemoryLink,
    NodeCosts,
    OffloadedStep,
    offloaded_step,
)


@dataclass(frozen=True, slots=True)
class ComputeNode:
    """A compute (decode) candidate: its costs and the batch it decodes now."""

    node_id: str
    costs: NodeCosts
    batch: float
    context_tokens: float
    # Bytes/s of its NICs together (0: unknown, the wire left unpriced).
    nic_bps: float = 0.0


@dataclass(frozen=True, slots=True)
class MemoryNode:
    """A memory candidate: how fast it reads KV, what it holds and has room for."""

    node_id: str
    kv_read_bps: float
    # KV bytes it can still take, and those it holds now (every compute node's).
    free_bytes: float
    resident_bytes: float
    # Bytes/s of its NICs together (0: unknown, the wire left unpriced).
    nic_bps: float = 0.0
    rtt_s: float = 0.0
    layer_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PairChoice:
    compute: str
    memory: str
    tbt_s: float
    step: OffloadedStep


def link_between(c: ComputeNode, m: MemoryNode) -> MemoryLink:
    """The memory node as ``c`` sees it: the slower NIC of the two carries the
    q/k/v and outputs; the KV it reads for others is all but ``c``'s own (as
    if ``c``'s context were all there: where it is spread, the estimate is
    the slower)."""
    known = [bps for bps in (c.nic_bps, m.nic_bps, c.costs.link_bps(m.node_id)) if bps > 0.0]
    mine = c.context_tokens * c.costs.kv_bytes_per_token
    return MemoryLink(
        kv_read_bps=m.kv_read_bps,
        link_bps=min(known) if known else math.inf,
        rtt_s=m.rtt_s,
        layer_s=m.layer_s,
        other_bytes=max(0.0, m.resident_bytes - mine),
    )


def pair_tbt(
    c: ComputeNode,
    m: MemoryNode,
    traffic: AttentionTraffic,
    added_context: float,
    *,
    micro_batches: int = 2,
) -> OffloadedStep:
    """``c``'s step with one more sequence of ``added_context`` tokens, its KV on ``m``."""
    return offloaded_step(
        c.costs.step,
        c.costs.kv_bytes_per_token,
        traffic,
        link_between(c, m),
        max(1, math.ceil(c.batch + 1)),
        c.context_tokens + added_context,
        micro_batches=micro_batches,
    )


def choose_pair(
    computes: Sequence[ComputeNode],
    memories: Sequence[MemoryNode],
    traffic: AttentionTraffic,
    prompt_tokens: int,
    expected_output_tokens: float,
    slo_tbt_s: float,
    *,
    micro_batches: int = 2,
) -> PairChoice | None:
    """The compute and memory node pair with the least predicted TBT with the
    request added, among those within ``slo_tbt_s`` (0: no SLO) whose memory
    node has room for the whole sequence (prompt and output); None if no
    pair does. Ties go to the memory node with the most room, then by ids."""
    best: tuple[float, float, str, str] | None = None
    choice: PairChoice | None = None
    # The batch's context grows by the prompt and half the output on average.
    added = prompt_tokens + expected_output_tokens / 2
    for c in computes:
        if c.costs.max_batch > 0 and c.batch + 1 > c.costs.max_batch:
            continue
        need = (prompt_tokens + expected_output_tokens) * c.costs.kv_bytes_per_token
        for m in memories:
            if m.free_bytes < need:
                continue
            step = pair_tbt(c, m, traffic, added, micro_batches=micro_batches)
            tbt = step.tbt_s
            if not math.isfinite(tbt) or (slo_tbt_s > 0.0 and tbt > slo_tbt_s):
                continue
            key = (tbt, -m.free_bytes, c.node_id, m.node_id)
            if best is None or key < best:
                best = key
                choice = PairChoice(c.node_id, m.node_id, tbt, step)
    return choice
