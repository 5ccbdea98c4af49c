"""A simulation's requests -> the summary, ``mooncakectl bench``'s own
(``metrics.summarize``) with what only a simulation knows added.

- TTFT: arrival -> first token (the end of the prompt's prefill);
- TBT: per request, as ``mooncaked.cluster.slo`` defines it (the mean of
  its slowest tenth of token gaps); statistics are over requests;
- SLO attainment: requests meeting both SLOs over every request, rejected
  ones included; goodput: those per second of the run;
- late failures: requests admitted that missed an SLO; false rejections:
  requests rejected that met both SLOs in the same run without rejection
  (same seed and options: ``false_rejections``), what admission should
  not have rejected;
- cache hit rates: prompt tokens served from the prefill node's own cache
  (local), and from anywhere in the cluster, fetched blocks included (global);
- TTFT by prompt length (``PROMPT_BUCKETS``): where pipelined prefill
  groups (``--cpp``) should differ from single nodes, long prompts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from mooncakectl.bench.metrics import RequestRecord, summarize
from mooncakectl.simulate.cluster import SimResult
from mooncakectl.simulate.node import SimRequest
from mooncaked.cluster.slo import Slo

RESULT_FORMAT = "mooncakectl-simulate/1"
PERCENTILES = (50.0, 90.0, 99.0)
# Of the summary's statistics of a latency, those a simulation's reports.
_STATS = ("mean", "p50", "p90", "p99")
# Prompt lengths (tokens, as simulated) the TTFT is reported by: each
# bucket up to (not including) its bound.
PROMPT_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<1k", 1024),
    ("1k-4k", 4096),
    ("4k-16k", 16384),
    ("16k-64k", 65536),
    (">=64k", float("inf")),
)


@dataclass(slots=True)
class SimRecord(RequestRecord):
    """A simulated request as the bench records one (times in simulated
    seconds): its first token and its TBT come computed, with no chunk times
    behind them; one placed but never finished is an error."""

    first_token_s: float | None = None
    sim_tbt_s: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def tbt(self) -> float | None:
        return self.sim_tbt_s


def sim_record(r: SimRequest) -> SimRecord:
    if r.reject_code is not None:
        error = "rejected"
    else:
        error = None if r.done_s is not None else "unfinished"
    return SimRecord(
        index=r.index,
        start_s=r.arrival_s,
        end_s=r.done_s,
        error_kind=error,
        prompt_tokens=r.num_prompt_tokens,
        output_tokens=r.num_output_tokens,
        cached_tokens=r.local_cached_tokens + r.fetched_tokens,
        prefill_node=r.prefill_node,
        decode_node=r.decode_node,
        entry=r.entry,
        first_token_s=r.first_token_s,
        sim_tbt_s=r.tbt_s,
    )


def slo_ms(slo: Slo) -> dict[str, float]:
    """``slo`` as the bench's ``--goodput`` targets (0: none)."""
    return {"ttft": slo.ttft_s * 1000.0, "tbt": slo.tbt_s * 1000.0}


def meets_slo(r: SimRequest, slo: Slo) -> bool:
    """``slo.Slo.met`` for a simulated request: finished, within both targets."""
    return r.done_s is not None and slo.met(r.ttft_s, r.tbt_s)


@dataclass(slots=True)
class SimSummary:
    cluster: str
    policy: str
    early_reject: str
    speed: float
    num_requests: int
    completed: int
    rejected: int
    rejections: dict[str, int]
    duration_s: float
    request_throughput: float
    output_throughput: float
    slo_ttft_s: float
    slo_tbt_s: float
    slo_attainment: float
    # Of the requests admitted, the share that met both SLOs (what early
    # rejection promises; 0 with none admitted).
    admitted_slo_attainment: float
    # Admitted requests that missed an SLO.
    late_failures: int
    goodput: float
    # ms: mean, p50, p90, p99
    ttft_ms: dict[str, float | None]
    tbt_ms: dict[str, float | None]
    local_hit_rate: float
    global_hit_rate: float
    fetched_tokens: int
    bytes_moved: dict[str, float]
    prefill_busy: float
    decode_busy: float
    sim_events: int
    sim_wall_s: float
    # Rejected requests that met both SLOs in the run without rejection
    # (None: not measured, or nothing is rejected in this run's mode).
    false_rejections: int | None = None
    # TTFT by prompt length (``ttft_by_prompt``).
    ttft_by_prompt: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def sim_summary(result: SimResult) -> SimSummary:
    """The bench's summary of ``result``'s requests, and the simulation's own figures."""
    cfg = result.config
    reqs = result.requests
    done = [r for r in reqs if r.done_s is not None]
    placed = [r for r in reqs if r.reject_code is None]
    rejections = Counter(r.reject_code for r in reqs if r.reject_code is not None)
    start = min((r.arrival_s for r in reqs), default=0.0)
    end = max((r.done_s for r in done if r.done_s is not None), default=start)
    duration = max(end - start, 1e-9)
    s = summarize(
        [sim_record(r) for r in reqs],
        duration,
        goodput_slo_ms=slo_ms(cfg.slo),
        percentiles=PERCENTILES,
        metrics=("ttft", "tbt"),
    )
    prompt = sum(r.num_prompt_tokens for r in placed) or 1
    local = sum(r.local_cached_tokens for r in placed)
    fetched = sum(r.fetched_tokens for r in placed)

    def busy(roles: tuple[str, ...]) -> float:
        nodes = [n for n in result.nodes if n.role in roles]
        if not nodes:
            return 0.0
        return sum(n.busy_s for n in nodes) / (len(nodes) * duration)

    return SimSummary(
        cluster=cfg.shape.label(),
        policy=cfg.params.policy.value,
        early_reject=cfg.params.early_reject.value,
        speed=cfg.speed,
        num_requests=s.num_requests,
        completed=s.completed,
        rejected=s.rejected,
        rejections=dict(sorted(rejections.items())),
        duration_s=duration,
        request_throughput=s.request_throughput,
        output_throughput=s.output_throughput,
        slo_ttft_s=cfg.slo.ttft_s,
        slo_tbt_s=cfg.slo.tbt_s,
        slo_attainment=s.slo_attainment or 0.0,
        admitted_slo_attainment=s.admitted_slo_attainment or 0.0,
        late_failures=s.late_failures or 0,
        goodput=s.request_goodput or 0.0,
        ttft_ms={k: s.latency_ms["ttft"][k] for k in _STATS},
        tbt_ms={k: s.latency_ms["tbt"][k] for k in _STATS},
        local_hit_rate=local / prompt,
        global_hit_rate=(local + fetched) / prompt,
        fetched_tokens=fetched,
        bytes_moved=dict(sorted(result.bytes_moved.items())),
        prefill_busy=busy(("prefill", "both")),
        decode_busy=busy(("decode",)),
        sim_events=result.num_events,
        sim_wall_s=result.wall_s,
        ttft_by_prompt=ttft_by_prompt(reqs),
    )


def ttft_by_prompt(requests: Sequence[SimRequest]) -> list[dict[str, Any]]:
    """Per prompt-length bucket (``PROMPT_BUCKETS``): its requests, those
    with a first token, and their TTFT's mean and p90 in ms (None: none)."""
    ttfts: list[list[float]] = [[] for _ in PROMPT_BUCKETS]
    counts = [0] * len(PROMPT_BUCKETS)
    for r in requests:
        i = next(i for i, (_, bound) in enumerate(PROMPT_BUCKETS) if r.num_prompt_tokens < bound)
        counts[i] += 1
        if r.ttft_s is not None:
            ttfts[i].append(r.ttft_s * 1000.0)
    out = []
    for (name, _), n, values in zip(PROMPT_BUCKETS, counts, ttfts, strict=True):
        a = np.asarray(values, dtype=np.float64)
        out.append(
            {
                "bucket": name,
                "requests": n,
                "served": len(values),
                "mean_ms": float(a.mean()) if values else None,
                "p90_ms": float(np.percentile(a, 90.0)) if values else None,
            }
        )
    return out


def false_rejections(run: SimResult, reference: SimResult) -> int:
    """Requests ``run`` rejected that met both SLOs in ``reference``: the same
    requests (by index) and SLOs, run without rejection."""
    slo = run.config.slo
    met = {r.index for r in reference.requests if meets_slo(r, slo)}
    return sum(1 for r in run.requests if r.reject_code is not None and r.index in met)


def request_json(r: SimRequest) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": r.index,
        "arrival_s": r.arrival_s,
        "prompt_tokens": r.num_prompt_tokens,
        "output_tokens": r.num_output_tokens,
        "entry": r.entry,
        "prefill_node": r.prefill_node,
        "decode_node": r.decode_node,
        "rejected": r.reject_code,
        "local_cached_tokens": r.local_cached_tokens,
        "fetched_tokens": r.fetched_tokens,
        "predicted_ttft_s": r.predicted_ttft_s,
        "ttft_s": r.ttft_s,
        "tbt_s": r.tbt_s,
        "done_s": r.done_s,
    }
    if r.stages:
        out["stages"] = list(r.stages)
    return out


def result_json(
    config: dict[str, Any], summaries: Sequence[SimSummary], results: Sequence[SimResult]
) -> dict[str, Any]:
    return {
        "format": RESULT_FORMAT,
        "config": config,
        "runs": [
            {"summary": s.to_json(), "requests": [request_json(r) for r in res.requests]}
            for s, res in zip(summaries, results, strict=True)
        ],
    }
