"""Per-request records and the summary, named and computed as ``vllm bench serve`` does.

- TTFT: send -> first chunk carrying output text;
- TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one token;
- ITL: every gap between consecutive output chunks, pooled over requests;
- E2EL: send -> last byte of the response;
- TBT (not vLLM's): per request, ``mooncaked.cluster.slo``'s: the mean of its
  slowest tenth of gaps between output chunks, what the server's SLO judges;
- throughputs over the run's duration (first send -> last request done);
- goodput: completed requests per second that meet every ``--goodput`` SLO
  (``ttft`` and ``tbt`` judged by ``slo.Slo.met``, ``tpot`` and ``e2el`` as vLLM does).

What vLLM's bench lacks, added here: rejected requests (HTTP 429) apart from
errors by kind, the SLO attainment over every request sent and over those
admitted, late failures (admitted requests that missed an SLO or failed),
the share of prompt tokens the server served from its cache, the nodes that
ran each phase when the server says so, and the entry each request was sent to.

``summarize`` is the one summary of a run: of ``bench``'s requests, of the
cluster benchmarks' (``bench policies``, ``simulate --against-cluster``)
and of the simulator's (``simulate.results``, whose requests are records too).

Statistics of an empty sample are None (vLLM reports 0, which reads as a
perfect latency when nothing completed).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from mooncakectl.flags import number_list
from mooncaked.cluster.slo import Slo, tbt_s

METRICS = ("ttft", "tpot", "itl", "e2el", "tbt")
METRIC_NAMES = {
    "ttft": "Time to first token",
    "tpot": "Time per output token (excl. 1st)",
    "itl": "Inter-token latency",
    "e2el": "End-to-end latency",
    "tbt": "Time between tokens (slowest 10%)",
}
GOODPUT_KEYS = ("ttft", "tpot", "e2el", "tbt")
REJECTED = "rejected"


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds on the run's clock
    (0 = the run's start), so records of one run compare directly."""

    index: int
    group: str = ""
    warmup: bool = False
    prompt_len: int = 0
    output_len: int = 0
    clipped: bool = False
    start_s: float = 0.0
    end_s: float | None = None
    # When each chunk with output text arrived; the first is the TTFT.
    chunk_s: list[float] = field(default_factory=list)
    status: int | None = None
    # None on success; "rejected" (429), "http_<status>", "timeout", "connection", "stream".
    error_kind: str | None = None
    error: str | None = None
    # The error's ``code`` where the server gives one.
    error_code: str | None = None
    retry_after_s: float | None = None
    # From the server's usage report, when it sends one.
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    prefill_node: str | None = None
    decode_node: str | None = None
    # The base URL it was sent to (one of ``--entries``).
    entry: str | None = None
    # The server's own forecasts for the request (mooncaked's Conductor), ms.
    predicted_ttft_ms: float | None = None
    predicted_tbt_ms: float | None = None
    # ... and the cost model's before the entry node calibrated them.
    model_ttft_ms: float | None = None
    model_tbt_ms: float | None = None
    # The output text, where the sender kept it (``Endpoint.keep_text``).
    text: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None and self.end_s is not None

    @property
    def num_output_tokens(self) -> int:
        # vLLM counts the usage report's tokens; without one, the chunks.
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_s)

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len

    @property
    def ttft(self) -> float | None:
        return self.chunk_s[0] - self.start_s if self.chunk_s else None

    @property
    def e2el(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s

    @property
    def tpot(self) -> float | None:
        ttft, e2el, n = self.ttft, self.e2el, self.num_output_tokens
        if ttft is None or e2el is None or n <= 1:
            return None
        return (e2el - ttft) / (n - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_s)]

    @property
    def tbt(self) -> float | None:
        """The request's TBT as ``slo.tbt_s`` defines it, over its gaps between
        chunks: each streamed chunk counts as one token (a server that sends
        several tokens in a chunk shows one longer gap). None without a gap."""
        return tbt_s(self.itls)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RequestRecord:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in obj.items() if k in names})


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tbt:50"]`` -> ``{"ttft": 500.0, "tbt": 50.0}`` (ms)."""
    out: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in GOODPUT_KEYS:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS, e2el:MS or tbt:MS, got {spec!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number of ms") from None
        if not ms > 0:
            raise ValueError(f"--goodput {spec!r}: the SLO must be > 0 ms")
        out[name] = ms
    return out


def parse_percentiles(text: str) -> list[float]:
    return number_list(
        text,
        "--metric-percentiles",
        float,
        "a number",
        lambda p: 0.0 < p <= 100.0,
        "is not in (0, 100]",
    )


def parse_metric_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in METRICS:
            raise ValueError(f"--percentile-metrics: unknown metric {n!r}; known: {list(METRICS)}")
    return names


def percentile_key(p: float) -> str:
    return f"p{int(p) if float(p).is_integer() else p}"


def meets_slo(rec: RequestRecord, slo_ms: Mapping[str, float]) -> bool:
    """Whether a completed request meets every SLO of ``slo_ms``. TTFT and TBT
    are judged by ``Slo.met``, as the server judges them (a request without
    a gap has no TBT and meets any TBT target; one without a token meets
    no TTFT or TBT target); TPOT and E2EL by vLLM's rule (a request with
    one output token has TPOT 0)."""
    if not rec.ok:
        return False
    if "ttft" in slo_ms or "tbt" in slo_ms:
        slo = Slo(slo_ms.get("ttft", 0.0) / 1000.0, slo_ms.get("tbt", 0.0) / 1000.0)
        if not slo.met(rec.ttft, rec.tbt):
            return False
    if "tpot" in slo_ms and (rec.tpot or 0.0) * 1000.0 > slo_ms["tpot"]:
        return False
    # ok: the request ended, so it has an E2EL.
    return "e2el" not in slo_ms or (rec.e2el or 0.0) * 1000.0 <= slo_ms["e2el"]


def _stats(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    if not values_s:
        return {"mean": None, "median": None, "std": None} | {
            percentile_key(p): None for p in percentiles
        }
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    out: dict[str, float | None] = {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "std": float(a.std()),
    }
    for p in percentiles:
        out[percentile_key(p)] = float(np.percentile(a, p))
    return out


@dataclass(slots=True)
class Summary:
    duration_s: float
    num_requests: int
    completed: int
    rejected: int
    failed: int
    errors: dict[str, int]
    not_sent: int
    clipped: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    slo_attainment: float | None
    # Of the requests admitted (not rejected), the share that met every SLO:
    # what early rejection promises. None without SLOs or with none admitted.
    admitted_slo_attainment: float | None
    # Admitted (not rejected) requests that missed an SLO or failed: the
    # misses early rejection meant to prevent. None without SLOs.
    late_failures: int | None
    goodput_slo_ms: dict[str, float]
    cached_tokens: int | None
    cached_share: float | None
    # metric -> {"mean"|"median"|"std"|"p99"...: ms}
    latency_ms: dict[str, dict[str, float | None]]
    # phase ("prefill", "decode") -> node -> requests; empty when no header was
    # seen; "entry" -> base URL -> requests sent there, with several entries.
    nodes: dict[str, dict[str, int]]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        # vLLM's flat names too, so tools that read its JSON read ours.
        for metric, stats in self.latency_ms.items():
            for stat, value in stats.items():
                out[f"{stat}_{metric}_ms"] = value
        return out


def run_duration_s(records: Sequence[RequestRecord]) -> float:
    """A run's span on its own clock, from the first timed request's start to
    the last one's end (0 for none): its duration, read back from its records."""
    timed = [r for r in records if not r.warmup]
    ends = [r.end_s for r in timed if r.end_s is not None]
    if not timed or not ends:
        return 0.0
    return max(ends) - min(r.start_s for r in timed)


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    not_sent: int = 0,
    goodput_slo_ms: Mapping[str, float] | None = None,
    percentiles: Sequence[float] = (90.0, 99.0),
    metrics: Sequence[str] = METRICS,
    entries: Sequence[str] = (),
) -> Summary:
    """The summary of a run's timed requests (warm-up records are skipped);
    with several ``entries``, the requests sent to each (0 for one that
    drew none)."""
    timed = [r for r in records if not r.warmup]
    done = [r for r in timed if r.ok]
    errors = Counter(r.error_kind for r in timed if r.error_kind is not None)
    rejected = errors.pop(REJECTED, 0)
    failed = sum(errors.values())
    dur = duration_s if duration_s > 0 else float("nan")

    total_in = sum(r.num_prompt_tokens for r in done)
    total_out = sum(r.num_output_tokens for r in done)
    samples: dict[str, list[float]] = {
        "ttft": [v for r in done if (v := r.ttft) is not None],
        "tpot": [v for r in done if (v := r.tpot) is not None],
        "itl": [v for r in done for v in r.itls],
        "e2el": [v for r in done if (v := r.e2el) is not None],
        "tbt": [v for r in done if (v := r.tbt) is not None],
    }
    slo = dict(goodput_slo_ms or {})
    good = sum(1 for r in done if meets_slo(r, slo)) if slo else None
    reported = [r for r in done if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reported) if reported else None
    reported_prompt = sum(r.num_prompt_tokens for r in reported)
    nodes: dict[str, dict[str, int]] = {}
    for phase in ("prefill", "decode"):
        seen = Counter(n for r in timed if (n := getattr(r, f"{phase}_node")) is not None)
        if seen:
            nodes[phase] = dict(sorted(seen.items()))
    if len(entries) > 1:
        sent = Counter(r.entry for r in timed)
        nodes["entry"] = {url: sent[url] for url in entries}
    return Summary(
        duration_s=duration_s,
        num_requests=len(timed),
        completed=len(done),
        rejected=rejected,
        failed=failed,
        errors=dict(sorted(errors.items())),
        not_sent=not_sent,
        clipped=sum(1 for r in timed if r.clipped),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) / dur,
        output_throughput=total_out / dur,
        total_token_throughput=(total_in + total_out) / dur,
        request_goodput=None if good is None else good / dur,
        slo_attainment=None if good is None or not timed else good / len(timed),
        admitted_slo_attainment=(
            None if good is None or len(timed) == rejected else good / (len(timed) - rejected)
        ),
        late_failures=None if good is None else len(done) - good + failed,
        goodput_slo_ms=slo,
        cached_tokens=cached,
        cached_share=(None if cached is None or reported_prompt == 0 else cached / reported_prompt),
        latency_ms={m: _stats(samples[m], percentiles) for m in metrics},
        nodes=nodes,
    )
