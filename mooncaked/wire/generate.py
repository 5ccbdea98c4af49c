"""The generate call, entry node -> decode node, and its client.

``POST /internal/generate`` with a ``GenerateBody``: the decode node runs
the request, asking the listed prefill nodes in turn for the prompt's KV
(none listed: it computes the prompt itself; with offers, late binding:
``engine.late_binding``), and answers with the request's outputs as JSON
lines (``request.encode_output``) as its engine produces them. Closing the
connection aborts the request there. A refusal before the first line is an
``ErrorAnswer`` with the status the refusal table gives.

``GenerateClient`` is the entry's side: it signs the call for the decode
node as this node's cluster view knows it, and ``OutputStream`` reads the
lines back, cut when gossip declares the node dead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from mooncaked.cluster.watch import MemberLost, MemberWatch
from mooncaked.handoff import MAX_KV_READY_IN_S, Handoff, PrefillSource, Retain, kv_ready_at
from mooncaked.request import RequestOutput, SamplingParams
from mooncaked.rpc import Target, signed_headers
from mooncaked.wire import fields
from mooncaked.wire.errors import ErrorAnswer
from mooncaked.wire.handoff import decode_retain, decode_target, encode_retain, encode_target
from mooncaked.wire.paths import GENERATE_PATH
from mooncaked.wire.request import decode_output, decode_prompt, decode_sampling, encode_sampling

# Longest a late-binding hop to the next prefill node may be priced at.
MAX_HOP_S = 60.0


@dataclass(frozen=True, slots=True)
class GenerateBody:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # The prefill nodes to ask, in order, and the round trip one more hop
    # costs (None: the decode node computes the prompt itself).
    source: PrefillSource | None = None
    # Tokens already sent for this request (a resumed stream).
    output_offset: int = 0
    # When the entry expects the prompt's KV in, from now (0: unknown), for
    # the decode node's load forecast.
    kv_ready_in_s: float = 0.0
    # Keep the prompt's KV once computed (the client asked); None: as usual.
    retain: Retain | None = None
    # host:port of the memory node placement paired the decode node with
    # ("": none; sent only when set, so older decode nodes read the body).
    memory_node: str = ""

    def encode(self) -> bytes:
        source = self.source
        doc: dict[str, Any] = {
            "request_id": self.request_id,
            "prompt_token_ids": self.prompt_token_ids,
            "sampling": encode_sampling(self.sampling),
            "prefill": [encode_target(t) for t in source.targets] if source else [],
            "hop_s": source.hop_s if source else 0.0,
            "output_offset": self.output_offset,
            "kv_ready_in_s": round(self.kv_ready_in_s, 6),
        }
        if self.retain is not None:
            doc["retain"] = encode_retain(self.retain)
        if self.memory_node:
            doc["memory_node"] = self.memory_node
        return orjson.dumps(doc)

    @classmethod
    def decode(cls, data: dict[str, Any]) -> GenerateBody:
        """ValueError naming the field that is wrong."""
        raw_targets = data.get("prefill") or []
        if not isinstance(raw_targets, list):
            raise fields.refuse("prefill", "a list of prefill targets", raw_targets)
        targets = tuple(decode_target(t, f"prefill[{i}]") for i, t in enumerate(raw_targets))
        hop_s = fields.number(data.get("hop_s", 0.0), "hop_s", 0.0, MAX_HOP_S, unit="seconds")
        return cls(
            request_id=fields.text(data.get("request_id"), "request_id"),
            prompt_token_ids=decode_prompt(data.get("prompt_token_ids")),
            sampling=decode_sampling(data.get("sampling")),
            source=PrefillSource(targets, hop_s) if targets else None,
            output_offset=fields.integer(data.get("output_offset", 0), "output_offset"),
            kv_ready_in_s=fields.number(
                data.get("kv_ready_in_s", 0.0),
                "kv_ready_in_s",
                0.0,
                MAX_KV_READY_IN_S,
                unit="seconds",
            ),
            retain=decode_retain(data.get("retain")),
            memory_node=decode_memory_node(data.get("memory_node")),
        )

    def handoff(self, now: float) -> Handoff:
        """The decode-side request's ``Handoff``, ``now`` on the engine's clock."""
        ready_in_s = self.kv_ready_in_s if self.source is not None else 0.0
        return Handoff(
            source=self.source,
            kv_ready_at=kv_ready_at(ready_in_s, now),
            output_offset=self.output_offset,
            retain=self.retain,
            memory_node=self.memory_node,
        )


def decode_memory_node(value: Any) -> str:
    """``memory_node`` of a generate body: absent, or host:port."""
    if value is None:
        return ""
    text = fields.text(value, "memory_node")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise fields.refuse("memory_node", "host:port of a memory node", value)
    return text


class DecodeNodeLost(Exception):
    """The decode node went away (refused, cut, killed) before the request finished."""


class GenerateRefused(Exception):
    """The decode node answered the call with a refusal other than "gone":
    its status, what it said, and its Retry-After (seconds, None: none)."""

    def __init__(self, status: int, answer: ErrorAnswer, retry_after_s: float | None) -> None:
        super().__init__(f"{status}: {answer.message}")
        self.status = status
        self.answer = answer
        self.retry_after_s = retry_after_s


class GenerateClient:
    """The entry's side of ``/internal/generate``.

    ``targets(node_id)``: what a call to that node is signed for (its
    generation in this node's view), None when it is not in the view.
    """

    def __init__(
        self,
        *,
        key: bytes,
        session: Callable[[], aiohttp.ClientSession],
        targets: Callable[[str], Target | None],
        watch: MemberWatch,
    ) -> None:
        self._key = key
        self._session = session
        self._targets = targets
        # Cuts a forwarded request's stream when its decode node is lost.
        self._watch = watch

    async def open(self, node_id: str, url: str, body: GenerateBody) -> OutputStream:
        """The decode node's stream of outputs once it took the request.

        Raises DecodeNodeLost when it cannot be reached, is not in the view,
        or answers 502/503 (another decode node may take the request), and
        GenerateRefused for any other refusal.
        """
        target = self._targets(node_id)
        if target is None:
            # Unbound, the call could be replayed on any node: not sent.
            raise DecodeNodeLost(
                f"{node_id} is not in this node's cluster view (left or reaped); "
                "a call to it cannot be signed"
            )
        raw = body.encode()
        headers = {
            "Content-Type": "application/json",
            **signed_headers(self._key, "POST", GENERATE_PATH, raw, target=target),
        }
        try:
            resp = await self._watch.race(
                node_id,
                self._session().post(
                    url + GENERATE_PATH,
                    data=raw,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
                ),
            )
        except MemberLost as exc:
            raise DecodeNodeLost(str(exc)) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise DecodeNodeLost(f"{node_id}: {exc!r}") from None
        if resp.status == 200:
            return OutputStream(node_id, resp, self._watch)
        try:
            err = ErrorAnswer.decode(await resp.read())
        except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as exc:
            raise DecodeNodeLost(f"{node_id}: {exc!r}") from None
        finally:
            resp.release()
        if resp.status in (502, 503):
            raise DecodeNodeLost(f"{node_id} answered {resp.status}: {err.message}")
        retry = resp.headers.get("Retry-After")
        raise GenerateRefused(resp.status, err, float(retry) if retry and retry.isdigit() else None)


class OutputStream:
    """The outputs a decode node streams back for one forwarded request."""

    def __init__(self, node_id: str, resp: aiohttp.ClientResponse, watch: MemberWatch) -> None:
        self._node_id = node_id
        self._resp: aiohttp.ClientResponse | None = resp
        self._watch = watch
        self._finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        resp = self._resp
        if resp is None or self._finished:
            raise StopAsyncIteration
        node = self._node_id
        try:
            # A frozen node sends nothing and closes nothing: gossip declaring
            # it dead is what ends the wait, and the request resumes elsewhere.
            line = await self._watch.race(node, resp.content.readline())
        except MemberLost as exc:
            raise DecodeNodeLost(str(exc)) from None
        except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as exc:
            raise DecodeNodeLost(f"{node}: {exc!r}") from None
        if not line:
            raise DecodeNodeLost(f"{node} closed the stream before the end")
        try:
            out = decode_output(line)
        except ValueError as exc:
            raise DecodeNodeLost(f"{node} sent garbage: {exc}") from None
        if out.finished:
            self._finished = True
        return out

    async def aclose(self) -> None:
        resp, self._resp = self._resp, None
        if resp is not None:
            # Closing the connection cancels the handler on the decode node,
            # which aborts the request there (and its prefill).
            resp.close()
