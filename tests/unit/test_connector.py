"""MultiConnector routing with recording connectors and a real scheduler: who is
asked, who loads, who sees each save; exact orders."""

from __future__ import annotations

from typing import Any

import pytest

from mooncaked.config import SchedulerConfig
from mooncaked.engine.connector import NO_HIT, KVConnector, KVHit, LoadResult, MultiConnector
from mooncaked.engine.kv_pool import BlockPool
from mooncaked.engine.plan import LoadJob, StepPlan
from mooncaked.engine.scheduler import Scheduler
from mooncaked.request import KVSent, Request, RequestState, SamplingParams

BS = 4


class Recording(KVConnector):
    """Offers ``offer`` tokens (None: does not know yet); logs every call."""

    def __init__(self, name: str, offer: int | None, calls: list[tuple[Any, ...]]) -> None:
        self.name = name
        self.offer = offer
        self.calls = calls

    def lookup(self, req: Request, num_computed_tokens: int) -> KVHit | None:
        self.calls.append(("lookup", self.name))
        if self.offer is None:
            return None
        return KVHit(self.offer, cancellable=self.name == "remote")

    def request_admitted(self, req: Request, hit: KVHit) -> None:
        self.calls.append(("admitted", self.name, hit.num_tokens))

    async def load(self, req: Request, job: LoadJob) -> LoadResult:
        self.calls.append(("load", self.name))
        return LoadResult(job.num_tokens)

    def build_meta(self, plan: StepPlan) -> Any:
        return None if self.name == "idle" else f"{self.name}-meta"

    def save_layer(self, layer: int, meta: Any) -> None:
        self.calls.append(("save", self.name, layer, meta))

    def wait_for_save(self, meta: Any) -> Any:
        self.calls.append(("wait", self.name, meta))
        return f"{self.name}-report"

    def after_step(self, report: Any) -> None:
        self.calls.append(("after", self.name, report))


def scheduler(connector: KVConnector) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_waiting=16),
        BlockPool(32),
        block_size=BS,
        max_model_len=256,
        model_id="test",
        connector=connector,
    )


async def test_the_first_connector_that_offers_tokens_serves_the_load() -> None:
    calls: list[tuple[Any, ...]] = []
    multi = MultiConnector(
        [Recording("none", 0, calls), Recording("remote", 8, calls), Recording("last", 12, calls)]
    )
    s = scheduler(multi)
    r = Request("r", list(range(14)), SamplingParams())
    s.add_request(r)
    job = s.schedule().loads[0]
    # The lookup stopped at the one that offered; the job names it.
    assert (job.source, job.num_tokens, job.cancellable) == (1, 8, True)
    assert calls == [
        ("lookup", "none"),
        ("lookup", "remote"),
        ("admitted", "none", 0),
        ("admitted", "remote", 8),
    ]
    calls.clear()
    result = await multi.load(r, job)
    assert calls == [("load", "remote")] and result.num_tokens == 8
    s.finish_load(r, result)
    assert r.state is RequestState.RUNNING and r.num_computed_tokens == 8
    s.pool.check_integrity(s.block_tables())


def test_a_connector_that_does_not_know_yet_keeps_the_request_waiting() -> None:
    calls: list[tuple[Any, ...]] = []
    first = Recording("prefetching", None, calls)
    multi = MultiConnector([first, Recording("store", 0, calls)])
    s = scheduler(multi)
    r = Request("r", list(range(10)), SamplingParams())
    s.add_request(r)
    for _ in range(2):
        plan = s.schedule()
        assert plan.is_empty and not plan.loads and r.state is RequestState.WAITING
    # Asked on every pass, and nothing moved: lookups have no effect.
    assert calls == [("lookup", "prefetching")] * 2
    calls.clear()
    first.offer = 0
    plan = s.schedule()
    assert [c.request_id for c in plan.chunks] == ["r"] and not plan.loads
    # Nobody offered: each was asked, each hears of the admission once.
    assert calls == [
        ("lookup", "prefetching"),
        ("lookup", "store"),
        ("admitted", "prefetching", 0),
        ("admitted", "store", 0),
    ]
    assert multi.lookup(r, 0) == NO_HIT


def test_every_connector_sees_every_save_and_its_own_report() -> None:
    calls: list[tuple[Any, ...]] = []
    multi = MultiConnector(
        [Recording("a", 0, calls), Recording("idle", 0, calls), Recording("b", 0, calls)]
    )
    meta = multi.build_meta(StepPlan())
    assert meta == ("a-meta", None, "b-meta")
    for layer in range(2):
        multi.save_layer(layer, meta)
    report = multi.wait_for_save(meta)
    assert report == ("a-report", None, "b-report")
    multi.after_step(report)
    assert calls == [
        ("save", "a", 0, "a-meta"),
        ("save", "b", 0, "b-meta"),
        ("save", "a", 1, "a-meta"),
        ("save", "b", 1, "b-meta"),
        ("wait", "a", "a-meta"),
        ("wait", "b", "b-meta"),
        ("after", "a", "a-report"),
        ("after", "idle", None),
        ("after", "b", "b-report"),
    ]
    calls.clear()
    # A step none had work in: each still hears it ended (offloads start then).
    multi.after_step(None)
    assert calls == [("after", "a", None), ("after", "idle", None), ("after", "b", None)]


class Lifecycle(Recording):
    """Also logs a request's life and its close; reports ``sent`` for every
    request and ``saves`` saves."""

    def __init__(
        self, name: str, calls: list[tuple[Any, ...]], sent: KVSent | None = None, saves: int = 0
    ) -> None:
        super().__init__(name, 0, calls)
        self.sent = sent
        self.saves = saves

    def request_added(self, req: Request) -> None:
        self.calls.append(("added", self.name))

    def kv_sent(self, req: Request) -> KVSent | None:
        self.calls.append(("kv_sent", self.name))
        return self.sent

    def request_finished(self, req: Request) -> None:
        self.calls.append(("finished", self.name))

    def num_saves(self) -> int:
        return self.saves

    async def close(self) -> None:
        self.calls.append(("close", self.name))


async def test_a_request_s_life_reaches_every_connector_and_close_runs_in_reverse() -> None:
    calls: list[tuple[Any, ...]] = []
    multi = MultiConnector(
        [
            Lifecycle("store", calls, saves=2),
            Lifecycle("sender", calls, sent=KVSent(64), saves=3),
            Lifecycle("last", calls, sent=KVSent(1, "never asked")),
        ]
    )
    r = Request("r", list(range(6)), SamplingParams())
    multi.request_added(r)
    # The first connector with an outcome gives it; those after are not asked.
    assert multi.kv_sent(r) == KVSent(64)
    multi.request_finished(r)
    await multi.close()
    assert calls == [
        ("added", "store"),
        ("added", "sender"),
        ("added", "last"),
        ("kv_sent", "store"),
        ("kv_sent", "sender"),
        ("finished", "store"),
        ("finished", "sender"),
        ("finished", "last"),
        ("close", "last"),
        ("close", "sender"),
        ("close", "store"),
    ]
    assert multi.num_saves() == 5


async def test_a_load_naming_no_connector_is_a_broken_invariant() -> None:
    calls: list[tuple[Any, ...]] = []
    multi = MultiConnector([Recording("a", 4, calls), Recording("b", 4, calls)])
    r = Request("r", list(range(6)), SamplingParams())
    for source in (-1, 2):
        with pytest.raises(RuntimeError, match=f"^load r names connector {source}$"):
            await multi.load(r, LoadJob("r", 0, [0, 1], 4, source=source))
    assert calls == []
