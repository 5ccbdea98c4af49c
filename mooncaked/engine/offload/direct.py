"""A compute node's side of the direct handoff: a prompt's KV written by its
prefill node straight into the memory node that will attend over it.

The decode node's KV receiver, on the event loop, opens one connection to
the memory node for the handoff (authenticated as this node's offload peer,
so the sequence is its own), asks it to reserve blocks and grant them to
each prefill node it tries (``reserve``: the grant the prefill node writes
into, in place of one of this node's), and says when the KV landed
(``fill``). The step thread's client of that memory node is then told it
holds the prompt (``adopt``), so the first decode uploads nothing. Any
failure raises ``OffloadError``; the receiver falls back to a local grant.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from mooncaked.engine.offload.clients import ClientPool
from mooncaked.engine.offload.wire import (
    HEADER,
    Kind,
    KVShape,
    OffloadError,
    Reserve,
    decode_granted,
    encode_filled,
    encode_json,
    frame,
    hello_mac,
    parse_header,
)
from mooncaked.handoff import KVGrant


class DirectLink:
    """One handoff's connection to a memory node (event loop only)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout_s: float
    ) -> None:
        self._reader, self._writer = reader, writer
        self._timeout_s = timeout_s

    async def call(self, kind: Kind, payload: bytes) -> bytearray:
        """Send one frame; the OK's payload, OffloadError otherwise."""
        try:
            async with asyncio.timeout(self._timeout_s):
                self._writer.write(frame(kind, payload))
                await self._writer.drain()
                got, _, body = await _read_frame(self._reader)
        except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError) as exc:
            raise OffloadError(f"{kind.name}: {exc or type(exc).__name__}") from exc
        if got is not Kind.OK:
            raise OffloadError(f"{kind.name} refused: {bytes(body).decode(errors='replace')}")
        return body

    async def reserve(self, key: str, num_tokens: int, writer: str, ttl_s: float) -> KVGrant:
        """Blocks for the prompt, granted to ``writer`` (a reservation made
        before on this link is given up)."""
        body = await self.call(Kind.RESERVE, Reserve(key, num_tokens, writer, ttl_s).encode())
        try:
            return decode_granted(body)
        except ValueError as exc:
            raise OffloadError(str(exc)) from exc

    async def fill(self, key: str, num_tokens: int) -> None:
        await self.call(Kind.FILLED, encode_filled(key, num_tokens))

    async def close(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass  # the memory node went first: nothing to close cleanly


@dataclass(slots=True)
class DirectHandoff:
    """What the KV receiver needs of offloading: where a request's attention
    goes, a link there, and the step thread's client told of the result."""

    node_id: str
    secret: bytes
    shape: KVShape
    clients: ClientPool
    address_for: Callable[[str], str]
    timeout_s: float = 5.0

    async def open(self, address: str) -> DirectLink:
        host, _, port = address.rpartition(":")
        try:
            async with asyncio.timeout(self.timeout_s):
                reader, writer = await asyncio.open_connection(host, int(port))
                kind, _, nonce = await _read_frame(reader)
                if kind is not Kind.CHALLENGE:
                    raise OffloadError(f"expected CHALLENGE, got {kind.name}")
                mac = hello_mac(self.secret, bytes(nonce), self.node_id, self.shape)
                shape = {k: getattr(self.shape, k) for k in self.shape.__dataclass_fields__}
                hello = {"node": self.node_id, "mac": mac, "shape": shape}
                link = DirectLink(reader, writer, self.timeout_s)
                await link.call(Kind.HELLO, encode_json(hello))
        except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError) as exc:
            raise OffloadError(f"{address}: {exc or type(exc).__name__}") from exc
        return link

    def adopt(self, address: str, key: str, num_tokens: int) -> None:
        """The memory node at ``address`` holds ``key``'s first ``num_tokens``."""
        self.clients.get(address).adopt(key, num_tokens)
        self.clients.stats.direct_handoffs += 1


async def _read_frame(reader: asyncio.StreamReader) -> tuple[Kind, int, bytearray]:
    kind, layer, length = parse_header(await reader.readexactly(HEADER.size))
    payload = bytearray(await reader.readexactly(length)) if length else bytearray()
    return kind, layer, payload


__all__ = ["DirectHandoff", "DirectLink"]
