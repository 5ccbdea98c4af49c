"""The holder's side of the lease calls of peer block fetches (``wire.lease``).

- ``POST /internal/cache/lookup``: the longest prefix of the hashes asked
  for that this node has (SSD blocks promoted to DRAM first), leased for
  ``ttl_s`` (at most ``store.lease_timeout_s``). 409 when the reader's block
  layout differs; 403 when this node leases nothing to that reader.
- ``POST /internal/cache/release``: gives a lease back.
- ``GET /internal/identity`` (unsigned): what a call to this node must be
  signed for.

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

``TransferBlockReader`` (the cache's ``BlockReader``) reads the leased slots
through the transfer engine in one batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import structlog
from aiohttp import web

from mooncaked.api.signed import Rejected, read_signed_json, rpc_error
from mooncaked.cache.peer import Offer, PeerError, ReaderRefused
from mooncaked.rpc import Target, Verifier
from mooncaked.transfer import OpStatus, TransferEngine, TransferOp
from mooncaked.wire.lease import (
    Holding,
    LookupBody,
    ReleaseAnswer,
    ReleaseBody,
    encode_identity,
)
from mooncaked.wire.paths import (
    IDENTITY_PATH,
    LOOKUP_PATH,
    MAX_LOOKUP_BYTES,
    MAX_RELEASE_BYTES,
    RELEASE_PATH,
)

log = structlog.get_logger(__name__)


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
        return _json(encode_identity(self.identity()))

    @property
    def num_unauthorized(self) -> int:
        return self.verifier.num_unauthorized

    def _ready(self) -> Holding:
        holding = self._holding()
        if holding is None:
            raise Rejected(rpc_error(503, "the KV cache is not running (starting or stopping)"))
        return holding

    async def lookup(self, request: web.Request) -> web.Response:
        try:
            data = await read_signed_json(request, self.verifier, max_bytes=MAX_LOOKUP_BYTES)
            try:
                call = LookupBody.decode(data)
            except ValueError as exc:
                raise Rejected(rpc_error(400, str(exc))) from None
            holding = self._ready()
            if (call.block_bytes, call.layout) != (holding.block_bytes, holding.layout):
                raise Rejected(
                    rpc_error(
                        409,
                        f"block layout differs: this node stores {holding.block_bytes}-byte "
                        f"blocks of layout {holding.layout.hex()}",
                    )
                )
            try:
                grant = await holding.desk.grant(call.hashes, call.reader, call.ttl_s)
            except ReaderRefused as exc:
                raise Rejected(rpc_error(403, str(exc), code="reader_refused")) from None
        except Rejected as bad:
            return bad.response
        answer = holding.answer(self._node_id(), grant)
        return _json(answer.encode())

    async def release(self, request: web.Request) -> web.Response:
        try:
            data = await read_signed_json(request, self.verifier, max_bytes=MAX_RELEASE_BYTES)
            try:
                call = ReleaseBody.decode(data)
            except ValueError as exc:
                raise Rejected(rpc_error(400, str(exc))) from None
            holding = self._ready()
        except Rejected as bad:
            return bad.response
        return _json(ReleaseAnswer(holding.desk.release(call.lease_id)).encode())


def _json(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/json")


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
