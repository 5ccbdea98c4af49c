"""The Conductor's policies: pure functions over a ``ClusterView`` snapshot.

No I/O and no clock of its own: the daemon calls these with its live gossip
view, and a simulator can call them with a simulated one.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mooncaked.cache.hashing import BlockHash
from mooncaked.cache.tiers import Tier
from mooncaked.cluster.predict import (
    PROBE_AFTER_S,
    Calibration,
    DecodeForecast,
    NodeCosts,
    predicted_tbt_s,
    target_each,
    transfer_s,
)
from mooncaked.cluster.state import (
    ClusterView,
    MemberStatus,
    NodeLoad,
    PrefixMatch,
    tier_mask,
)

# Peers asked for one prefix at most: the index may be a little stale, so a
# second and third holder hedge a first that evicted the blocks meanwhile;
# every extra one costs a lease round trip.
MAX_HOLDERS = 3
# What a peer can lease: DRAM slots, and SSD blocks it promotes to DRAM first.
LEASABLE_TIERS = tier_mask(Tier.DRAM, Tier.SSD)


def rank_holders(
    view: ClusterView, hashes: Sequence[BlockHash], max_holders: int = MAX_HOLDERS
) -> list[str]:
    """API addresses (``host:port``) of the peers to ask for a prefix, best first.

    Holders are other alive members with an API address whose index holds a
    leading run of ``hashes`` in a leasable tier; longest run first, then not
    draining (it is about to leave), then fewer SSD blocks (a holder reads
    those before it can lease them), then node id (a deterministic order).
    Suspects are left out: asking one could cost the whole fetch deadline.
    """
    if max_holders <= 0:
        raise ValueError(f"max_holders must be > 0, got {max_holders}")
    if not hashes:
        return []
    matches = view.longest_prefix(hashes, tiers=LEASABLE_TIERS)
    ranked: list[tuple[int, bool, int, str, str]] = []
    for node_id, match in matches.items():
        if node_id == view.self_id:
            continue
        m = view.members.get(node_id)
        if m is None or m.status is not MemberStatus.ALIVE or m.state is None:
            continue
        st = m.state
        if not st.api_addr:
            continue
        ranked.append(
            (-match.num_blocks, st.draining, match.tier_blocks[Tier.SSD], node_id, st.api_addr)
        )
    ranked.sort()
    return [addr for *_, addr in ranked[:max_holders]]


# -- placement ---------------------------------------------------------------------


class Policy(enum.StrEnum):
    """How prefill and decode nodes are chosen (``[conductor] policy``)."""

    # Any serving node, at random (a baseline).
    RANDOM = "random"
    # The shortest predicted prefill queue; the smallest decode batch.
    LOAD_BALANCE = "load_balance"
    # Least predicted TTFT counting each node's own cache only (no fetching).
    LOCAL_CACHE = "local_cache"
    # Least predicted TTFT over the whole cluster's cache: a node may fetch a
    # longer prefix from a holder when that beats recomputing it.
    CONDUCTOR = "conductor"


class EarlyReject(enum.StrEnum):
    """How a request is judged against the TBT SLO (``[conductor] early_reject``)."""

    # Never: every request is admitted (the decode nodes may miss the SLO).
    OFF = "off"
    # On the decode nodes' load now: the batch decoding at the request's
    # arrival, not the handoffs the prefills under way will bring (the
    # Mooncake paper's baseline).
    CURRENT = "current"
    # On the load forecast for this request's run, from when its prefill
    # ends: decodes that will have finished by then no longer count, the
    # handoffs placed there do once they are expected to join, and so do
    # the arrivals the node's recent departures stand for.
    PREDICTED = "predicted"


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency targets; 0 means none."""

    ttft_s: float = 0.0
    tbt_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ConductorParams:
    policy: Policy = Policy.CONDUCTOR
    early_reject: EarlyReject = EarlyReject.PREDICTED
    # Fetch a remote prefix only when it is this many times longer than the
    # prefix the prefill node holds itself (Mooncake's
    # kvcache_balancing_threshold), and the fetch beats recomputing.
    balancing_threshold: float = 1.2
    # Copies of a prefix the cluster may hold: past it nobody fetches the
    # prefix to become one more holder.
    max_replicas: int = 3
    # Tokens per KV block (the block hashes' unit).
    block_size: int = 16
    # Fixed cost of a fetch (lease round trip) on top of its bytes.
    fetch_rtt_s: float = 0.005
    # Bytes/s assumed for a link nobody measured yet.
    default_link_bps: float = 1e9
    # Prefill nodes to try in order, so the decode node can try the next when one fails.
    max_prefill: int = 3
    # Seconds per prompt token assumed of a node whose costs are unknown yet
    # (a ranking aid only: it never rejects).
    nominal_token_s: float = 1e-4
    # The entry node's correction of the models' forecasts by what it
    # measured (predict.Calibration): TTFT = offset + scale x model, TBT =
    # tbt_offset + tbt_scale x model. Monotonic, so it never changes a
    # ranking; it changes what is promised and what is rejected.
    ttft_offset_s: float = 0.0
    ttft_scale: float = 1.0
    tbt_offset_s: float = 0.0
    tbt_scale: float = 1.0
    # Admission judges the corrected forecast times these: the ratio of
    # measured to forecast that the SLO's target share of recent requests
    # stayed within (predict.Calibration.margin), so that share of the
    # requests admitted meets the SLO, not half of those forecast near it.
    ttft_margin: float = 1.0
    tbt_margin: float = 1.0

    def ttft(self, model_s: float) -> float:
        return self.ttft_offset_s + self.ttft_scale * model_s if model_s > 0.0 else model_s

    def tbt(self, model_s: float) -> float:
        return self.tbt_offset_s + self.tbt_scale * model_s if model_s > 0.0 else model_s


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """What placement needs of a request: its model and its prompt's block hashes."""

    model_id: str
    hashes: tuple[BlockHash, ...]
    num_prompt_tokens: int
    # Output tokens the request may produce, and how many it is expected to
    # (learnt from recent requests); 0: unknown.
    max_tokens: int = 0
    expected_output_tokens: float = 0.0
    # Per-request targets tighter or looser than the node's; None: the node's.
    slo: Slo | None = None


@dataclass(frozen=True, slots=True)
class Candidate:
    node_id: str
    # host:port of the node's HTTP API.
    api_addr: str
    role: str
    # Leading prompt blocks the node holds in any tier (the cluster index's view).
    cached_blocks: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.api_addr}"


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request runs: its decode node, and the prefill nodes to try in
    order (empty: the decode node computes the prompt itself, in one engine)."""

    decode: Candidate
    prefill: tuple[Candidate, ...] = ()
    # Whether the prefill node should pull a longer prefix from its holders
    # (False: recompute what it does not hold itself).
    fetch: bool = True
    # The Conductor's forecast, for the client's headers and for checking
    # predictions against what happens (0: not predicted); calibrated by
    # what the entry measured, and as the cost models alone gave them.
    predicted_ttft_s: float = 0.0
    predicted_tbt_s: float = 0.0
    model_ttft_s: float = 0.0
    model_tbt_s: float = 0.0

    @property
    def colocated(self) -> bool:
        return not self.prefill


@dataclass(frozen=True, slots=True)
class Reject:
    """No placement: the HTTP status to answer and why, for the client."""

    status: int
    reason: str
    # Seconds after which a retry may succeed (429s); None: unknown.
    retry_after_s: float | None = None
    # A short machine-readable cause, for metrics: ttft_slo, tbt_slo, no_node...
    code: str = "no_node"


def calibrated(
    params: ConductorParams,
    ttft: Calibration,
    tbt: Calibration,
    slo: Slo,
    target: float,
    *,
    margins: bool = True,
) -> ConductorParams:
    """``params`` with an entry's corrections of the forecasts (``ttft``,
    ``tbt``) and, unless ``margins`` is False, the admission margins that
    let ``target`` of the admitted meet both of ``slo``."""
    each = target_each(slo.ttft_s, slo.tbt_s, target)
    return dataclasses.replace(
        params,
        ttft_offset_s=ttft.offset_s,
        ttft_scale=ttft.scale,
        tbt_offset_s=tbt.offset_s,
        tbt_scale=tbt.scale,
        ttft_margin=ttft.margin(each, slo.ttft_s) if margins else 1.0,
        tbt_margin=tbt.margin(each, slo.tbt_s) if margins else 1.0,
    )


def may_probe(result: Placement | Reject, quiet_s: float) -> bool:
    """Whether to judge ``result`` again without the margins: an SLO
    rejection by an entry that has neither admitted nor measured a request
    for ``quiet_s`` (``PROBE_AFTER_S``)."""
    return (
        isinstance(result, Reject)
        and result.code in ("ttft_slo", "tbt_slo")
        and quiet_s >= PROBE_AFTER_S
    )


@dataclass(frozen=True, slots=True)
class PendingLoad:
    """Load this entry node sent a node that its gossip state does not show yet."""

    prefill_s: float = 0.0
    prefill_tokens: int = 0
    decodes: int = 0


def _fields_json(obj: object) -> dict[str, object]:
    """A slotted dataclass as JSON, finite floats rounded to the microsecond."""
    return {
        f: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v)
        for f, v in ((f, getattr(obj, f)) for f in obj.__slots__)  # type: ignore[attr-defined]
    }


@dataclass(frozen=True, slots=True)
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

    def to_json(self) -> dict[str, object]:
        return _fields_json(self)


@dataclass(frozen=True, slots=True)
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

    def to_json(self) -> dict[str, object]:
        return _fields_json(self)


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
                "predicted_ttft_s": round(r.predicted_ttft_s, 6),
                "predicted_tbt_s": round(r.predicted_tbt_s, 6),
                "model_ttft_s": round(r.model_ttft_s, 6),
                "model_tbt_s": round(r.model_tbt_s, 6),
            }
        else:
            out["rejected"] = {
                "status": r.status,
                "reason": r.reason,
                "code": r.code,
                "retry_after_s": r.retry_after_s,
            }
        return out


def place(
    view: ClusterView,
    request: PlacementRequest,
    now: float,
    *,
    exclude: frozenset[str] = frozenset(),
    max_prefill: int | None = None,
    params: ConductorParams | None = None,
    slo: Slo | None = None,
    pending: Mapping[str, PendingLoad] | None = None,
    rng: random.Random | None = None,
) -> Placement | Reject:
    """``decide(...).result``: where to run ``request``, or why not."""
    return decide(
        view,
        request,
        now,
        exclude=exclude,
        max_prefill=max_prefill,
        params=params,
        slo=slo,
        pending=pending,
        rng=rng,
    ).result


@dataclass(slots=True)
class _Node:
    cand: Candidate
    suspect: bool
    load: NodeLoad
    costs: NodeCosts
    forecast: DecodeForecast
    pending: PendingLoad


def decide(
    view: ClusterView,
    request: PlacementRequest,
    now: float,
    *,
    exclude: frozenset[str] = frozenset(),
    max_prefill: int | None = None,
    params: ConductorParams | None = None,
    slo: Slo | None = None,
    pending: Mapping[str, PendingLoad] | None = None,
    rng: random.Random | None = None,
) -> Decision:
    """Pick a decode node and prefill nodes for ``request`` from a gossip view.

    Candidates are alive (suspects only after every alive one), not
    draining, serve the request's model and are not in ``exclude`` (nodes
    that just failed this request). A ``prefill`` node only prefills and a
    ``decode`` node only decodes; a ``both`` node does either, or both in
    one engine.

    - Roles: dedicated decode nodes decode if there are any, else ``both``
      nodes; dedicated prefill nodes prefill, else (when the decode node is
      dedicated) ``both`` nodes. A decode node with no prefill node alive
      prefills itself. With no dedicated node at all, a cluster of ``both``
      nodes serves each request on its entry node (peers' cached prefixes
      come to it through peer fetches), or on the best ``both`` node when
      the entry serves none.
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
    - Admission: a request whose best TTFT misses the TTFT SLO, or that no
      decode node can take within the TBT SLO, is rejected with 429 and a
      retry hint (unless ``early_reject`` is off).

    Pure: no I/O and no clock of its own; ``now`` is the caller's, ``rng``
    drives the ``random`` policy, ``pending`` is the load this entry node
    placed that gossip does not show yet.
    """
    params = params if params is not None else ConductorParams()
    slo = request.slo if request.slo is not None else (slo if slo is not None else Slo())
    pending = pending if pending is not None else {}
    max_prefill = params.max_prefill if max_prefill is None else max_prefill
    del now
    matches = view.longest_prefix(request.hashes) if request.hashes else {}
    nodes: dict[str, _Node] = {}
    pools: dict[str, list[_Node]] = {"prefill": [], "decode": [], "both": []}
    for node_id, m in view.members.items():
        st = m.state
        if m.status not in (MemberStatus.ALIVE, MemberStatus.SUSPECT):
            continue
        if st is None or node_id in exclude:
            continue
        if st.draining or not st.api_addr or st.model_id != request.model_id:
            continue
        match = matches.get(node_id)
        n = _Node(
            Candidate(node_id, st.api_addr, st.role, match.num_blocks if match else 0),
            m.status is MemberStatus.SUSPECT,
            st.load,
            st.costs,
            st.forecast,
            pending.get(node_id, PendingLoad()),
        )
        nodes[node_id] = n
        pool = pools.get(st.role)
        if pool is not None:
            pool.append(n)

    prefill_nodes, decode_nodes, both_nodes = pools["prefill"], pools["decode"], pools["both"]
    if not decode_nodes and not prefill_nodes:
        if not both_nodes:
            return Decision(
                Reject(503, f"no node of the cluster serves model {request.model_id!r} right now"),
                params.policy,
            )
        me = nodes.get(view.self_id)
        if me is not None and me.cand.role == "both":
            # A cluster of `both` nodes: each serves what enters it.
            return _colocated(view, request, params, slo, [me], matches, rng)
        return _colocated(view, request, params, slo, both_nodes, matches, rng)
    if decode_nodes:
        decode_pool = decode_nodes
        prefill_pool = prefill_nodes or both_nodes
    elif both_nodes:
        decode_pool = both_nodes
        prefill_pool = prefill_nodes
    else:
        return Decision(
            Reject(
                503,
                f"no decode node serves model {request.model_id!r} right now "
                f"({len(prefill_nodes)} prefill node(s) alive, none can decode)",
            ),
            params.policy,
        )
    leasable = _leasable(view, request, params)
    scores = [
        _prefill_score(view, request, params, n, nodes, matches, leasable) for n in prefill_pool
    ]
    order = _order_prefill(params, prefill_pool, scores, rng)
    chosen = [prefill_pool[i] for i in order[:max_prefill]]
    best = scores[order[0]] if order else None
    ttft = best.ttft_s if best is not None else 0.0
    reject = _check_ttft(params, slo, best)
    if reject is not None:
        return Decision(reject, params.policy, tuple(scores), (), reject.reason)
    dscores = [_decode_score(request, params, slo, n, params.ttft(ttft)) for n in decode_pool]
    dorder = _order_decode(params, decode_pool, dscores, rng)
    if params.early_reject is not EarlyReject.OFF and slo.tbt_s > 0.0:
        dorder = [i for i in dorder if dscores[i].within_slo]
        if not dorder:
            reject = Reject(
                429,
                f"no decode node can keep the time between tokens within "
                f"{slo.tbt_s * 1e3:.0f} ms ({params.early_reject.value} load; "
                f"{_tbt_forecast(params, dscores)}); retry later",
                retry_after_s=_tbt_retry_after(dscores),
                code="tbt_slo",
            )
            return Decision(reject, params.policy, tuple(scores), tuple(dscores), reject.reason)
    d = decode_pool[dorder[0]]
    dbest = dscores[dorder[0]]
    if not prefill_pool:
        placement = Placement(
            decode=d.cand,
            fetch=params.policy is Policy.CONDUCTOR,
            predicted_tbt_s=params.tbt(dbest.tbt_s),
            model_tbt_s=dbest.tbt_s,
        )
        why = "no prefill node alive: the decode node prefills itself"
        return Decision(placement, params.policy, tuple(scores), tuple(dscores), why)
    assert best is not None
    model_ttft = best.ttft_s if best.costs_known else 0.0
    placement = Placement(
        decode=d.cand,
        prefill=tuple(n.cand for n in chosen),
        fetch=best.fetch,
        predicted_ttft_s=params.ttft(model_ttft),
        predicted_tbt_s=params.tbt(dbest.tbt_s),
        model_ttft_s=model_ttft,
        model_tbt_s=dbest.tbt_s,
    )
    return Decision(
        placement, params.policy, tuple(scores), tuple(dscores), _why(params, best, dbest)
    )


def _colocated(
    view: ClusterView,
    request: PlacementRequest,
    params: ConductorParams,
    slo: Slo,
    pool: list[_Node],
    matches: Mapping[str, PrefixMatch],
    rng: random.Random | None,
) -> Decision:
    """One ``both`` node prefills and decodes: the least TTFT among ``pool``."""
    nodes = {n.cand.node_id: n for n in pool}
    leasable = _leasable(view, request, params)
    scores = [_prefill_score(view, request, params, n, nodes, matches, leasable) for n in pool]
    order = _order_prefill(params, pool, scores, rng)
    best = scores[order[0]]
    reject = _check_ttft(params, slo, best)
    if reject is not None:
        return Decision(reject, params.policy, tuple(scores), (), reject.reason)
    node = pool[order[0]]
    d = _decode_score(request, params, slo, node, params.ttft(best.ttft_s))
    if params.early_reject is not EarlyReject.OFF and slo.tbt_s > 0.0 and not d.within_slo:
        reject = Reject(
            429,
            f"this node cannot keep the time between tokens within {slo.tbt_s * 1e3:.0f} ms "
            f"({params.early_reject.value} load; {_tbt_forecast(params, [d])}); retry later",
            retry_after_s=_tbt_retry_after([d]),
            code="tbt_slo",
        )
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
    )
    return Decision(placement, params.policy, tuple(scores), (d,), "colocated: one engine")


def _leasable(
    view: ClusterView, request: PlacementRequest, params: ConductorParams
) -> dict[str, PrefixMatch]:
    """The prefix each node can lease (DRAM or SSD; device blocks cannot be),
    looked up once per request rather than once per candidate."""
    if params.policy is not Policy.CONDUCTOR or not request.hashes:
        return {}
    return view.longest_prefix(request.hashes, tiers=LEASABLE_TIERS)


def _prefill_score(
    view: ClusterView,
    request: PlacementRequest,
    params: ConductorParams,
    n: _Node,
    nodes: Mapping[str, _Node],
    matches: Mapping[str, PrefixMatch],
    leasable: Mapping[str, PrefixMatch],
) -> PrefillScore:
    bs = params.block_size
    total = request.num_prompt_tokens
    # The last prompt token is always computed (its logits give the first token).
    usable = max(0, (total - 1) // bs)
    local = min(n.cand.cached_blocks, usable)
    node_id = n.cand.node_id
    known = n.costs.known
    queue_s = n.load.predicted_queue_s + n.pending.prefill_s
    if not known:
        queue_s = (n.load.queued_prefill_tokens + n.pending.prefill_tokens) * params.nominal_token_s

    def compute_s(cached_blocks: int) -> float:
        cached = cached_blocks * bs
        if not known:
            return (total - cached) * params.nominal_token_s
        return n.costs.prefill_s(total - cached, cached, decode_seqs=n.load.running_decode_batch)

    local_s = compute_s(local)
    score = PrefillScore(
        node_id,
        local,
        0,
        None,
        queue_s,
        0.0,
        local_s,
        queue_s + local_s,
        False,
        known,
        total - local * bs,
    )
    if params.policy is not Policy.CONDUCTOR or not request.hashes:
        return score
    # The longest prefix another node can lease.
    remote, holder, copies = 0, None, 0
    for other, match in leasable.items():
        nb = min(match.num_blocks, usable)
        if other == node_id or nb <= 0:
            continue
        m = view.members.get(other)
        if m is None or m.status is not MemberStatus.ALIVE:
            continue
        if nb > remote or (nb == remote and holder is not None and other < holder):
            remote, holder = nb, other
    if holder is None or remote <= local or remote < params.balancing_threshold * max(local, 1):
        return dataclasses.replace(score, remote_blocks=remote, holder=holder)
    # Nodes holding (nearly all of) that prefix already: replicas.
    copies = sum(1 for mt in matches.values() if mt.num_blocks >= remote)
    if copies >= params.max_replicas:
        return dataclasses.replace(
            score, remote_blocks=remote, holder=holder, note=f"{copies} copies already"
        )
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
    if fetch_ttft >= score.ttft_s:
        return dataclasses.replace(
            score, remote_blocks=remote, holder=holder, transfer_s=move_s, note="recompute faster"
        )
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


def _own_ttft(n: _Node, total: int, cached_blocks: int, params: ConductorParams) -> float:
    cached = cached_blocks * params.block_size
    if not n.costs.known:
        return (n.load.queued_prefill_tokens + total - cached) * params.nominal_token_s
    return (
        n.load.predicted_queue_s
        + n.pending.prefill_s
        + n.costs.prefill_s(total - cached, cached, decode_seqs=n.load.running_decode_batch)
    )


def _order_prefill(
    params: ConductorParams,
    pool: list[_Node],
    scores: list[PrefillScore],
    rng: random.Random | None,
) -> list[int]:
    idx = list(range(len(pool)))
    if params.policy is Policy.RANDOM:
        (rng or random.Random()).shuffle(idx)
        return sorted(idx, key=lambda i: pool[i].suspect)
    if params.policy is Policy.LOAD_BALANCE:
        return sorted(idx, key=lambda i: (pool[i].suspect, scores[i].queue_s, pool[i].cand.node_id))
    return sorted(
        idx,
        key=lambda i: (
            pool[i].suspect,
            scores[i].ttft_s,
            -pool[i].cand.cached_blocks,
            pool[i].cand.node_id,
        ),
    )


def _check_ttft(params: ConductorParams, slo: Slo, best: PrefillScore | None) -> Reject | None:
    if (
        best is None
        or params.early_reject is EarlyReject.OFF
        or slo.ttft_s <= 0.0
        or not best.costs_known
        or params.ttft(best.ttft_s) * params.ttft_margin <= slo.ttft_s
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


def _decode_score(
    request: PlacementRequest, params: ConductorParams, slo: Slo, n: _Node, join_in_s: float
) -> DecodeScore:
    load = n.load
    # Its gossiped batch (handoffs waiting for KV included), and with what
    # this entry placed there since.
    gossiped = max(load.pending_decode, load.running_decode_batch)
    batch_now = gossiped + n.pending.decodes
    ctx_now = load.decode_context_tokens
    expected = request.expected_output_tokens or request.max_tokens / 2
    known = n.costs.known
    if params.early_reject is not EarlyReject.CURRENT:
        # Averaged over the request's own run, from when its prefill is to
        # end: what it shares its steps with, which is what its TBT is.
        b0, c0 = n.forecast.at(join_in_s, gossiped, ctx_now)
        run_s = (
            expected * n.costs.step.decode_step_s(max(1, math.ceil(b0) + 1), round(c0))
            if known
            else 0.0
        )
        batch, ctx = n.forecast.mean_over(join_in_s, run_s, gossiped, ctx_now)
    else:
        # The batch decoding now and its context (the handoffs' share taken
        # out): the node's load at the request's arrival, Mooncake's
        # baseline. Blind to what the prefills under way will hand over, it
        # admits more than the decode side can then serve within the SLO.
        batch = float(load.running_decode_batch)
        ctx = ctx_now * batch / gossiped if gossiped > 0 else 0.0
    batch += n.pending.decodes
    tbt = (
        predicted_tbt_s(
            n.costs,
            batch + 1,
            ctx + request.num_prompt_tokens + expected / 2,
            queued_prefill_tokens=load.queued_prefill_tokens if n.cand.role == "both" else 0,
        )
        if known
        else 0.0
    )
    room = n.costs.max_batch <= 0 or batch + 1 <= n.costs.max_batch
    within = room and (
        not known or slo.tbt_s <= 0.0 or params.tbt(tbt) * params.tbt_margin <= slo.tbt_s
    )
    return DecodeScore(n.cand.node_id, batch_now, round(batch, 3), tbt, within, known)


def _order_decode(
    params: ConductorParams,
    pool: list[_Node],
    scores: list[DecodeScore],
    rng: random.Random | None,
) -> list[int]:
    idx = list(range(len(pool)))
    if params.policy is Policy.RANDOM:
        (rng or random.Random()).shuffle(idx)
        return sorted(idx, key=lambda i: pool[i].suspect)
    if params.policy is Policy.CONDUCTOR:
        return sorted(
            idx,
            key=lambda i: (
                pool[i].suspect,
                scores[i].tbt_s,
                scores[i].batch_now,
                pool[i].load.kv_usage,
                pool[i].cand.node_id,
            ),
        )
    return sorted(
        idx,
        key=lambda i: (
            pool[i].suspect,
            scores[i].batch_now,
            pool[i].load.kv_usage,
            pool[i].cand.node_id,
        ),
    )


def _tbt_forecast(params: ConductorParams, scores: Sequence[DecodeScore]) -> str:
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


def _tbt_retry_after(scores: Sequence[DecodeScore]) -> float:
    # The forecast's horizons are the times at which the batch is known to
    # shrink; without finer knowledge a second is a fair first retry.
    return 1.0 if scores else 5.0


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
    return f"{p}; decode on {d.node_id}: predicted TBT {d.tbt_s * 1e3:.1f} ms at batch {d.batch_at_join:g}"


class PendingLedger:
    """What this entry node placed that gossip does not reflect yet.

    Each placement counts against its nodes until their gossiped state is
    newer than it was at placement and ``min_age_s`` has passed (the node
    has had time to take the request in and publish it), or ``max_age_s``
    at most. Without it a burst entering one node piles onto whichever
    node looked idlest at its start.
    """

    def __init__(self, *, min_age_s: float = 0.3, max_age_s: float = 3.0) -> None:
        self._min_age_s = min_age_s
        self._max_age_s = max_age_s
        # (placed at, node id, state version then, load)
        self._entries: list[tuple[float, str, int, PendingLoad]] = []

    def add(self, view: ClusterView, node_id: str, load: PendingLoad, now: float) -> None:
        m = view.members.get(node_id)
        version = m.state.version if m is not None and m.state is not None else 0
        self._entries.append((now, node_id, version, load))

    def pending(self, view: ClusterView, now: float) -> dict[str, PendingLoad]:
        kept: list[tuple[float, str, int, PendingLoad]] = []
        out: dict[str, PendingLoad] = {}
        for entry in self._entries:
            at, node_id, version, load = entry
            age = now - at
            m = view.members.get(node_id)
            seen = m is not None and m.state is not None and m.state.version > version
            if age >= self._max_age_s or (seen and age >= self._min_age_s):
                continue
            kept.append(entry)
            p = out.get(node_id, PendingLoad())
            out[node_id] = PendingLoad(
                p.prefill_s + load.prefill_s,
                p.prefill_tokens + load.prefill_tokens,
                p.decodes + load.decodes,
            )
        self._entries = kept
        return out

    def __len__(self) -> int:
        return len(self._entries)
