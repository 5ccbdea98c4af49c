"""Owned background tasks: every task has an owner that keeps it, logs its failure
and awaits it on close (a bare ``create_task`` can be garbage-collected mid-run
and its exception lost)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Generic, TypeVar

import structlog

log = structlog.get_logger(__name__)

_J = TypeVar("_J")


class TaskSet:
    __slots__ = ("_on_failure", "_tasks", "name")

    def __init__(
        self, name: str, on_failure: Callable[[BaseException], None] | None = None
    ) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        # Called with the exception of a task that failed (after it is logged).
        self._on_failure = on_failure

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        log.error("task failed", owner=self.name, task=task.get_name(), exc_info=exc)
        if self._on_failure is not None:
            self._on_failure(exc)

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def wait(self) -> None:
        """Until every task spawned so far has ended (failures were logged already)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class JobQueue(Generic[_J]):
    """A bounded queue of jobs and the loop its worker tasks run.

    ``offer`` never waits: a full queue refuses the job and the caller counts
    the drop. A worker ends at the stop ``stop_one`` queues behind every job
    before it; a failed job is logged (as ``event``) and the worker goes on
    (``join`` counts every job, failed or not). Subclasses say how a job is
    handled.
    """

    def __init__(self, max_queued: int, event: str) -> None:
        self._q: asyncio.Queue[_J | None] = asyncio.Queue(max_queued)
        self._event = event

    async def handle(self, job: _J) -> None:
        raise NotImplementedError

    def offer(self, job: _J) -> bool:
        try:
            self._q.put_nowait(job)
        except asyncio.QueueFull:
            return False
        return True

    async def serve(self) -> None:
        """A worker task's loop: handle each job until a stop arrives."""
        queue = self._q
        while True:
            job = await queue.get()
            try:
                if job is None:
                    return
                await self.handle(job)
            except Exception as exc:
                log.error(self._event, error=repr(exc), exc_info=exc)
            finally:
                queue.task_done()

    async def stop_one(self) -> None:
        """Queue the end of one worker, behind every job queued so far."""
        await self._q.put(None)

    async def join(self) -> None:
        """Until every job queued so far is done (or failed)."""
        await self._q.join()

    def take_all(self) -> list[_J]:
        """Take every queued job off the queue, unhandled."""
        jobs: list[_J] = []
        while not self._q.empty():
            job = self._q.get_nowait()
            self._q.task_done()
            if job is not None:
                jobs.append(job)
        return jobs
