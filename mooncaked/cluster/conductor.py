"""The Conductor: where a request runs, or why it cannot, from a ``ClusterView``.

Pure: no I/O, no clock and no randomness of its own. The daemon's entry
calls ``decide`` with its live gossip view through its admission policy
(``admission.Admission``), and the simulator calls the same code with a
simulated view. ``decide`` reads as its four steps: the candidates, the
pools they form, the prefill ranking with the TTFT check, and the decode
ranking with the TBT check; the scores are ``ranking``'s.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

from mooncaked.cluster.block_index import PrefixMatch
from mooncaked.cluster.costs import NodeCosts, predicted_tbt_s
from mooncaked.cluster.holders import LEASABLE_TIERS
from mooncaked.cluster.offload import offloaded_scores
from mooncaked.cluster.placement import (
    Candidate,
    ConductorParams,
    EarlyReject,
    MemoryRef,
    PendingLoad,
    Placement,
    PlacementRequest,
    Policy,
    PrefillOffer,
    Reject,
)
from mooncaked.cluster.ranking import (
    CandidateNode,
    DecodeScore,
    PrefillScore,
    Prefixes,
    decode_score,
    decode_scorer,
    group_score,
    order_decode,
    order_prefill,
    prefill_score,
    tbt_forecast_text,
    tbt_retry_after,
)
from mooncaked.cluster.slo import Slo
from mooncaked.cluster.state import ClusterView, MemberStatus
from mooncaked.handoff import StageRef


@dataclass(frozen=True, slots=True)
class Decision:
    """A placement or a rejection, with every candidate's figures (``explain``)."""

    result: Placement | Reject
    policy: Policy
    prefill: tuple[PrefillScore, ...] = ()
    decode: tuple[DecodeScore, ...] = ()
    why: str = ""

    def to_json(self) -> dict[str, object]:
        r = self.result
        out: dict[str, object] = {
            "policy": self.policy.value,
            "why": self.why,
            "prefill_candidates": [s.to_json() for s in self.prefill],
            "decode_candidates": [s.to_json() for s in self.decode],
        }
        if isinstance(r, Placement):
            out["placement"] = {
                "decode": r.decode.node_id,
                "prefill": [c.node_id for c in r.prefill],
                "fetch": r.fetch,
                "prefill_fetch": list(r.prefill_fetch),
                # Late binding: what the entry forecast of each, as offered.
                "offers": [o.to_list() for o in r.offers],
                "predicted_ttft_s": round(r.predicted_ttft_s, 6),
                "predicted_tbt_s": round(r.predicted_tbt_s, 6),
                "model_ttft_s": round(r.model_ttft_s, 6),
                "model_tbt_s": round(r.model_tbt_s, 6),
                # Attention offloaded: the memory node, and the decode node's
                # offloaded step term by term (its score's).
                "memory": r.memory.to_json() if r.memory is not None else None,
                "offload": next(
                    (s.to_json()["offload"] for s in self.decode if s.node_id == r.decode.node_id),
                    None,
                )
                if r.memory is not None
                else None,
            }
        else:
            out["rejected"] = {
                "status": r.status,
                "reason": r.reason,
                "code": r.code,
                "retry_after_s": r.retry_after_s,
            }
        return out


@dataclass(frozen=True, slots=True)
class Pools:
    """Who prefills and who decodes; ``colocated``: one ``both`` node does both."""

    prefill: list[CandidateNode]
    decode: list[CandidateNode]
    colocated: bool = False


def decide(
    view: ClusterView,
    request: PlacementRequest,
    *,
    rng: random.Random,
    exclude: frozenset[str] = frozenset(),
    max_prefill: int | None = None,
    params: ConductorParams | None = None,
    slo: Slo | None = None,
    pending: Mapping[str, PendingLoad] | None = None,
) -> Decision:
    """Pick a decode node and prefill nodes for ``request`` from a gossip view.

    Candidates are alive (suspects only after every alive one), not
    draining, serve the request's model and are not in ``exclude`` (nodes
    that just failed this request). A ``prefill`` node only prefills and a
    ``decode`` node only decodes; a ``both`` node does either, or both in
    one engine (``pools``).

    - Prefill, by ``params.policy`` (see ``Policy``); under ``conductor``
      each candidate's TTFT is queue + prefill of what it lacks, or
      max(queue, transfer of a longer remote prefix) + prefill of the rest
      when the remote prefix is ``balancing_threshold`` times longer, the
      fetch is faster and fewer than ``max_replicas`` nodes hold it. A node
      busy with a hot prefix thus makes an idle node fetch it and become a
      holder too.
    - Decode: the predicted time between tokens with this request added, at
      the batch forecast over its run from when its prefill ends
      (``early_reject = predicted``) or at the batch decoding now; the
      least of those within the TBT SLO.
    - Admission: a request whose best TTFT misses the TTFT SLO, or (judged
      on arrival) that no decode node can take within the TBT SLO, is
      rejected with 429 and a retry hint (unless ``early_reject`` is off).

    ``pending`` is the load this entry placed that gossip does not show
    yet; ``rng`` drives the ``random`` policy and the spread among near-equal
    candidates.
    """
    params = params if params is not None else ConductorParams()
    slo = request.slo if request.slo is not None else (slo if slo is not None else Slo())
    max_prefill = params.max_prefill if max_prefill is None else max_prefill
    matches, leasable = view.longest_prefixes(request.hashes, LEASABLE_TIERS)
    nodes = candidates(view, request, exclude, pending if pending is not None else {}, matches)
    pools = choose_pools(view, request, nodes)
    if isinstance(pools, Reject):
        return Decision(pools, params.policy)
    if pools.colocated:
        return _colocated(view, request, params, slo, pools.prefill, matches, leasable, rng)
    return _disaggregated(
        view, request, params, slo, pools, nodes, matches, leasable, max_prefill, rng
    )


def candidates(
    view: ClusterView,
    request: PlacementRequest,
    exclude: frozenset[str],
    pending: Mapping[str, PendingLoad],
    matches: Mapping[str, PrefixMatch],
) -> dict[str, CandidateNode]:
    """Every node that may serve ``request`` now, with what is known of it."""
    nodes: dict[str, CandidateNode] = {}
    up = (MemberStatus.ALIVE, MemberStatus.SUSPECT)
    model_id = request.model_id
    none = PendingLoad()
    for node_id, m in view.members.items():
        st = m.state
        if st is None or m.status not in up or node_id in exclude:
            continue
        if st.draining or not st.api_addr or st.model_id != model_id:
            continue
        match = matches.get(node_id)
        nodes[node_id] = CandidateNode(
            _candidate(node_id, st.api_addr, st.role, match.num_blocks if match else 0),
            m.status is MemberStatus.SUSPECT,
            st.load,
            st.costs,
            st.forecast,
            pending.get(node_id, none),
            st.stage,
            st.offload,
        )
    return nodes


def groups(nodes: Mapping[str, CandidateNode], num_tokens: int = 0) -> list[CandidateNode]:
    """The pipelined prefill groups whose every stage is a candidate, each as
    one candidate: its head's, naming the stages. A group missing a stage
    (down, draining), or whose stages contradict one another (two claim one
    place, their layers do not split the model), serves nothing; nor does
    one with a stage whose input rows cannot hold a prompt of ``num_tokens``."""
    by_group: dict[str, list[CandidateNode]] = {}
    for n in nodes.values():
        if n.stage is not None:
            by_group.setdefault(n.stage.group, []).append(n)
    out: list[CandidateNode] = []
    for _, members in sorted(by_group.items()):
        members.sort(key=lambda m: (m.stage.index if m.stage else 0, m.cand.node_id))
        head = members[0]
        info = head.stage
        if info is None or len(members) != info.num_stages:
            continue
        at = 0
        refs: list[StageRef] = []
        for i, m in enumerate(members):
            st = m.stage
            if (
                st is None
                or st.index != i
                or st.num_stages != info.num_stages
                or st.num_layers != info.num_layers
                or st.layer_lo != at
            ):
                break
            refs.append(StageRef(m.cand.node_id, m.cand.url, st.layer_lo, st.layer_hi))
            at = st.layer_hi
        if len(refs) != info.num_stages or at != info.num_layers:
            continue
        if any(0 < m.stage.max_tokens < num_tokens for m in members if m.stage is not None):
            continue
        cand = Candidate(head.cand.node_id, head.cand.api_addr, "prefill", 0, tuple(refs))
        suspect = any(m.suspect for m in members)
        out.append(
            CandidateNode(cand, suspect, head.load, head.costs, head.forecast, head.pending, info)
        )
    return out


@functools.lru_cache(maxsize=8192)
def _candidate(node_id: str, api_addr: str, role: str, cached_blocks: int) -> Candidate:
    # Immutable and made for every node on every request: a bounded memo
    # saves a frozen dataclass's costly __init__ for all but the holders.
    return Candidate(node_id, api_addr, role, cached_blocks)


def choose_pools(
    view: ClusterView, request: PlacementRequest, nodes: Mapping[str, CandidateNode]
) -> Pools | Reject:
    """Dedicated decode nodes decode if there are any, else ``both`` nodes;
    dedicated prefill nodes prefill, else (when the decode node is
    dedicated) ``both`` nodes. A decode node with no prefill node alive
    prefills itself (an empty prefill pool). With no dedicated node at all,
    a cluster of ``both`` nodes serves each request on its entry node
    (peers' cached prefixes come to it through peer fetches), or on the
    best ``both`` node when the entry serves none."""
    by_role: dict[str, list[CandidateNode]] = {"prefill": [], "decode": [], "both": []}
    for n in nodes.values():
        pool = by_role.get(n.cand.role)
        # A stage prefills only with its group (a candidate of its own, below).
        if pool is not None and n.stage is None:
            pool.append(n)
    by_role["prefill"] += groups(nodes, request.num_prompt_tokens)
    prefill, decode, both = by_role["prefill"], by_role["decode"], by_role["both"]
    if not decode and not prefill:
        if not both:
            return Reject(
                503, f"no node of the cluster serves model {request.model_id!r} right now"
            )
        me = nodes.get(view.self_id)
        if me is not None and me.cand.role == "both":
            return Pools([me], [me], colocated=True)
        return Pools(both, both, colocated=True)
    if decode:
        return Pools(prefill or both, decode)
    if both:
        return Pools(prefill, both)
    return Reject(
        503,
        f"no decode node serves model {request.model_id!r} right now "
        f"({len(prefill)} prefill node(s) alive, none can decode)",
    )


def _disaggregated(
    view: ClusterView,
    request: PlacementRequest,
    params: ConductorParams,
    slo: Slo,
    pools: Pools,
    nodes: Mapping[str, CandidateNode],
    matches: Mapping[str, PrefixMatch],
    leasable: Mapping[str, PrefixMatch],
    max_prefill: int,
    rng: random.Random,
) -> Decision:
    """Prefill nodes by TTFT, then the decode node by TBT from when the prefill ends."""
    prefixes = Prefixes(view, request, params, matches, leasable)
    pool = pools.prefill
    scores = [
        group_score(request, params, n, nodes, prefixes)
        if n.cand.stages
        else prefill_score(request, params, n, nodes, prefixes)
        for n in pool
    ]
    order = within_ttft_first(params, slo, scores, order_prefill(params, pool, scores, rng))
    best = scores[order[0]] if order else None
    reject = check_ttft(params, slo, best)
    if reject is not None:
        return Decision(reject, params.policy, tuple(scores), (), reject.reason)
    join_in_s = params.ttft(best.ttft_s) if best is not None else 0.0
    dpool = pools.decode
    scorer = decode_scorer(request, params, slo, join_in_s)
    dscores = offloaded_scores(view, request, params, slo, dpool, [scorer(n) for n in dpool])
    dorder = order_decode(params, dpool, dscores, rng)
    if judges_tbt(params, slo):
        dorder = [i for i in dorder if dscores[i].within_slo]
        if not dorder:
            reject = _tbt_reject(params, slo, dscores, "no decode node can")
            return Decision(reject, params.policy, tuple(scores), tuple(dscores), reject.reason)
    d, dbest = dpool[dorder[0]], dscores[dorder[0]]
    if best is None:
        placement = Placement(
            decode=d.cand,
            fetch=params.policy is Policy.CONDUCTOR,
            predicted_tbt_s=params.tbt(dbest.tbt_s),
            model_tbt_s=dbest.tbt_s,
            memory=memory_ref(dbest),
        )
        why = "no prefill node alive: the decode node prefills itself"
        return Decision(placement, params.policy, tuple(scores), tuple(dscores), why)
    model_ttft = best.ttft_s if best.costs_known else 0.0
    tried = order[:max_prefill]
    placement = Placement(
        decode=d.cand,
        prefill=tuple(pool[i].cand for i in tried),
        fetch=best.fetch,
        # A group's stages pull what a peer holds of their own layers (another
        # group's same stage) under the conductor policy: placement does not
        # price it, a stage only asks where the cluster index says a peer has it.
        prefill_fetch=tuple(
            scores[i].fetch or (bool(pool[i].cand.stages) and params.policy is Policy.CONDUCTOR)
            for i in tried
        ),
        predicted_ttft_s=params.ttft(model_ttft),
        predicted_tbt_s=params.tbt(dbest.tbt_s),
        model_ttft_s=model_ttft,
        model_tbt_s=dbest.tbt_s,
        offers=offers(params, [scores[i] for i in tried]),
        memory=memory_ref(dbest),
    )
    return Decision(
        placement, params.policy, tuple(scores), tuple(dscores), _why(params, best, dbest)
    )


def _colocated(
    view: ClusterView,
    request: PlacementRequest,
    params: ConductorParams,
    slo: Slo,
    pool: list[CandidateNode],
    matches: Mapping[str, PrefixMatch],
    leasable: Mapping[str, PrefixMatch],
    rng: random.Random,
) -> Decision:
    """One ``both`` node prefills and decodes: the least TTFT among ``pool``."""
    in_pool = {n.cand.node_id: n for n in pool}
    prefixes = Prefixes(view, request, params, matches, leasable)
    scores = [prefill_score(request, params, n, in_pool, prefixes) for n in pool]
    order = within_ttft_first(params, slo, scores, order_prefill(params, pool, scores, rng))
    best = scores[order[0]]
    reject = check_ttft(params, slo, best)
    if reject is not None:
        return Decision(reject, params.policy, tuple(scores), (), reject.reason)
    node = pool[order[0]]
    d = decode_score(request, params, slo, node, params.ttft(best.ttft_s))
    d = offloaded_scores(view, request, params, slo, [node], [d])[0]
    if judges_tbt(params, slo) and not d.within_slo:
        reject = _tbt_reject(params, slo, [d], "this node cannot")
        return Decision(reject, params.policy, tuple(scores), (d,), reject.reason)
    model_ttft = best.ttft_s if best.costs_known else 0.0
    placement = Placement(
        decode=node.cand,
        # One engine: the node's store pulls what peers hold ahead of the
        # request (a prefetch it cancels past its deadline), as it always
        # did; the policies without a global cache view never fetch.
        fetch=params.policy is Policy.CONDUCTOR,
        predicted_ttft_s=params.ttft(model_ttft),
        predicted_tbt_s=params.tbt(d.tbt_s),
        model_ttft_s=model_ttft,
        model_tbt_s=d.tbt_s,
        memory=memory_ref(d),
    )
    why = "colocated: one engine" + (f", attention on memory node {d.memory}" if d.memory else "")
    return Decision(placement, params.policy, tuple(scores), (d,), why)


def memory_ref(score: DecodeScore) -> MemoryRef | None:
    """The memory node a decode score pairs its node with (None: attention local)."""
    return MemoryRef(score.memory, score.attention_addr) if score.memory else None


def offers(params: ConductorParams, tried: list[PrefillScore]) -> tuple[PrefillOffer, ...]:
    """Late binding: what the entry forecast of each prefill candidate it
    lists (``PrefillWalk`` offers the request by them). Empty without late
    binding or with a candidate whose costs are unknown."""
    if not params.late_binding or len(tried) < 2 or not all(s.costs_known for s in tried):
        return ()
    return tuple(
        PrefillOffer(s.ttft_s, s.transfer_s if s.fetch else 0.0, s.prefill_s, params.bind_slack)
        for s in tried
    )


def admits_decode(
    costs: NodeCosts,
    batch: int,
    context_tokens: int,
    prompt_tokens: int,
    expected_output_tokens: float,
    slo: Slo,
) -> bool:
    """The Mooncake paper's baseline (``EarlyReject.BASELINE``): a decode node
    takes a request whose prefill is done only while a step of its batch now
    (``batch`` requests holding ``context_tokens``) with it added stays
    within the TBT SLO. A refusal then has cost a prefill for nothing: what
    early rejection on arrival avoids."""
    if slo.tbt_s <= 0.0 or not costs.known:
        return True
    ctx = context_tokens + prompt_tokens + expected_output_tokens / 2
    return predicted_tbt_s(costs, batch + 1, ctx) <= slo.tbt_s


def judges_tbt(params: ConductorParams, slo: Slo) -> bool:
    """Whether the TBT SLO is judged on arrival (``EarlyReject.on_arrival``)."""
    return params.early_reject.on_arrival and slo.tbt_s > 0.0


def within_ttft_first(
    params: ConductorParams, slo: Slo, scores: list[PrefillScore], order: list[int]
) -> list[int]:
    """``order`` with the candidates the TTFT check admits first: a random
    pick among near-equals (``ranking.spread``) must not reject a request
    that the best of them would serve within the SLO."""
    if not order or check_ttft(params, slo, scores[order[0]]) is None:
        return order
    ok = [i for i in order if check_ttft(params, slo, scores[i]) is None]
    if len(ok) == len(order) or not ok:
        return order
    admitted = set(ok)
    return ok + [i for i in order if i not in admitted]


def check_ttft(params: ConductorParams, slo: Slo, best: PrefillScore | None) -> Reject | None:
    """The rejection of a request whose best TTFT, corrected and with the
    entry's margin, misses the TTFT SLO; None when it meets it (or nothing
    judges it: no SLO, no costs known yet, early rejection off).

    A request that misses the SLO even on an idle node (its own prefill is
    longer) is served as well as can be, not rejected, when its node can
    start it within ``best_effort_wait`` of the SLO: a retry would fail the
    same way, so a 429 would turn it away for good, and its conversation's
    next turns would lose the prefix it leaves cached. It counts as a late
    failure. Behind a longer queue it is rejected like any other."""
    if (
        best is None
        or params.early_reject is EarlyReject.OFF
        or slo.ttft_s <= 0.0
        or not best.costs_known
        or params.ttft(best.ttft_s) * params.ttft_margin <= slo.ttft_s
    ):
        return None
    idle_s = (best.transfer_s if best.fetch else 0.0) + best.prefill_s
    wait_s = best.ttft_s - idle_s
    if (
        params.best_effort_wait > 0.0
        and params.ttft(idle_s) > slo.ttft_s
        and wait_s <= params.best_effort_wait * slo.ttft_s
    ):
        return None
    ttft = params.ttft(best.ttft_s)
    margin = (
        f", {params.ttft_margin:.2f}x with the margin recent requests needed"
        if params.ttft_margin != 1.0
        else ""
    )
    return Reject(
        429,
        f"predicted time to first token {ttft:.2f} s{margin} exceeds the SLO of "
        f"{slo.ttft_s:.2f} s (queue {best.queue_s:.2f} s on the best node, {best.node_id}); "
        "retry later",
        retry_after_s=max(1.0, math.ceil(ttft * params.ttft_margin - slo.ttft_s)),
        code="ttft_slo",
    )


def _tbt_reject(params: ConductorParams, slo: Slo, scores: list[DecodeScore], who: str) -> Reject:
    return Reject(
        429,
        f"{who} keep the time between tokens within {slo.tbt_s * 1e3:.0f} ms "
        f"({params.early_reject.value} load; {tbt_forecast_text(params, scores)}); retry later",
        retry_after_s=tbt_retry_after(scores),
        code="tbt_slo",
    )


def _why(params: ConductorParams, best: PrefillScore, d: DecodeScore) -> str:
    p = {
        Policy.RANDOM: f"prefill on {best.node_id} (random)",
        Policy.LOAD_BALANCE: f"prefill on {best.node_id}: shortest queue ({best.queue_s:.3f} s)",
        Policy.LOCAL_CACHE: (
            f"prefill on {best.node_id}: least TTFT on its own cache "
            f"({best.local_blocks} blocks cached, {best.ttft_s:.3f} s)"
        ),
        Policy.CONDUCTOR: (
            f"prefill on {best.node_id}: least TTFT ({best.ttft_s:.3f} s"
            + (
                f", fetching {best.remote_blocks} blocks from {best.holder}"
                if best.fetch
                else f", {best.local_blocks} blocks cached"
            )
            + ")"
        ),
    }[params.policy]
    mem = f", attention on memory node {d.memory}" if d.memory else ""
    return (
        f"{p}; decode on {d.node_id}: predicted TBT {d.tbt_s * 1e3:.1f} ms "
        f"at batch {d.batch_at_join:g}{mem}"
    )
