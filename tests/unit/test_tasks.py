from __future__ import annotations

import asyncio

from mooncaked.tasks import TaskSet


async def test_failures_reach_the_owner_and_wait_covers_every_task() -> None:
    failures: list[BaseException] = []
    tasks = TaskSet("test", on_failure=failures.append)
    done: list[int] = []
    gate = asyncio.Event()

    async def ok(i: int) -> None:
        await gate.wait()
        done.append(i)

    async def boom() -> None:
        raise ValueError("boom")

    tasks.spawn(ok(1))
    tasks.spawn(boom())
    tasks.spawn(ok(2))
    for _ in range(3):  # the task runs, then its done callback
        await asyncio.sleep(0)
    assert len(tasks) == 2 and [type(e) for e in failures] == [ValueError]
    gate.set()
    await tasks.wait()
    assert sorted(done) == [1, 2] and len(tasks) == 0


async def test_cancel_ends_tasks_without_counting_a_failure() -> None:
    failures: list[BaseException] = []
    tasks = TaskSet("test", on_failure=failures.append)
    never = asyncio.Event()
    tasks.spawn(never.wait())
    tasks.cancel()
    await tasks.wait()
    assert len(tasks) == 0 and failures == []
