"""Node-to-node control RPC over HTTP, and the wire side of peer block fetches.

Endpoints (every request signed, see below; anything else gets 401):

- ``POST /internal/cache/lookup``
  ``{"hashes": [hex], "block_bytes": n, "layout": hex, "reader": node id, "ttl_s": s}``
  -> ``{"node_id", "lease_id", "offsets": [int], "block_bytes", "ttl_s",
  "segment": descriptor, "transfer_address"}``: the longest prefix of
  ``hashes`` this node has (SSD blocks promoted to DRAM first), leased for
  ``ttl_s`` (at most ``store.lease_timeout_s``) under ``lease_id``, each
  block's byte offset in the DRAM segment ``segment``. ``lease_id`` 0 and no
  offsets when it has none. 409 when the reader's block layout differs; 403
  when this node leases nothing to that reader (see below).
- ``POST /internal/cache/release`` ``{"lease_id": n}`` -> ``{"released": bool}``;
  false means the lease had lapsed and what the reader read must be discarded.
- ``GET /internal/identity`` (unsigned) -> ``{"node_id", "generation"}``: what
  a call to this node must be signed for, for callers that know it by URL
  only (``store.peers`` not in their cluster view).

Authentication: every call is signed with a key derived from the cluster
secret, over the method, the path, the target node and its generation, a
timestamp, a nonce and the body (``mooncaked.rpc``), so only cluster members
can lease slots, a body signed for one path is refused on another, and a
captured call replayed (here, on another node, or here after a restart) is
refused (401) before it takes a lease. The secret is shared, so the
``reader`` a lookup names is the caller's word: an up member of this node's
cluster view holds at most ``store.peer_max_leases_per_reader`` leases, and
every other name (a node that lists this one in ``store.peers`` without
gossip, or one made up) counts against one cap shared by all of them,
``store.peer_max_leases_outside``; a reader never leased to (this node's own
id; any non-member when that cap is 0) gets 403.

``InternalClient`` (the ``PeerClient`` of ``mooncaked.cache.peer``) makes
these calls; ``TransferBlockReader`` (its ``BlockReader``) reads the leased
slots through the transfer engine in one batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import structlog
from aiohttp import web

from mooncaked.api.signed import Rejected, read_signed_json, rpc_error
from mooncaked.cache.hashing import BlockHash, parse_hex_hashes
from mooncaked.cache.peer import LeaseDesk, Offer, PeerError, ReaderRefused
from mooncaked.rpc import Target, Verifier, derive_key, signed_headers
from mooncaked.transfer import OpStatus, TransferEngine, TransferOp

log = structlog.get_logger(__name__)

LOOKUP_PATH = "/internal/cache/lookup"
RELEASE_PATH = "/internal/cache/release"
IDENTITY_PATH = "/internal/identity"
# Most hashes one lookup may name (a 1M-token prompt in 16-token blocks).
MAX_LOOKUP_HASHES = 65536
# Largest body of each call: a lookup of MAX_LOOKUP_HASHES hex hashes, a release.
MAX_LOOKUP_BYTES = MAX_LOOKUP_HASHES * 40 + 4096
MAX_RELEASE_BYTES = 4096


def _parse_hashes(raw: Any) -> list[BlockHash]:
    return parse_hex_hashes(raw, "hashes", MAX_LOOKUP_HASHES)


@dataclass(frozen=True, slots=True)
class Holding:
    """What the holder side serves from, once the store and transfer engine run."""

    desk: LeaseDesk
    block_bytes: int
    # BlockLayout.fingerprint(): readers with another layout are refused.
    layout: bytes
    # The DRAM pool's transfer segment descriptor (SegmentDescriptor.to_dict()).
    segment: dict[str, Any]
    transfer_address: str


class InternalAPI:
    """The holder's side: serves lookups and releases of DRAM leases.

    Routes exist from the node's start; until ``holding()`` returns something
    (the store is up) they answer 503, which a reader counts as a failed peer.
    """

    def __init__(
        self,
        *,
        secret: bytes,
        node_id: Callable[[], str],
        generation: int,
        holding: Callable[[], Holding | None],
    ) -> None:
        self._node_id = node_id
        self._generation = generation
        # Calls are good only if signed for this node in this process.
        self.verifier = Verifier(secret, identity=self.identity)
        self._holding = holding

    def identity(self) -> Target:
        return Target(self._node_id(), self._generation)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post(LOOKUP_PATH, self.lookup),
            web.post(RELEASE_PATH, self.release),
            web.get(IDENTITY_PATH, self.identify),
        ]

    async def identify(self, request: web.Request) -> web.Response:
        me = self.identity()
        return web.Response(
            body=orjson.dumps({"node_id": me.node_id, "generation": me.generation}),
            content_type="application/json",
        )

    @property
    def num_unauthorized(self) -> int:
        return self.verifier.num_unauthorized

    async def lookup(self, request: web.Request) -> web.Response:
        try:
            data = await read_signed_json(request, self.verifier, max_bytes=MAX_LOOKUP_BYTES)
        except Rejected as exc:
            return exc.response
        try:
            hashes = _parse_hashes(data.get("hashes"))
            ttl = data.get("ttl_s")
            if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
                raise ValueError("'ttl_s' must be a number > 0")
            reader = data.get("reader")
            if not isinstance(reader, str) or not reader:
                raise ValueError("'reader' must be the reader's node id")
        except ValueError as exc:
            return rpc_error(400, str(exc))
        holding = self._holding()
        if holding is None:
            return rpc_error(503, "the KV cache is not running (starting or stopping)")
        if data.get("block_bytes") != holding.block_bytes or data.get("layout") != (
            holding.layout.hex()
        ):
            return rpc_error(
                409,
                f"block layout differs: this node stores {holding.block_bytes}-byte blocks "
                f"of layout {holding.layout.hex()}",
            )
        try:
            grant = await holding.desk.grant(hashes, reader, float(ttl))
        except ReaderRefused as exc:
            return rpc_error(403, str(exc), code="reader_refused")
        body: dict[str, Any] = {
            "node_id": self._node_id(),
            "lease_id": grant.lease_id if grant else 0,
            "offsets": list(grant.offsets) if grant else [],
            "ttl_s": grant.ttl_s if grant else 0.0,
            "block_bytes": holding.block_bytes,
            "segment": holding.segment,
            "transfer_address": holding.transfer_address,
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def release(self, request: web.Request) -> web.Response:
        try:
            data = await read_signed_json(request, self.verifier, max_bytes=MAX_RELEASE_BYTES)
        except Rejected as exc:
            return exc.response
        lease_id = data.get("lease_id")
        if isinstance(lease_id, bool) or not isinstance(lease_id, int) or lease_id <= 0:
            return rpc_error(400, "'lease_id' must be a positive integer")
        holding = self._holding()
        if holding is None:
            return rpc_error(503, "the KV cache is not running (starting or stopping)")
        released = holding.desk.release(lease_id)
        return web.Response(
            body=orjson.dumps({"released": released}), content_type="application/json"
        )


class _Refused(PeerError):
    """The peer refused the call's signature (401)."""


class InternalClient:
    """The reader's side of the control calls (a ``PeerClient``).

    Each call is signed for its peer's node id and generation: from
    ``targets(peer_url)`` (the cluster view) when it knows the peer, else as
    the peer's ``/internal/identity`` says, remembered until the peer refuses
    a call (401: restarted, or another node at that address now).
    """

    def __init__(
        self,
        *,
        secret: bytes,
        node_id: Callable[[], str],
        block_bytes: int,
        layout: bytes,
        targets: Callable[[str], Target | None] = lambda peer: None,
    ) -> None:
        self._key = derive_key(secret)
        self._node_id = node_id
        self._block_bytes = block_bytes
        self._layout = layout
        self._targets = targets
        # Peer URL -> what it said it is; bounded by the peers asked (the
        # view's members and the configured peers).
        self._identities: dict[str, Target] = {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # A bounded number of calls in flight per peer; idle connections are
        # closed soon, so none outlives a peer's restart for long.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit_per_host=16, keepalive_timeout=15.0)
        )

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def __aenter__(self) -> InternalClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _target(self, session: aiohttp.ClientSession, peer: str, timeout_s: float) -> Target:
        """What a call to ``peer`` is signed for; raises PeerError when unknown."""
        base = peer.rstrip("/")
        known = self._targets(base)
        if known is not None:
            return known
        cached = self._identities.get(base)
        if cached is not None:
            return cached
        data = await self._exchange(session.get, base + IDENTITY_PATH, {}, timeout_s)
        try:
            target = Target(str(data["node_id"]), int(data["generation"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise PeerError(f"{base}: malformed identity answer ({exc!r})") from None
        self._identities[base] = target
        return target

    async def _call(self, peer: str, path: str, body: dict[str, Any], timeout_s: float) -> Any:
        session = self._session
        if session is None:
            raise PeerError("the internal client is not started")
        target = await self._target(session, peer, timeout_s)
        raw = orjson.dumps(body)
        headers = {
            "Content-Type": "application/json",
            **signed_headers(self._key, "POST", path, raw, target=target),
        }
        try:
            return await self._exchange(
                session.post, peer.rstrip("/") + path, {"data": raw, "headers": headers}, timeout_s
            )
        except _Refused:
            # Restarted, or another node answers there now: ask it again next time.
            self._identities.pop(peer.rstrip("/"), None)
            raise

    async def _exchange(
        self, send: Callable[..., Any], url: str, kwargs: dict[str, Any], timeout_s: float
    ) -> dict[str, Any]:
        try:
            async with send(url, timeout=aiohttp.ClientTimeout(total=timeout_s), **kwargs) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    cls = _Refused if resp.status == 401 else PeerError
                    raise cls(
                        f"{url} answered {resp.status}: {payload[:200].decode(errors='replace')}"
                    )
        except (aiohttp.ClientError, OSError) as exc:
            raise PeerError(f"{url}: {exc!r}") from exc
        except TimeoutError:
            raise PeerError(f"{url}: no answer within {timeout_s:.3g} s") from None
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise PeerError(f"{url} answered with something that is not JSON") from None
        if not isinstance(data, dict):
            raise PeerError(f"{url} answered with a JSON {type(data).__name__}, not an object")
        return data

    async def lookup(
        self, peer: str, hashes: Sequence[BlockHash], ttl_s: float, timeout_s: float
    ) -> Offer | None:
        data = await self._call(
            peer,
            LOOKUP_PATH,
            {
                "hashes": [h.hex() for h in hashes],
                "block_bytes": self._block_bytes,
                "layout": self._layout.hex(),
                "reader": self._node_id(),
                "ttl_s": ttl_s,
            },
            timeout_s,
        )
        try:
            offsets = tuple(int(o) for o in data["offsets"])
            lease_id = int(data["lease_id"])
            if not offsets:
                return None
            segment = data["segment"]
            return Offer(
                peer=peer,
                node_id=str(data["node_id"]),
                lease_id=lease_id,
                offsets=offsets,
                block_bytes=int(data["block_bytes"]),
                segment=str(segment["name"]),
                transfer_address=str(data["transfer_address"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PeerError(f"{peer}: malformed lookup answer ({exc!r})") from None

    async def release(self, offer: Offer, timeout_s: float) -> bool:
        data = await self._call(offer.peer, RELEASE_PATH, {"lease_id": offer.lease_id}, timeout_s)
        released = data.get("released")
        if not isinstance(released, bool):
            raise PeerError(f"{offer.peer}: malformed release answer")
        return released


class TransferBlockReader:
    """Reads leased slots of a peer's DRAM segment into the local one (a ``BlockReader``)."""

    def __init__(self, transfer: TransferEngine, local_segment: str) -> None:
        self._transfer = transfer
        self._local_segment = local_segment

    async def read(self, offer: Offer, local_offsets: Sequence[int], timeout_s: float) -> int:
        if len(local_offsets) != offer.num_blocks:
            raise ValueError(
                f"{len(local_offsets)} local offsets for an offer of {offer.num_blocks} blocks"
            )
        if not local_offsets:
            return 0
        if offer.node_id == self._transfer.node_id:
            # Ops naming this node are local copies: they would read our own
            # slots, not the peer's. Two nodes must never share an id.
            raise PeerError(f"{offer.peer} answered with this node's own id {offer.node_id!r}")
        self._transfer.add_peer(offer.node_id, offer.transfer_address)
        ops, firsts = _coalesce(self._local_segment, offer, list(local_offsets), offer.block_bytes)
        batch = await self._transfer.submit(ops, op_timeout_s=timeout_s)
        try:
            await batch.wait()
        except asyncio.CancelledError:
            batch.cancel("the fetch was cancelled")
            # The slots are handed back by the caller once this returns: no
            # slice may still be writing into them then.
            while not batch.done:
                try:
                    await asyncio.shield(batch.wait())
                except asyncio.CancelledError:
                    continue
            raise
        n = 0
        for i, status in enumerate(batch.statuses):
            if status is not OpStatus.DONE:
                log.warning("peer.transfer_op_failed", peer=offer.node_id, reason=batch.reason(i))
                break
            n = firsts[i + 1] if i + 1 < len(firsts) else len(local_offsets)
        return n


def _coalesce(
    local_segment: str, offer: Offer, local_offsets: list[int], block_bytes: int
) -> tuple[list[TransferOp], list[int]]:
    """One READ per run of blocks contiguous on both sides; and the index of
    the first block of each op."""
    ops: list[TransferOp] = []
    firsts: list[int] = []
    i = 0
    n = len(local_offsets)
    while i < n:
        j = i + 1
        while (
            j < n
            and offer.offsets[j] == offer.offsets[j - 1] + block_bytes
            and local_offsets[j] == local_offsets[j - 1] + block_bytes
        ):
            j += 1
        ops.append(
            TransferOp.read(
                local_segment,
                local_offsets[i],
                offer.node_id,
                offer.segment,
                offer.offsets[i],
                (j - i) * block_bytes,
            )
        )
        firsts.append(i)
        i = j
    return ops, firsts
