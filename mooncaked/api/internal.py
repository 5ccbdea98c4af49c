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
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from mooncaked.api.refusals import REFUSALS, NodeMismatch, NotServing, refusal
from mooncaked.api.signed import Rejected, read_signed_json
from mooncaked.rpc import Target, Verifier
from mooncaked.wire.calls import encode_identity
from mooncaked.wire.lease import Holding, LookupBody, ReleaseAnswer, ReleaseBody
from mooncaked.wire.paths import (
    IDENTITY_PATH,
    LOOKUP_PATH,
    MAX_LOOKUP_BYTES,
    MAX_RELEASE_BYTES,
    RELEASE_PATH,
)


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
            raise NotServing("the KV cache is not running (starting or stopping)")
        return holding

    async def lookup(self, request: web.Request) -> web.Response:
        try:
            data = await read_signed_json(request, self.verifier, max_bytes=MAX_LOOKUP_BYTES)
            call = LookupBody.decode(data)
            holding = self._ready()
            if (call.block_bytes, call.layout) != (holding.block_bytes, holding.layout):
                raise NodeMismatch(
                    f"block layout differs: this node stores {holding.block_bytes}-byte blocks "
                    f"of layout {holding.layout.hex()}"
                )
            grant = await holding.desk.grant(call.hashes, call.reader, call.ttl_s)
        except Rejected as bad:
            return bad.response
        except REFUSALS as exc:  # ReaderRefused included
            return refusal(exc).rpc_response()
        answer = holding.answer(self._node_id(), grant)
        return _json(answer.encode())

    async def release(self, request: web.Request) -> web.Response:
        try:
            data = await read_signed_json(request, self.verifier, max_bytes=MAX_RELEASE_BYTES)
            call = ReleaseBody.decode(data)
            holding = self._ready()
        except Rejected as bad:
            return bad.response
        except REFUSALS as exc:
            return refusal(exc).rpc_response()
        return _json(ReleaseAnswer(holding.desk.release(call.lease_id)).encode())


def _json(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/json")
