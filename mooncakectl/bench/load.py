"""When and where to send: the arrival schedule, the driver that keeps to
it, and which entry (base URL) each request goes to.

Arrivals come from the trace's timestamps, or from a Poisson process whose
gaps are gamma distributed (vLLM's ``--burstiness``: 1 is Poisson, below 1
burstier, above 1 more regular; an infinite rate sends everything at once).
``max_concurrency`` caps requests in flight in either mode; an infinite
rate with a cap is a fixed-concurrency run. Warm-up requests go first and
are recorded but left out of the metrics; a time limit stops sending.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from mooncakectl.bench.metrics import RequestRecord
from mooncakectl.bench.workloads import BenchRequest
from mooncaked.tasks import TaskSet

SendFn = Callable[[BenchRequest, RequestRecord, Callable[[], float]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class LoadPlan:
    # Requests per second; math.inf sends them all at once.
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    # Arrivals from the requests' own ``arrival_s`` (a trace).
    trace_times: bool = False
    # Stop sending this many seconds after the first timed request.
    duration_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0, got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"--burstiness must be a finite number > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration_s}")

    @property
    def mode(self) -> str:
        if self.trace_times:
            return "trace"
        if math.isfinite(self.request_rate):
            return "poisson"
        return "concurrency" if self.max_concurrency is not None else "burst"


def arrival_times(requests: Sequence[BenchRequest], plan: LoadPlan) -> list[float]:
    """Seconds after the start at which each request is due, non-decreasing."""
    n = len(requests)
    if plan.trace_times:
        times = []
        for r in requests:
            if r.arrival_s is None:
                raise ValueError("trace arrival times asked for requests that have none")
            times.append(r.arrival_s)
        return times
    if not math.isfinite(plan.request_rate) or n == 0:
        return [0.0] * n
    # Gamma gaps with mean 1/rate; shape = burstiness (shape 1 is exponential: Poisson).
    rng = np.random.default_rng([plan.seed, 7])
    theta = 1.0 / (plan.request_rate * plan.burstiness)
    gaps = rng.gamma(shape=plan.burstiness, scale=theta, size=n)
    # The first request goes at once, as in vLLM: the gaps come after each request.
    return [0.0, *np.cumsum(gaps[:-1]).tolist()]


def pick_entries(
    requests: Sequence[BenchRequest], entries: Sequence[str], seed: int
) -> dict[int, str]:
    """Each request's entry by its index, drawn uniformly from ``entries`` by
    ``random.Random(seed)`` in the order given: the same requests, entries
    and seed go to the same entries in every run, whatever the timing.
    (Give the timed requests first, so that the number of warm-ups does not
    move them.)"""
    if not entries:
        raise ValueError("no entry to send requests to")
    rng = random.Random(seed)
    return {r.index: rng.choice(entries) for r in requests}


@dataclass(slots=True)
class RunResult:
    # Warm-up records first (times before 0), then one per timed request sent.
    records: list[RequestRecord]
    duration_s: float
    # Timed requests the time limit left unsent.
    not_sent: int


def _record(req: BenchRequest, warmup: bool) -> RequestRecord:
    return RequestRecord(
        index=req.index,
        group=req.group,
        warmup=warmup,
        prompt_len=len(req.prompt_ids),
        output_len=req.output_len,
        clipped=req.clipped,
    )


async def run_load(
    requests: Sequence[BenchRequest],
    plan: LoadPlan,
    send: SendFn,
    *,
    warmups: Sequence[BenchRequest] = (),
    on_done: Callable[[RequestRecord], None] | None = None,
    monotonic: Callable[[], float] = time.monotonic,
) -> RunResult:
    """Sends the warm-ups (all at once, under the concurrency cap) and waits for
    them, then the timed requests on their schedule; returns every record."""
    arrivals = arrival_times(requests, plan)
    sem = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
    origin = monotonic()

    def clock() -> float:
        return monotonic() - origin

    tasks = TaskSet("bench")
    limit = plan.duration_s
    held_back: set[int] = set()

    async def one(req: BenchRequest, rec: RequestRecord, timed: bool) -> None:
        if sem is not None:
            async with sem:
                # A request still waiting for a slot when time is up is not sent.
                if timed and limit is not None and clock() >= limit:
                    held_back.add(id(rec))
                    return
                await send(req, rec, clock)
        else:
            await send(req, rec, clock)
        if on_done is not None:
            on_done(rec)

    warm_records = [_record(r, True) for r in warmups]
    timed_records: list[RequestRecord] = []
    try:
        for req, rec in zip(warmups, warm_records, strict=True):
            tasks.spawn(one(req, rec, False), name=f"bench-warmup-{req.index}")
        await tasks.wait()
        # The timed run starts now: warm-up times become negative.
        shift = clock()
        origin += shift
        for rec in warm_records:
            rec.start_s -= shift
            rec.end_s = None if rec.end_s is None else rec.end_s - shift
            rec.chunk_s = [t - shift for t in rec.chunk_s]

        not_sent = 0
        for i, (req, due) in enumerate(zip(requests, arrivals, strict=True)):
            if limit is not None and due >= limit:
                not_sent = len(requests) - i
                break
            wait = due - clock()
            if wait > 0:
                await asyncio.sleep(wait)
            rec = _record(req, False)
            timed_records.append(rec)
            tasks.spawn(one(req, rec, True), name=f"bench-request-{req.index}")
        await tasks.wait()
        duration = clock()
    finally:
        tasks.cancel()
        await tasks.wait()
    # Requests the time limit held back in the concurrency queue were never sent.
    sent = [r for r in timed_records if id(r) not in held_back]
    return RunResult(warm_records + sent, duration, not_sent + len(held_back))
