"""Owned worker threads: started by name, exceptions logged, joined on close.

The data path runs in threads because blocking socket calls and memcpy drop
the GIL, which asyncio's per-call overhead cannot match for bulk bytes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)


class ThreadGroup:
    def __init__(self, name: str) -> None:
        self._name = name
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._threads)

    def start(self, name: str, target: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                target()
            except Exception:
                log.exception("transfer thread died", group=self._name, thread=name)
            finally:
                with self._lock:
                    self._threads.discard(thread)

        thread = threading.Thread(target=run, name=f"{self._name}:{name}", daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()
        return thread

    def join(self, timeout: float) -> list[str]:
        """Join every thread; returns the names of those still alive after timeout."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout)
        return [t.name for t in threads if t.is_alive()]

    async def join_async(self, grace_s: float) -> None:
        stuck = await asyncio.to_thread(self.join, grace_s)
        if stuck:
            log.warning("transfer threads did not stop in time", group=self._name, threads=stuck)
