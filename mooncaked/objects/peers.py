"""The fetcher's side of the swarm call (``messages.SwarmCall``), signed for
the node it goes to, as every node-to-node call is (``wire.calls``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from mooncaked.objects.messages import SwarmAnswer, SwarmCall
from mooncaked.rpc import Target, derive_key
from mooncaked.wire.calls import CallFailed, SignedCalls
from mooncaked.wire.paths import OBJECTS_SWARM_PATH


class SwarmError(Exception):
    """A swarm call that got no usable answer (unreachable, refused, malformed)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        # The peer's HTTP status (0: no answer): 404, it knows no such object.
        self.status = status


class SwarmCaller(Protocol):
    """What a fetch calls origins with (``SwarmClient``, or a test's stand-in)."""

    async def call(self, peer: str, body: SwarmCall, timeout_s: float) -> SwarmAnswer: ...


class SwarmClient:
    """The fetcher's side of the swarm call (a ``SwarmCaller``), signed as
    ``wire.calls.SignedCalls`` signs it."""

    def __init__(
        self,
        *,
        secret: bytes,
        targets: Callable[[str], Target | None] = lambda url: None,
    ) -> None:
        self._calls = SignedCalls(derive_key(secret), targets=targets, limit_per_host=8)

    async def __aenter__(self) -> SwarmClient:
        await self._calls.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._calls.close()

    async def call(self, peer: str, body: SwarmCall, timeout_s: float) -> SwarmAnswer:
        """``body`` to the node at ``peer`` (an http:// base URL)."""
        try:
            data = await self._calls.post(peer, OBJECTS_SWARM_PATH, body.encode(), timeout_s)
        except CallFailed as exc:
            raise SwarmError(str(exc), exc.status) from None
        try:
            return SwarmAnswer.decode(data)
        except ValueError as exc:
            raise SwarmError(f"{peer}: malformed swarm answer ({exc})") from None
