"""What placement decides about and decides: the policies, the parameters, a
request as placement sees it, and the answer (a placement or a rejection).

Plain data shared by the Conductor (``conductor.decide``), the entry's
admission policy (``admission.Admission``), the router and the simulator.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

from mooncaked.cache.hashing import BlockHash
from mooncaked.cluster.fit import Calibration
from mooncaked.cluster.slo import Slo, target_each
from mooncaked.handoff import PrefillOffer, StageRef


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
    """When and on what a request is judged against the TBT SLO
    (``[conductor] early_reject``); the TTFT SLO is judged on arrival in
    every mode but ``off``."""

    # Never: every request is admitted (the decode nodes may miss the SLO).
    OFF = "off"
    # At the decode node's admission, once the prefill is done, on the batch
    # decoding then: the Mooncake paper's baseline. A request refused there
    # has cost its prefill for nothing.
    BASELINE = "baseline"
    # On arrival, on the decode nodes' load now: the batch decoding at the
    # request's arrival, not the handoffs the prefills under way will bring
    # (the paper's early rejection).
    CURRENT = "current"
    # On arrival, on the load forecast for this request's run from when its
    # prefill ends: decodes that will have finished by then no longer
    # count, the handoffs placed there do once they are expected to join,
    # and so do the arrivals the node's recent departures stand for (the
    # paper's early rejection based on prediction).
    PREDICTED = "predicted"

    @property
    def on_arrival(self) -> bool:
        """Whether the TBT SLO is judged when the request arrives."""
        return self in (EarlyReject.CURRENT, EarlyReject.PREDICTED)


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
    # Prefill nodes listed for a request, in the order to ask them: the next
    # when one fails, or (late binding) passes it on.
    max_prefill: int = 8
    # Entries that decide alone on the same gossip view spread their choices
    # (``ranking.spread``): a prefill candidate whose predicted TTFT is
    # within max(spread_min, spread x the best) of the best is as likely to
    # come first as the best; decode candidates alike by predicted TBT,
    # within decode_spread. 0: the best alone, ties by node id. The
    # defaults are the simulator's (the README's "Many entries" table).
    spread: float = 0.25
    spread_min: float = 0.0
    decode_spread: float = 0.05
    # Late binding (``engine.late_binding``): the prefill nodes' own queues,
    # not the entry's view of them, have the last word. A candidate whose
    # queue makes it slower than the entry forecast (by more than
    # ``bind_slack`` of its TTFT) and than those left to ask passes the
    # request on.
    late_binding: bool = True
    bind_slack: float = 0.5
    # A request whose own prefill is longer than the TTFT SLO is served (a
    # late failure) rather than rejected when it waits no longer than this
    # share of the SLO (``conductor.check_ttft``); 0: rejected too.
    best_effort_wait: float = 0.1
    # Seconds per prompt token assumed of a node whose costs are unknown yet
    # (a ranking aid only: it never rejects).
    nominal_token_s: float = 1e-4
    # The entry node's correction of the models' forecasts by what it
    # measured (fit.Calibration): TTFT = offset + scale x model, TBT =
    # tbt_offset + tbt_scale x model. Monotonic, so it never changes a
    # ranking; it changes what is promised and what is rejected.
    ttft_offset_s: float = 0.0
    ttft_scale: float = 1.0
    tbt_offset_s: float = 0.0
    tbt_scale: float = 1.0
    # Admission judges the corrected forecast times these: the ratio of
    # measured to forecast that the SLO's target share of recent requests
    # stayed within (fit.Calibration.margin), so that share of the
    # requests admitted meets the SLO, not half of those forecast near it.
    ttft_margin: float = 1.0
    tbt_margin: float = 1.0

    def __post_init__(self) -> None:
        for name in ("spread", "spread_min", "decode_spread", "bind_slack", "best_effort_wait"):
            v = getattr(self, name)
            if not 0.0 <= v < math.inf:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        if self.max_prefill < 1:
            raise ValueError(f"max_prefill must be >= 1, got {self.max_prefill}")

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
    # A pipelined prefill group: its stages, head first (the candidate is its
    # head); empty: one node.
    stages: tuple[StageRef, ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.api_addr}"


@dataclass(frozen=True, slots=True)
class MemoryRef:
    """The memory node a decode node's attention for one request goes to."""

    node_id: str
    # host:port of its attention service.
    attention_addr: str

    def to_json(self) -> dict[str, str]:
        return {"node": self.node_id, "attention_addr": self.attention_addr}


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request runs: its decode node, and the prefill nodes to try in
    order (empty: the decode node computes the prompt itself, in one engine)."""

    decode: Candidate
    prefill: tuple[Candidate, ...] = ()
    # Whether the (first) prefill node should pull a longer prefix from its
    # holders (False: recompute what it does not hold itself).
    fetch: bool = True
    # The same for each prefill candidate in turn: the first may hold the
    # prefix itself, and the next, which does not, is to fetch it (empty:
    # ``fetch`` for all).
    prefill_fetch: tuple[bool, ...] = ()
    # The Conductor's forecast, for the client's headers and for checking
    # predictions against what happens (0: not predicted); calibrated by
    # what the entry measured, and as the cost models alone gave them.
    predicted_ttft_s: float = 0.0
    predicted_tbt_s: float = 0.0
    model_ttft_s: float = 0.0
    model_tbt_s: float = 0.0
    # Late binding: per prefill candidate, what the entry forecast of it
    # (empty: every candidate takes the request when asked).
    offers: tuple[PrefillOffer, ...] = ()
    # Attention offloaded: the memory node paired with the decode node (None:
    # its attention runs there).
    memory: MemoryRef | None = None

    @property
    def colocated(self) -> bool:
        return not self.prefill

    def fetches(self, index: int) -> bool:
        """Whether prefill candidate ``index`` is to pull a longer prefix."""
        if index < len(self.prefill_fetch):
            return self.prefill_fetch[index]
        return self.fetch


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


@dataclass(frozen=True, slots=True)
class PendingLoad:
    """Load this entry node sent a node that its gossip state does not show yet."""

    prefill_s: float = 0.0
    prefill_tokens: int = 0
    decodes: int = 0
