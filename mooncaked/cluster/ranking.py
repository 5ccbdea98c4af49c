"""Each candidate's figures, and the orders they are tried in.

A prefill candidate's predicted TTFT term by term (``PrefillScore``), a
decode candidate's predicted TBT (``DecodeScore``), and the order of each
pool under the entry's policy. Pure functions over one node's gossiped state
at a time; ``conductor.decide`` picks from what they return.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from mooncaked.cache.hashing import layer_hashes
from mooncaked.cluster.block_index import PrefixMatch
from mooncaked.cluster.costs import (
    NodeCosts,
    OffloadedStep,
    StepCost,
    equal_time_chunks,
    pipeline_prefill_s,
    predicted_tbt_s,
    transfer_s,
)
from mooncaked.cluster.forecast import DecodeForecast
from mooncaked.cluster.placement import (
    Candidate,
    ConductorParams,
    EarlyReject,
    PendingLoad,
    PlacementRequest,
    Policy,
)
from mooncaked.cluster.slo import Slo
from mooncaked.cluster.state import ClusterView, MemberStatus, NodeLoad, OffloadInfo, StageInfo


def _fields_json(obj: object) -> dict[str, object]:
    """A slotted dataclass as JSON, finite floats rounded to the microsecond."""
    return {
        f: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v)
        for f, v in ((f, getattr(obj, f)) for f in obj.__slots__)  # type: ignore[attr-defined]
    }


# Scores are made by the hundred for every request (one per candidate) and
# never changed after: plain slotted classes, whose __init__ is several
# times cheaper than a frozen one's.
@dataclass(slots=True)
class PrefillScore:
    """One prefill candidate's predicted TTFT, term by term."""

    node_id: str
    local_blocks: int
    # The longest prefix another node holds, and which node (None: nobody longer).
    remote_blocks: int
    holder: str | None
    queue_s: float
    transfer_s: float
    prefill_s: float
    ttft_s: float
    fetch: bool
    costs_known: bool
    # Prompt tokens it computes (what it lacks, or lacks after the fetch).
    new_tokens: int = 0
    note: str = ""
    # A pipelined group (the candidate is its head): its stages, each one's
    # compute alone (seconds, by its own model), the chunks, the activations'
    # time between stages, and the pipeline's fill and drain (its TTFT less
    # the queue and the slowest stage's compute).
    stages: tuple[str, ...] = ()
    stage_s: tuple[float, ...] = ()
    num_chunks: int = 0
    hop_s: float = 0.0
    fill_s: float = 0.0

    def to_json(self) -> dict[str, object]:
        out = _fields_json(self)
        if not self.stages:
            for name in ("stages", "stage_s", "num_chunks", "hop_s", "fill_s"):
                del out[name]
        else:
            out["stages"] = list(self.stages)
            out["stage_s"] = [round(v, 6) for v in self.stage_s]
        return out


@dataclass(slots=True)
class DecodeScore:
    node_id: str
    batch_now: int
    # The batch this request would share its steps with, besides itself:
    # forecast over its run from its prefill's end on, or the batch
    # decoding now (rejection on current load).
    batch_at_join: float
    tbt_s: float
    within_slo: bool
    costs_known: bool
    # The context its batch holds then, without this request's.
    context_tokens: float = 0.0
    # Attention offloaded (``offload.offloaded_scores``): the memory node
    # placement pairs it with, where its attention service listens, and the
    # predicted step term by term (None: attention runs on the node).
    memory: str = ""
    attention_addr: str = ""
    offload: OffloadedStep | None = None

    def to_json(self) -> dict[str, object]:
        out = _fields_json(self)
        step = self.offload
        out["offload"] = (
            None if step is None else {**_fields_json(step), "tbt_s": round(step.tbt_s, 6)}
        )
        return out


@dataclass(slots=True)
class CandidateNode:
    """A candidate with what placement knows of it: gossiped load, costs and
    forecast, and what this entry placed there that gossip does not show yet."""

    cand: Candidate
    suspect: bool
    load: NodeLoad
    costs: NodeCosts
    forecast: DecodeForecast
    pending: PendingLoad
    # A stage of a pipelined prefill group: its place in it.
    stage: StageInfo | None = None
    # Its attention is offloaded to the memory node placement picks.
    offload: OffloadInfo | None = None


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    """A prompt on a pipelined group of given stage models: the head's chunks,
    each chunk's hop between stages, the pipeline's time with every stage
    idle, and each stage's compute alone."""

    chunks: list[int]
    hops: list[float]
    idle_s: float
    alone_s: tuple[float, ...]


class Prefixes:
    """What placement needs of a request's prefix across the cluster, worked
    out once per request rather than once per candidate: who else holds the
    longest leasable run of it, how many hold a run that long, and each
    node's prefill time for a cached length (nodes often share a model)."""

    def __init__(
        self,
        view: ClusterView,
        request: PlacementRequest,
        params: ConductorParams,
        matches: Mapping[str, PrefixMatch],
        leasable: Mapping[str, PrefixMatch],
    ) -> None:
        """``matches``: every node's cached run of the prompt; ``leasable``:
        the part of it in tiers a peer can lease (``LEASABLE_TIERS``)."""
        # The last prompt token is always computed (its logits give the first token).
        self.usable = max(0, (request.num_prompt_tokens - 1) // params.block_size)
        if params.policy is not Policy.CONDUCTOR:
            leasable = {}
        ranked = []
        for other, match in leasable.items():
            nb = min(match.num_blocks, self.usable)
            m = view.members.get(other)
            if nb > 0 and m is not None and m.status is MemberStatus.ALIVE:
                ranked.append((-nb, other))
        ranked.sort()
        # A candidate is no holder of its own: the two longest cover every one.
        self._longest = [(-nb, other) for nb, other in ranked[:2]]
        self._held = sorted(m.num_blocks for m in matches.values())
        self._prefill: dict[tuple[object, ...], float] = {}
        self._view = view
        self._hashes = request.hashes[: self.usable]
        # Per layer range: the keys a stage holding those layers caches under.
        self._layer_hashes: dict[tuple[int, int], list[bytes]] = {}
        self._pipelines: dict[tuple[object, ...], PipelinePlan] = {}

    def stage_blocks(self, node_id: str, lo: int, hi: int) -> int:
        """Leading blocks of the prompt a stage holding layers [lo, hi) caches
        (its own keys, derived from the prompt's: ``layer_hashes``)."""
        key = (lo, hi)
        hashes = self._layer_hashes.get(key)
        if hashes is None:
            hashes = self._layer_hashes[key] = layer_hashes(self._hashes, lo, hi)
        return self._view.held_run(node_id, hashes)

    def longest_elsewhere(self, node_id: str) -> tuple[int, str | None]:
        """The longest prefix a node other than ``node_id`` can lease, and
        which (ties: the least node id); (0, None) when nobody can."""
        for nb, other in self._longest:
            if other != node_id:
                return nb, other
        return 0, None

    def copies(self, num_blocks: int) -> int:
        """Nodes holding a run of at least ``num_blocks`` of the prefix."""
        return len(self._held) - bisect.bisect_left(self._held, num_blocks)

    def pipeline(
        self,
        steps: tuple[StepCost, ...],
        new: int,
        cached: int,
        first: int,
        act_bytes: int,
        params: ConductorParams,
    ) -> PipelinePlan:
        """A pipelined group's chunks and idle times for this prompt, worked out
        once per distinct set of stage models (groups of one build share it)."""
        key = (steps, new, cached, first, act_bytes)
        plan = self._pipelines.get(key)
        if plan is None:
            chunks = equal_time_chunks(steps[0], new, cached, first, align=params.block_size)
            bps = params.default_link_bps
            hops = [params.fetch_rtt_s + k * act_bytes / bps for k in chunks]
            plan = self._pipelines[key] = PipelinePlan(
                chunks,
                hops,
                pipeline_prefill_s(list(steps), chunks, cached, hop_s=hops),
                tuple(pipeline_prefill_s([st], chunks, cached) for st in steps),
            )
        return plan

    def prefill_s(self, costs: NodeCosts, new: int, cached: int, decode_seqs: int) -> float:
        step = costs.step
        # By value, not by object: every node publishes its own costs.
        key = (
            step.base_s, step.token_s, step.pair_s, step.seq_s, step.ctx_s,
            costs.chunk_tokens, new, cached, decode_seqs,
        )  # fmt: skip
        t = self._prefill.get(key)
        if t is None:
            t = self._prefill[key] = costs.prefill_s(new, cached, decode_seqs=decode_seqs)
        return t


def prefill_score(
    request: PlacementRequest,
    params: ConductorParams,
    n: CandidateNode,
    nodes: Mapping[str, CandidateNode],
    prefixes: Prefixes,
) -> PrefillScore:
    bs = params.block_size
    total = request.num_prompt_tokens
    usable = prefixes.usable
    cand = n.cand
    local = cand.cached_blocks if cand.cached_blocks < usable else usable
    node_id = cand.node_id
    load = n.load
    costs = n.costs
    known = costs.step.known
    if known:
        queue_s = load.predicted_queue_s + n.pending.prefill_s
    else:
        queue_s = (load.queued_prefill_tokens + n.pending.prefill_tokens) * params.nominal_token_s

    def compute_s(cached_blocks: int) -> float:
        cached = cached_blocks * bs
        if not known:
            return (total - cached) * params.nominal_token_s
        return prefixes.prefill_s(costs, total - cached, cached, load.running_decode_batch)

    local_s = compute_s(local)
    local_ttft = queue_s + local_s
    new_tokens = total - local * bs
    if params.policy is not Policy.CONDUCTOR or not request.hashes:
        return PrefillScore(
            node_id, local, 0, None, queue_s, 0.0, local_s, local_ttft, False, known, new_tokens
        )
    remote, holder = prefixes.longest_elsewhere(node_id)
    if holder is None or remote <= local or remote < params.balancing_threshold * max(local, 1):
        return PrefillScore(
            node_id, local, remote, holder, queue_s, 0.0, local_s, local_ttft, False, known,
            new_tokens,
        )  # fmt: skip
    # Nodes holding (nearly all of) that prefix already: replicas.
    copies = prefixes.copies(remote)
    if copies >= params.max_replicas:
        return PrefillScore(
            node_id, local, remote, holder, queue_s, 0.0, local_s, local_ttft, False, known,
            new_tokens, f"{copies} copies already",
        )  # fmt: skip
    bps = n.costs.link_bps(holder) or params.default_link_bps
    kvb = n.costs.kv_bytes_per_token
    move_s = (
        transfer_s((remote - local) * bs, kvb, bps, params.fetch_rtt_s)
        if kvb > 0
        else params.fetch_rtt_s
    )
    rest_s = compute_s(remote)
    # The fetch runs while the request waits in the queue.
    fetch_ttft = max(queue_s, move_s) + rest_s
    if fetch_ttft >= local_ttft:
        return PrefillScore(
            node_id, local, remote, holder, queue_s, move_s, local_s, local_ttft, False, known,
            new_tokens, "recompute faster",
        )  # fmt: skip
    holder_node = nodes.get(holder)
    busy = holder_node is not None and fetch_ttft < _own_ttft(holder_node, total, remote, params)
    return PrefillScore(
        node_id,
        local,
        remote,
        holder,
        queue_s,
        move_s,
        rest_s,
        fetch_ttft,
        True,
        known,
        total - remote * bs,
        "replicates a busy holder's prefix" if busy else "fetches the prefix",
    )


def group_score(
    request: PlacementRequest,
    params: ConductorParams,
    n: CandidateNode,
    nodes: Mapping[str, CandidateNode],
    prefixes: Prefixes,
) -> PrefillScore:
    """A pipelined group's predicted TTFT (``n`` is its head): each stage
    waits out its own queue, computes its layers of each chunk once the
    stage before sent that chunk's activations, and the last stage's end is
    the TTFT (``costs.pipeline_prefill_s``). The chunks level in time by
    the head's model (``costs.equal_time_chunks``), as the head cuts them.
    A stage whose costs are unknown yet is priced by one whose are, scaled
    by their layers' share. The group computes what its stages all hold
    cached; it fetches nothing (its stages hold only their layers)."""
    bs = params.block_size
    total = request.num_prompt_tokens
    members = [nodes[ref.node_id] for ref in n.cand.stages]
    cached_blocks = min(
        prefixes.stage_blocks(ref.node_id, ref.layer_lo, ref.layer_hi) for ref in n.cand.stages
    )
    cached = cached_blocks * bs
    new = total - cached
    queues = [
        m.load.predicted_queue_s + m.pending.prefill_s
        if m.costs.step.known
        else (m.load.queued_prefill_tokens + m.pending.prefill_tokens) * params.nominal_token_s
        for m in members
    ]
    known = [m for m in members if m.costs.step.known]
    ids = tuple(ref.node_id for ref in n.cand.stages)
    if not known:
        # A ranking aid only: the stages split the layers, not the tokens.
        compute = new * params.nominal_token_s
        return PrefillScore(
            n.cand.node_id, cached_blocks, 0, None, max(queues), 0.0, compute,
            max(queues) + compute, False, False, new, "pipelined", ids,
        )  # fmt: skip
    steps = tuple(_stage_step(m, known) for m in members)
    head = members[0]
    first = head.stage.chunk_tokens if head.stage is not None else 0
    act = head.stage.act_bytes_per_token if head.stage is not None else 0
    plan = prefixes.pipeline(steps, new, cached, first, act, params)
    chunks, hops, idle, alone = plan.chunks, plan.hops, plan.idle_s, plan.alone_s
    # Only the queues differ between groups of alike stages: the rest is the plan's.
    ttft = (
        pipeline_prefill_s(list(steps), chunks, cached, queue_s=queues, hop_s=hops)
        if any(q > 0.0 for q in queues)
        else idle
    )
    return PrefillScore(
        n.cand.node_id,
        cached_blocks,
        0,
        None,
        ttft - idle,
        0.0,
        idle,
        ttft,
        False,
        True,
        new,
        f"pipelined: {len(members)} stages, {len(chunks)} chunks",
        ids,
        alone,
        len(chunks),
        # Every chunk crosses each boundary between stages once.
        sum(hops) * (len(members) - 1),
        max(0.0, idle - max(alone, default=0.0)),
    )


def _stage_step(m: CandidateNode, known: list[CandidateNode]) -> StepCost:
    """A stage's step model: its own, or (not fitted yet) another stage's
    scaled by the share of layers each holds."""
    if m.costs.step.known:
        return m.costs.step
    ref = known[0]
    mine = m.stage.layer_hi - m.stage.layer_lo if m.stage is not None else 1
    theirs = ref.stage.layer_hi - ref.stage.layer_lo if ref.stage is not None else 1
    k = mine / theirs
    st = ref.costs.step
    return StepCost(st.base_s, st.token_s * k, st.pair_s * k, st.seq_s * k, st.ctx_s * k)


def _own_ttft(n: CandidateNode, total: int, cached_blocks: int, params: ConductorParams) -> float:
    cached = cached_blocks * params.block_size
    if not n.costs.known:
        return (n.load.queued_prefill_tokens + total - cached) * params.nominal_token_s
    return (
        n.load.predicted_queue_s
        + n.pending.prefill_s
        + n.costs.prefill_s(total - cached, cached, decode_seqs=n.load.running_decode_batch)
    )


def random_order(pool: list[CandidateNode], rng: random.Random) -> list[int]:
    """The random policy's order: candidates shuffled, suspects last."""
    idx = list(range(len(pool)))
    rng.shuffle(idx)
    return sorted(idx, key=lambda i: pool[i].suspect)


def order_prefill(
    params: ConductorParams,
    pool: list[CandidateNode],
    scores: list[PrefillScore],
    rng: random.Random,
) -> list[int]:
    """Prefill candidates in the order to try them: by the policy's key (a
    random order, the shortest queue, or the least TTFT), suspects last,
    the near-best shuffled (``spread``)."""
    if params.policy is Policy.RANDOM:
        return random_order(pool, rng)
    idx = list(range(len(pool)))
    if params.policy is Policy.LOAD_BALANCE:
        keys = [s.queue_s for s in scores]
        idx.sort(key=lambda i: (pool[i].suspect, keys[i], pool[i].cand.node_id))
    else:
        keys = [s.ttft_s for s in scores]
        idx.sort(
            key=lambda i: (
                pool[i].suspect,
                keys[i],
                -pool[i].cand.cached_blocks,
                pool[i].cand.node_id,
            )
        )
    return spread(idx, keys, [n.suspect for n in pool], params.spread, params.spread_min, rng)


def spread(
    order: list[int],
    keys: Sequence[float],
    suspect: Sequence[bool],
    rel: float,
    floor: float,
    rng: random.Random,
) -> list[int]:
    """``order`` (best first by ``keys``) with its near-best in a random order.

    Near-best: not suspect, and a key within ``max(floor, rel x best)`` of
    the best. Entries deciding on the same gossip view rank alike; picking
    the best alone, a burst that enters several of them lands on one node
    (each entry's ledger sees only its own placements). Picking at random
    among candidates that are about as good spreads the burst at a bounded
    cost to each request; a clearly better candidate (a cached prefix, a
    shorter queue) still wins alone.
    """
    if (rel <= 0.0 and floor <= 0.0) or len(order) < 2 or suspect[order[0]]:
        return order
    best = keys[order[0]]
    limit = best + max(floor, rel * best)
    n = 1
    while n < len(order) and not suspect[order[n]] and keys[order[n]] <= limit:
        n += 1
    if n < 2:
        return order
    near = order[:n]
    rng.shuffle(near)
    return near + order[n:]


def decode_score(
    request: PlacementRequest, params: ConductorParams, slo: Slo, n: CandidateNode, join_in_s: float
) -> DecodeScore:
    return decode_scorer(request, params, slo, join_in_s)(n)


def decode_scorer(
    request: PlacementRequest, params: ConductorParams, slo: Slo, join_in_s: float
) -> Callable[[CandidateNode], DecodeScore]:
    """``decode_score`` of each candidate for one request: what does not
    depend on the candidate is worked out once (a pool may be hundreds)."""
    expected = request.expected_output_tokens or request.max_tokens / 2
    added_ctx = request.num_prompt_tokens + expected / 2
    forecast_run = params.early_reject not in (EarlyReject.CURRENT, EarlyReject.BASELINE)
    slo_tbt = slo.tbt_s

    def score(n: CandidateNode) -> DecodeScore:
        load = n.load
        costs = n.costs
        step = costs.step
        base, seq, per_ctx = step.base_s, step.seq_s, step.ctx_s
        # Its gossiped batch (handoffs waiting for KV included), and with
        # what this entry placed there since.
        gossiped = load.pending_decode
        if load.running_decode_batch > gossiped:
            gossiped = load.running_decode_batch
        extra = n.pending.decodes
        batch_now = gossiped + extra
        ctx_now = load.decode_context_tokens
        known = base > 0.0 or step.token_s > 0.0 or seq > 0.0
        if forecast_run:
            # Averaged over the request's own run, from when its prefill is
            # to end: what it shares its steps with, which is what its TBT is.
            forecast = n.forecast
            run_s = 0.0
            if known:
                b0, c0 = forecast.at(join_in_s, gossiped, ctx_now)
                run_s = expected * (base + seq * max(1, math.ceil(b0) + 1) + per_ctx * round(c0))
            batch, ctx = forecast.mean_over(join_in_s, run_s, gossiped, ctx_now)
        else:
            # The batch decoding now and its context (the handoffs' share
            # taken out): the node's load at the request's arrival, as the
            # Mooncake paper's early rejection (and its baseline) judge it.
            # Blind to what the prefills under way will hand over, it admits
            # more than the decode side can then serve within the SLO.
            batch = float(load.running_decode_batch)
            ctx = ctx_now * batch / gossiped if gossiped > 0 else 0.0
        batch += extra
        tbt = 0.0
        if known:
            if n.cand.role == "both" and load.queued_prefill_tokens > 0:
                queued = load.queued_prefill_tokens
                tbt = predicted_tbt_s(
                    costs, batch + 1, ctx + added_ctx, queued_prefill_tokens=queued
                )
            else:
                # predicted_tbt_s without a prefill chunk, inline: a pool may be hundreds.
                b = math.ceil(batch + 1)
                tbt = base + seq * (b if b > 1 else 1) + per_ctx * round(ctx + added_ctx)
        within = costs.max_batch <= 0 or batch + 1 <= costs.max_batch
        if within and known and slo_tbt > 0.0:
            within = params.tbt(tbt) * params.tbt_margin <= slo_tbt
        return DecodeScore(
            n.cand.node_id, batch_now, round(batch, 3), tbt, within, known, round(ctx, 1)
        )

    return score


def order_decode(
    params: ConductorParams,
    pool: list[CandidateNode],
    scores: list[DecodeScore],
    rng: random.Random,
) -> list[int]:
    """Decode candidates best first: least predicted TBT (``conductor``) or
    smallest batch, suspects last, the near-best shuffled (``spread``)."""
    if params.policy is Policy.RANDOM:
        return random_order(pool, rng)
    idx = list(range(len(pool)))
    if params.policy is Policy.CONDUCTOR:
        keys = [s.tbt_s for s in scores]
    else:
        keys = [float(s.batch_now) for s in scores]
    idx.sort(
        key=lambda i: (
            pool[i].suspect,
            keys[i],
            scores[i].batch_now,
            pool[i].load.kv_usage,
            pool[i].cand.node_id,
        )
    )
    floor = params.spread_min if params.policy is Policy.CONDUCTOR else 0.0
    return spread(idx, keys, [n.suspect for n in pool], params.decode_spread, floor, rng)


def tbt_forecast_text(params: ConductorParams, scores: Sequence[DecodeScore]) -> str:
    """The least TBT forecast among ``scores``, as the rejection judged it."""
    known = [s for s in scores if s.costs_known]
    if not known:
        return "no node has room"
    best = min(known, key=lambda s: s.tbt_s)
    margin = (
        f", {params.tbt_margin:.2f}x with the margin recent requests needed"
        if params.tbt_margin != 1.0
        else ""
    )
    return (
        f"predicted {params.tbt(best.tbt_s) * 1e3:.1f} ms{margin} on {best.node_id} "
        f"at batch {best.batch_at_join:g}"
    )


def tbt_retry_after(scores: Sequence[DecodeScore]) -> float:
    # The forecast's horizons are the times at which the batch is known to
    # shrink; without finer knowledge a second is a fair first retry.
    return 1.0 if scores else 5.0
