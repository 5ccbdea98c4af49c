"""Owned background tasks: every task has an owner that keeps it, logs its failure
and awaits it on close (a bare ``create_task`` can be garbage-collected mid-run
and its exception lost)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import structlog

log = structlog.get_logger(__name__)


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
