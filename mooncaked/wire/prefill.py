"""The prefill call, decode node -> prefill node, its answer and its client.

``POST /internal/prefill`` with a ``PrefillBody``: once the prompt's KV is
written into the granted blocks, the prefill node answers with the first
sampled token (``encode_prefill_reply``). Refusals: 502 when the KV could
not be written; 409 from a node that does not prefill, and 409 with code
``prefill_busy`` from one whose own queue is longer than ``max_wait_s``
(late binding: the decode node asks the next). Closing the connection
aborts the prefill.

``PrefillClient`` is the decode node's side (the ``KVReceiver``'s
``prefill`` call).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from mooncaked.cluster.watch import MemberLost, MemberWatch
from mooncaked.engine.handoff import PrefillBusy, PrefillError, PrefillReply
from mooncaked.engine.plan import SampledToken
from mooncaked.handoff import Handoff, KVGrant, PrefillTarget, Retain, StageRef
from mooncaked.request import Request, SamplingParams
from mooncaked.rpc import Target, derive_key, signed_headers
from mooncaked.wire import fields
from mooncaked.wire.errors import ErrorAnswer
from mooncaked.wire.handoff import (
    decode_grant,
    decode_retain,
    decode_stages,
    encode_grant,
    encode_retain,
    encode_stage,
)
from mooncaked.wire.paths import PREFILL_PATH
from mooncaked.wire.request import (
    decode_logprob,
    decode_prompt,
    decode_sampling,
    encode_logprob,
    encode_sampling,
)

# The code of a refusal that computed nothing: the decode node asks the next.
PREFILL_BUSY = "prefill_busy"


@dataclass(frozen=True, slots=True)
class PrefillBody:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # The decode node's blocks to write the prompt's KV into.
    grant: KVGrant
    # Whether the prefill node may pull a longer prefix from peers.
    peer_fetch: bool = True
    # Late binding: the longest queue the prefill node may take the request
    # with (inf: any; absent from the wire).
    max_wait_s: float = math.inf
    # A pipelined group's stages, the node asked first (its head); empty:
    # one prefill node.
    stages: tuple[StageRef, ...] = ()
    # Keep the prompt's KV once computed (the client asked); None: as usual.
    retain: Retain | None = None

    def encode(self) -> bytes:
        doc: dict[str, Any] = {
            "request_id": self.request_id,
            "prompt_token_ids": self.prompt_token_ids,
            "sampling": encode_sampling(self.sampling),
            "grant": encode_grant(self.grant),
            "peer_fetch": self.peer_fetch,
        }
        if math.isfinite(self.max_wait_s):
            doc["max_wait_s"] = round(self.max_wait_s, 6)
        if self.stages:
            doc["stages"] = [encode_stage(s) for s in self.stages]
        if self.retain is not None:
            doc["retain"] = encode_retain(self.retain)
        return orjson.dumps(doc)

    @classmethod
    def decode(cls, data: dict[str, Any]) -> PrefillBody:
        """ValueError naming the field that is wrong."""
        max_wait = data.get("max_wait_s")
        stages = data.get("stages")
        return cls(
            request_id=fields.text(data.get("request_id"), "request_id"),
            prompt_token_ids=decode_prompt(data.get("prompt_token_ids")),
            sampling=decode_sampling(data.get("sampling")),
            grant=decode_grant(data.get("grant")),
            peer_fetch=fields.flag(data.get("peer_fetch", True), "peer_fetch"),
            max_wait_s=(
                math.inf
                if max_wait is None
                else fields.number(max_wait, "max_wait_s", unit="seconds")
            ),
            stages=() if stages is None else decode_stages(stages),
            retain=decode_retain(data.get("retain")),
        )

    def handoff(self) -> Handoff:
        """The prefill-side request's ``Handoff``."""
        return Handoff(sink=self.grant, peer_fetch=self.peer_fetch, retain=self.retain)


def encode_prefill_reply(reply: PrefillReply) -> bytes:
    lp = reply.token.logprob
    return orjson.dumps(
        {
            "node_id": reply.node_id,
            "token": [reply.token.token_id, encode_logprob(lp) if lp else None],
            "num_cached_tokens": reply.num_cached_tokens,
            "bytes": reply.bytes_sent,
        }
    )


def decode_prefill_reply(payload: bytes) -> PrefillReply:
    """ValueError naming the field when ``payload`` is not a prefill node's answer."""
    d = fields.loads(payload, "a prefill answer")
    token = d.get("token")
    if not isinstance(token, list) or len(token) != 2:
        raise fields.refuse("token", "[token_id, logprob or null]", token)
    token_id, lp = token
    return PrefillReply(
        node_id=fields.text(d.get("node_id"), "node_id"),
        token=SampledToken(
            fields.integer(token_id, "token[0]"),
            None if lp is None else decode_logprob(lp, "token[1]"),
        ),
        num_cached_tokens=fields.integer(d.get("num_cached_tokens"), "num_cached_tokens"),
        bytes_sent=fields.integer(d.get("bytes", 0), "bytes"),
    )


class PrefillClient:
    """The decode node's side of ``/internal/prefill``."""

    def __init__(
        self,
        *,
        secret: bytes,
        targets: Callable[[str], Target | None],
        watch: MemberWatch | None = None,
    ) -> None:
        """``targets(node_id)``: what a call to that node is signed for (its
        generation from the cluster view), None when it is not in the view."""
        self._key = derive_key(secret)
        self._targets = targets
        # Cuts a call to a prefill node that gossip declares dead, instead of
        # waiting for the grant to run out.
        self._watch = watch
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> PrefillClient:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit_per_host=64, keepalive_timeout=15.0)
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def prefill(
        self, target: PrefillTarget, req: Request, grant: KVGrant, max_wait_s: float = math.inf
    ) -> PrefillReply:
        """Ask ``target`` for ``req``'s KV; raises PrefillBusy when it passes the
        request on, PrefillError when it cannot be asked or fails."""
        session = self._session
        if session is None:
            raise PrefillError("the prefill client is not started")
        bound = self._targets(target.node_id)
        if bound is None:
            # Unbound, the call could be replayed on any node: not sent.
            raise PrefillError(
                f"{target.node_id} is not in this node's cluster view; "
                "a call to it cannot be signed"
            )
        body = PrefillBody(
            req.request_id,
            req.prompt_token_ids,
            req.sampling,
            grant,
            target.fetch,
            max_wait_s,
            target.stages,
            req.handoff.retain,
        ).encode()
        headers = {
            "Content-Type": "application/json",
            **signed_headers(self._key, "POST", PREFILL_PATH, body, target=bound),
        }
        # The grant's own time (the decode node sizes it to the prompt): a
        # prefill that outlives it could write nothing more anyway.
        timeout = aiohttp.ClientTimeout(total=grant.ttl_s)

        async def call() -> bytes:
            async with session.post(
                target.url.rstrip("/") + PREFILL_PATH, data=body, headers=headers, timeout=timeout
            ) as resp:
                payload = await resp.read()
                if resp.status == 200:
                    return payload
                err = ErrorAnswer.decode(payload)
                if resp.status == 409 and err.code == PREFILL_BUSY:
                    raise PrefillBusy(f"{target.node_id}: {err.message}")
                raise PrefillError(f"{target.node_id} answered {resp.status}: {err.message}")

        try:
            if self._watch is None:
                payload = await call()
            else:
                payload = await self._watch.race(target.node_id, call())
        except MemberLost as exc:
            raise PrefillError(f"cut over: {exc}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise PrefillError(f"{target.node_id}: {exc!r}") from exc
        except TimeoutError:
            raise PrefillError(f"{target.node_id}: no answer within the grant's time") from None
        try:
            return decode_prefill_reply(payload)
        except ValueError as exc:
            raise PrefillError(f"{target.node_id}: malformed answer ({exc})") from None
