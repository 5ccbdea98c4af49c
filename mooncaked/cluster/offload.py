"""Where a request decodes when attention is offloaded: a compute node and a
memory node, chosen together.

A memory node holds the KV of the sequences it serves and computes their
decode attention; a compute node runs the rest of the model for a batch much
larger than its own memory could hold the KV of. The pair's TBT is the
compute node's step with the request added (``costs.offloaded_step``): its
dense part grows with its batch, the attention with what the memory node
reads each round (the compute node's context and what it holds for others).
Pure: the Conductor and the simulator call it with what they know.

``offloaded_scores`` is the Conductor's use of it: a decode candidate that
offloads by placement (``offload.memory_node = "auto"``, gossiped as
``OffloadInfo``) is scored with the memory node ``choose_pair`` pairs it
with, among the live memory nodes gossip shows (``MemoryInfo``); one no
memory node can take keeps its local score (its attention runs there).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mooncaked.cluster.costs import (
    AttentionTraffic,
    MemoryLink,
    NodeCosts,
    OffloadedStep,
    offloaded_step,
)
from mooncaked.cluster.state import AttentionShape, ClusterView, MemberStatus, MemoryInfo

if TYPE_CHECKING:
    from mooncaked.cluster.placement import ConductorParams, PlacementRequest
    from mooncaked.cluster.ranking import CandidateNode, DecodeScore
    from mooncaked.cluster.slo import Slo


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


# -- the Conductor's side -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LiveMemory:
    """A memory node placement may pair a compute node with, as gossiped."""

    node: MemoryNode
    info: MemoryInfo


def live_memory(view: ClusterView) -> list[LiveMemory]:
    """The memory nodes alive (suspects count only while no alive one does,
    as decode nodes), not draining, whose attention service is known."""
    alive: list[LiveMemory] = []
    suspect: list[LiveMemory] = []
    for node_id, m in sorted(view.members.items()):
        st = m.state
        if st is None or st.role != "memory" or st.memory is None or st.draining:
            continue
        if m.status not in (MemberStatus.ALIVE, MemberStatus.SUSPECT):
            continue
        info = st.memory
        node = MemoryNode(
            node_id,
            kv_read_bps=info.kv_read_bps,
            free_bytes=float(info.free_bytes),
            resident_bytes=float(info.total_bytes - info.free_bytes),
        )
        (alive if m.status is MemberStatus.ALIVE else suspect).append(LiveMemory(node, info))
    return alive or suspect


def traffic_of(shape: AttentionShape) -> AttentionTraffic:
    """What one token's offloaded attention moves a layer, from the KV shape."""
    return AttentionTraffic(
        num_layers=shape.num_layers,
        qkv_bytes=(shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim * shape.itemsize,
        out_bytes=shape.num_heads * shape.head_dim * shape.itemsize,
    )


def offloaded_scores(
    view: ClusterView,
    request: PlacementRequest,
    params: ConductorParams,
    slo: Slo,
    pool: Sequence[CandidateNode],
    scores: list[DecodeScore],
) -> list[DecodeScore]:
    """``scores`` with each candidate that offloads by placement scored
    offloaded, with the memory node ``choose_pair`` pairs it with: its TBT
    is the offloaded step's, and so is the TBT SLO's verdict. Unchanged
    where no such candidate or no memory node is live."""
    if not any(n.offload is not None for n in pool):
        return scores
    memories = live_memory(view)
    if not memories:
        return scores
    expected = request.expected_output_tokens or request.max_tokens / 2
    out = list(scores)
    for i, n in enumerate(pool):
        if n.offload is not None:
            out[i] = _offloaded(request, params, slo, n, scores[i], memories, expected)
    return out


def _offloaded(
    request: PlacementRequest,
    params: ConductorParams,
    slo: Slo,
    n: CandidateNode,
    score: DecodeScore,
    memories: Sequence[LiveMemory],
    expected: float,
) -> DecodeScore:
    info = n.offload
    if info is None:
        return score
    fit = [m for m in memories if m.info.serves(request.model_id, info.shape)]
    costs = n.costs
    if costs.kv_bytes_per_token <= 0:
        # Costs not gossiped yet: the shape says what a token's KV weighs.
        costs = dataclasses.replace(costs, kv_bytes_per_token=info.shape.kv_bytes_per_token)
    compute = ComputeNode(n.cand.node_id, costs, score.batch_at_join, score.context_tokens)
    pair = choose_pair(
        [compute],
        [m.node for m in fit],
        traffic_of(info.shape),
        request.num_prompt_tokens,
        expected,
        # Judged below, as the local score is: calibrated and with the margin.
        0.0,
        micro_batches=info.micro_batches,
    )
    if pair is None:
        return score
    within = costs.max_batch <= 0 or score.batch_at_join + 1 <= costs.max_batch
    if within and score.costs_known and slo.tbt_s > 0.0:
        within = params.tbt(pair.tbt_s) * params.tbt_margin <= slo.tbt_s
    addr = next(m.info.attention_addr for m in fit if m.node.node_id == pair.memory)
    return dataclasses.replace(
        score,
        tbt_s=pair.tbt_s,
        within_slo=within,
        memory=pair.memory,
        attention_addr=addr,
        offload=pair.step,
    )
