"""Signed node-to-node calls to a node known by its URL: one transport for the
clients of the lease, replica and swarm calls.

A call is signed for its peer's node id and generation (``mooncaked.rpc``):
the target the caller names, or the one ``targets(url)`` (the cluster view)
knows, else what the peer's ``/internal/identity`` says, remembered until the
peer refuses a call (401: restarted, or another node answers at that
address now). Every failure is a ``CallFailed`` with the peer's HTTP status
(0: no answer); each client words it as its own error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from mooncaked.rpc import Target, signed_headers
from mooncaked.wire import fields
from mooncaked.wire.errors import ErrorAnswer
from mooncaked.wire.paths import IDENTITY_PATH

__all__ = ["CallFailed", "SignedCalls", "decode_identity", "encode_identity"]


class CallFailed(Exception):
    """A call that got no usable answer: unreachable, refused, malformed."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        # The peer's HTTP status; 0: it did not answer.
        self.status = status


def encode_identity(me: Target) -> bytes:
    """What ``/internal/identity`` answers: this node's id and generation."""
    return orjson.dumps({"node_id": me.node_id, "generation": me.generation})


def decode_identity(data: dict[str, Any]) -> Target:
    """``/internal/identity``'s answer; ValueError naming the field that is wrong."""
    return Target(
        fields.text(data.get("node_id"), "node_id"),
        fields.integer(data.get("generation"), "generation", 1),
    )


class SignedCalls:
    """A session of signed POSTs, opened by ``start`` and closed by ``close``."""

    def __init__(
        self,
        key: bytes,
        *,
        targets: Callable[[str], Target | None] = lambda url: None,
        limit_per_host: int = 16,
    ) -> None:
        self._key = key
        self._targets = targets
        self._limit = limit_per_host
        # Peer URL -> what it said it is; bounded by the peers called.
        self._identities: dict[str, Target] = {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # A bounded number of calls in flight per peer; idle connections are
        # closed soon, so none outlives a peer's restart for long.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit_per_host=self._limit, keepalive_timeout=15.0)
        )

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def post(
        self, url: str, path: str, raw: bytes, timeout_s: float, target: Target | None = None
    ) -> dict[str, Any]:
        """``raw`` POSTed to ``path`` of the node at ``url``, signed for
        ``target`` (default: as the view or the node itself says); its JSON
        answer. CallFailed otherwise."""
        session = self._session
        if session is None:
            raise CallFailed("the client is not started")
        base = url.rstrip("/")
        named = target is not None
        if target is None:
            target = await self._target(session, base, timeout_s)
        headers = {
            "Content-Type": "application/json",
            **signed_headers(self._key, "POST", path, raw, target=target),
        }
        try:
            return await self._exchange(
                session.post, base + path, {"data": raw, "headers": headers}, timeout_s
            )
        except CallFailed as exc:
            if exc.status == 401 and not named:
                # Restarted, or another node answers there now: ask it again next time.
                self._identities.pop(base, None)
            raise

    async def _target(self, session: aiohttp.ClientSession, base: str, timeout_s: float) -> Target:
        known = self._targets(base) or self._identities.get(base)
        if known is not None:
            return known
        data = await self._exchange(session.get, base + IDENTITY_PATH, {}, timeout_s)
        try:
            target = decode_identity(data)
        except ValueError as exc:
            raise CallFailed(f"{base}: malformed identity answer ({exc})") from None
        self._identities[base] = target
        return target

    @staticmethod
    async def _exchange(
        send: Callable[..., Any], url: str, kwargs: dict[str, Any], timeout_s: float
    ) -> dict[str, Any]:
        try:
            async with send(url, timeout=aiohttp.ClientTimeout(total=timeout_s), **kwargs) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    err = ErrorAnswer.decode(payload)
                    raise CallFailed(f"{url} answered {resp.status}: {err.message}", resp.status)
        except (aiohttp.ClientError, OSError) as exc:
            raise CallFailed(f"{url}: {exc!r}") from exc
        except TimeoutError:
            raise CallFailed(f"{url}: no answer within {timeout_s:.3g} s") from None
        try:
            return fields.loads(payload, f"{url}'s answer")
        except ValueError as exc:
            raise CallFailed(str(exc)) from None
