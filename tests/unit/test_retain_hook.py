"""The store connector's retain hook: a finished request that asks to keep its
prompt is handed over once the offloads of its prompt's blocks landed,
exactly once, with the prompt's full blocks and who else holds them."""

from __future__ import annotations

import asyncio
from typing import Any

from mooncaked.engine.connector import ConnectorContext
from mooncaked.engine.kv_pool import BlockPool
from mooncaked.engine.store_connector import RetainJob, TieredStoreConnector
from mooncaked.handoff import Handoff, KVGrant, KVLayout, Retain
from mooncaked.request import Request, SamplingParams

BS = 4


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


class FakeStore:
    """Offloads that land when the test says so."""

    def __init__(self) -> None:
        self.offloads: list[tuple[list[bytes], asyncio.Future[int]]] = []

    def offload(self, hashes: list[bytes], src: Any) -> asyncio.Future[int]:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.offloads.append((list(hashes), fut))
        return fut


class Jobs(list[RetainJob]):
    """The hook: records each job and says one came."""

    def __init__(self) -> None:
        super().__init__()
        self.came = asyncio.Event()

    def __call__(self, job: RetainJob) -> None:
        self.append(job)
        self.came.set()


def connector() -> tuple[TieredStoreConnector, FakeStore, BlockPool, Jobs]:
    store, jobs = FakeStore(), Jobs()
    conn = TieredStoreConnector(store, retain=jobs)  # type: ignore[arg-type]
    pool = BlockPool(16)
    conn.bind(ConnectorContext(pool=pool, kv_caches=[], block_size=BS, wakeup=lambda: None))
    return conn, store, pool, jobs


def cache(pool: BlockPool, hashes: list[bytes]) -> None:
    """Blocks computed and cached this step (the pool tells its listeners)."""
    ids = pool.allocate(len(hashes))
    assert ids is not None
    for b, hh in zip(ids, hashes, strict=True):
        pool.cache_block(b, hh)
    pool.free(ids)


def finished(handoff: Handoff, prefill_node: str | None = None) -> Request:
    req = Request("r1", list(range(10)), SamplingParams(), handoff=handoff)
    req.block_hashes = [h(0), h(1)]  # 10 tokens: two full blocks
    req.prefill_node = prefill_node
    return req


async def test_the_job_waits_for_the_step_s_offloads_then_goes_once() -> None:
    conn, store, pool, jobs = connector()
    cache(pool, [h(0), h(1)])
    # The scheduler finishes the request before the step's after_step.
    conn.request_finished(finished(Handoff(retain=Retain(60.0, 2))))
    assert jobs == [] and store.offloads == []
    conn.after_step(None)
    ((offloaded, fut),) = store.offloads
    assert offloaded == [h(0), h(1)] and jobs == []
    fut.set_result(2)
    await asyncio.wait_for(jobs.came.wait(), 5.0)
    assert jobs == [RetainJob("r1", (h(0), h(1)), Retain(60.0, 2), None, None)]
    conn.after_step(None)
    assert len(jobs) == 1 and conn.num_retained == 1
    await conn.close()


async def test_blocks_offloaded_before_go_at_once_with_the_handoff_s_nodes() -> None:
    conn, _, _, jobs = connector()
    layout = KVLayout(1, 16, BS, 8)
    grant = KVGrant("r1", "decode-1", "127.0.0.1:1", "kv", layout, 0, (0, 1), 5.0)
    conn.request_finished(finished(Handoff(sink=grant, retain=Retain(30.0)), "prefill-1"))
    assert jobs == [RetainJob("r1", (h(0), h(1)), Retain(30.0, 1), "prefill-1", "decode-1")]
    # A request that asks nothing is not kept.
    conn.request_finished(finished(Handoff()))
    assert len(jobs) == 1
    await conn.close()
