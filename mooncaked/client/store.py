"""The store client: a node's KV store and its named objects from any program.

``StoreClient`` blocks; ``AsyncStoreClient`` runs on the caller's event
loop. Each kind of thing the store holds is a namespace of operations on the
client (``client.kv``): a new kind is a module of ``Call`` builders and one
attribute here, and shares the transport and the errors. Named objects
(``client.objects``: put, get, list, remove) are files moved by the node
itself and downloaded with each shard checked; their client
(``objects.client.ObjectsClient``) blocks, so the blocking client carries it.
"""

from __future__ import annotations

from typing import Any

from mooncaked.client.http import AsyncTransport, Call, SyncTransport
from mooncaked.client.kv import AsyncKVBlocks, KVBlocks
from mooncaked.objects.client import ObjectsClient


def _stats_call() -> Call[dict[str, Any]]:
    return Call("GET", "/admin/cache/stats", None, dict)


class StoreClient:
    """A node's store over its admin API, blocking.

    >>> client = StoreClient("http://127.0.0.1:8000")
    >>> client.kv.put(prompt="You are a helpful assistant...", replicas=2)
    >>> client.objects.put("llama-8b", "/models/llama-8b.gguf")
    """

    def __init__(self, url: str, *, token: str = "", timeout_s: float = 60.0) -> None:
        """``token``: the node's admin token (``server.admin_token``) if it has one."""
        self._transport = SyncTransport(url, token=token, timeout_s=timeout_s)
        self.kv = KVBlocks(self._transport.run)
        self.objects = ObjectsClient(self._transport.url, token=token, timeout=timeout_s)

    @property
    def url(self) -> str:
        return self._transport.url

    def stats(self) -> dict[str, Any]:
        """The node's ``/admin/cache/stats``: tiers, pins, replicas, watermark."""
        return self._transport.run(_stats_call())

    def close(self) -> None:
        """Nothing held between calls; for symmetry with the async client."""

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncStoreClient:
    """A node's store over its admin API, on an event loop (one HTTP session)."""

    def __init__(self, url: str, *, token: str = "", timeout_s: float = 60.0) -> None:
        self._transport = AsyncTransport(url, token=token, timeout_s=timeout_s)
        self.kv = AsyncKVBlocks(self._transport.run)

    @property
    def url(self) -> str:
        return self._transport.url

    async def stats(self) -> dict[str, Any]:
        return await self._transport.run(_stats_call())

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncStoreClient:
        await self._transport.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
