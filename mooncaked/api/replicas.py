"""The holder's side of a replica put (``wire.replicas``): reserve, commit, drop.

- ``POST /internal/store/reserve``: inbox rows for the blocks this node
  lacks, granted to the writer (409 when its block layout differs or this
  node takes no replicas; 403 for a writer that is not an up member of this
  node's cluster view while ``store.replica_max_rows_outside`` is 0: a put
  takes DRAM; past 0, such writers together hold at most that many rows).
- ``POST /internal/store/commit``: the written rows checked against the
  writer's checksums; only blocks that match enter DRAM (soft-pinned when
  the put keeps a request's prompt).
- ``POST /internal/store/drop``: this node's copies dropped (pinned ones
  kept, unless the call ends pins).

Every call is signed for this node and its generation, like the lease calls
(``api.internal``); until the store runs they answer 503.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from mooncaked.api.refusals import REFUSALS, NotServing, refusal
from mooncaked.api.signed import Rejected, read_signed_json
from mooncaked.rpc import Target, Verifier
from mooncaked.wire.paths import (
    MAX_REPLICA_BYTES,
    REPLICA_COMMIT_PATH,
    REPLICA_DROP_PATH,
    REPLICA_RESERVE_PATH,
)
from mooncaked.wire.replicas import (
    CommitBody,
    DropBody,
    ReplicaDesk,
    ReserveBody,
    WriterRefused,
)


class ReplicaAPI:
    def __init__(
        self,
        *,
        secret: bytes,
        node_id: Callable[[], str],
        generation: int,
        desk: Callable[[], ReplicaDesk | None],
        is_member: Callable[[str], bool],
    ) -> None:
        """``is_member(node_id)``: an up member of this node's cluster view."""
        self._node_id = node_id
        self._generation = generation
        self.verifier = Verifier(secret, identity=self.identity)
        self._desk = desk
        self._is_member = is_member

    def identity(self) -> Target:
        return Target(self._node_id(), self._generation)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post(REPLICA_RESERVE_PATH, self.reserve),
            web.post(REPLICA_COMMIT_PATH, self.commit),
            web.post(REPLICA_DROP_PATH, self.drop),
        ]

    def _ready(self) -> ReplicaDesk:
        desk = self._desk()
        if desk is None:
            raise NotServing("the KV cache is not running (starting or stopping)")
        return desk

    async def reserve(self, request: web.Request) -> web.Response:
        try:
            data = await read_signed_json(request, self.verifier, max_bytes=MAX_REPLICA_BYTES)
            call = ReserveBody.decode(data)
            desk = self._ready()
            if call.source == self._node_id():
                raise WriterRefused(f"this node takes no replicas from itself ({call.source!r})")
            # Writers outside the view (another engine's KV connector) share
            # one cap, store.replica_max_rows_outside (0: refused).
            answer = desk.reserve(self._node_id(), call, outside=not self._is_member(call.source))
        except Rejected as bad:
            return bad.response
        except REFUSALS as exc:
            return refusal(exc).rpc_response()
        return _json(answer.encode())

    async def commit(self, request: web.Request) -> web.Response:
        try:
            data = await read_signed_json(request, self.verifier, max_bytes=MAX_REPLICA_BYTES)
            call = CommitBody.decode(data)
            answer = await self._ready().commit(call)
        except Rejected as bad:
            return bad.response
        except REFUSALS as exc:
            return refusal(exc).rpc_response()
        return _json(answer.encode())

    async def drop(self, request: web.Request) -> web.Response:
        try:
            data = await read_signed_json(request, self.verifier, max_bytes=MAX_REPLICA_BYTES)
            call = DropBody.decode(data)
            answer = self._ready().drop(call)
        except Rejected as bad:
            return bad.response
        except REFUSALS as exc:
            return refusal(exc).rpc_response()
        return _json(answer.encode())


def _json(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/json")
