"""The fetcher's side of the swarm call (``messages.SwarmCall``), signed for
the node it goes to, as every node-to-node call is (``mooncaked.rpc``).

A call is signed for its peer's node id and generation: from
``targets(peer_url)`` (the cluster view) when it knows the peer, else as the
peer's ``/internal/identity`` says, remembered until the peer refuses a call
(401: restarted, or another node at that address now).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import aiohttp

from mooncaked.objects.messages import SwarmAnswer, SwarmCall
from mooncaked.rpc import Target, derive_key, signed_headers
from mooncaked.wire import fields
from mooncaked.wire.errors import ErrorAnswer
from mooncaked.wire.lease import decode_identity
from mooncaked.wire.paths import IDENTITY_PATH, OBJECTS_SWARM_PATH


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
    def __init__(
        self,
        *,
        secret: bytes,
        targets: Callable[[str], Target | None] = lambda url: None,
    ) -> None:
        self._key = derive_key(secret)
        self._targets = targets
        self._identities: dict[str, Target] = {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SwarmClient:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit_per_host=8, keepalive_timeout=15.0)
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def call(self, peer: str, body: SwarmCall, timeout_s: float) -> SwarmAnswer:
        """``body`` to the node at ``peer`` (an http:// base URL)."""
        data = await self._call(peer.rstrip("/"), OBJECTS_SWARM_PATH, body.encode(), timeout_s)
        try:
            return SwarmAnswer.decode(data)
        except ValueError as exc:
            raise SwarmError(f"{peer}: malformed swarm answer ({exc})") from None

    async def _target(self, session: aiohttp.ClientSession, base: str, timeout_s: float) -> Target:
        known = self._targets(base) or self._identities.get(base)
        if known is not None:
            return known
        data = await self._exchange(session.get, base + IDENTITY_PATH, {}, timeout_s)
        try:
            target = decode_identity(data)
        except ValueError as exc:
            raise SwarmError(f"{base}: malformed identity answer ({exc})") from None
        self._identities[base] = target
        return target

    async def _call(self, base: str, path: str, raw: bytes, timeout_s: float) -> dict[str, Any]:
        session = self._session
        if session is None:
            raise RuntimeError("the swarm client is not started")
        target = await self._target(session, base, timeout_s)
        headers = {
            "Content-Type": "application/json",
            **signed_headers(self._key, "POST", path, raw, target=target),
        }
        try:
            return await self._exchange(
                session.post, base + path, {"data": raw, "headers": headers}, timeout_s
            )
        except SwarmError as exc:
            if exc.status == 401:
                # Restarted, or another node answers there now: ask it again next time.
                self._identities.pop(base, None)
            raise

    async def _exchange(
        self, send: Callable[..., Any], url: str, kwargs: dict[str, Any], timeout_s: float
    ) -> dict[str, Any]:
        try:
            async with send(url, timeout=aiohttp.ClientTimeout(total=timeout_s), **kwargs) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    err = ErrorAnswer.decode(payload)
                    raise SwarmError(f"{url} answered {resp.status}: {err.message}", resp.status)
        except (aiohttp.ClientError, OSError) as exc:
            raise SwarmError(f"{url}: {exc!r}") from exc
        except TimeoutError:
            raise SwarmError(f"{url}: no answer within {timeout_s:.3g} s") from None
        try:
            return fields.loads(payload, f"{url}'s answer")
        except ValueError as exc:
            raise SwarmError(str(exc)) from None
