from __future__ import annotations

import asyncio

from mooncaked.tasks import JobQueue, TaskSet


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


class _Recorder(JobQueue[int]):
    def __init__(self, max_queued: int) -> None:
        super().__init__(max_queued, "test.job_failed")
        self.handled: list[int] = []

    async def handle(self, job: int) -> None:
        if job < 0:
            raise ValueError("a failed job")
        self.handled.append(job)


async def test_job_queue_refuses_when_full_and_serves_past_a_failure() -> None:
    jobs = _Recorder(3)
    assert [jobs.offer(j) for j in (1, -1, 2, 3)] == [True, True, True, False]
    worker = asyncio.create_task(jobs.serve())
    await jobs.join()
    assert jobs.handled == [1, 2]
    await jobs.stop_one()
    await worker
    assert worker.result() is None


async def test_job_queue_take_all_leaves_nothing_to_serve() -> None:
    jobs = _Recorder(4)
    for j in (5, 6):
        jobs.offer(j)
    assert jobs.take_all() == [5, 6]
    await jobs.join()  # every taken job counts as done
    assert jobs.handled == []
