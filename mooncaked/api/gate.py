"""The drain gate: admits generation requests and counts them, so a drain
can wait for the ones it let in."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from mooncaked.api.refusals import DRAINING, NotServing, refusal


class Gate:
    """Admits generation requests and counts them, so a drain can wait for them.

    ``close()`` starts a drain: new requests get 503 while those already
    admitted run on; ``wait_idle()`` returns once none is left.
    """

    def __init__(self) -> None:
        self._num_inflight = 0
        self._closed = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_inflight(self) -> int:
        return self._num_inflight

    def close(self) -> None:
        self._closed = True

    async def wait_idle(self) -> None:
        await self._idle.wait()

    @contextmanager
    def admit(self) -> Iterator[None]:
        """Counts the request in for the block; ApiError (503 ``draining``) once closed."""
        if self._closed:
            raise refusal(NotServing(DRAINING, "draining")).error
        self._num_inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._num_inflight -= 1
            if self._num_inflight == 0:
                self._idle.set()
