"""Decode nodes played by real aiohttp servers on loopback, for unit tests of
the entry's side of ``/internal/generate`` (``GenerateClient``, the router's
resume loop).

A ``DecodeNode`` answers each call with the next of its ``answers``: a
``Stream`` of output lines (then the end of the body, or a stream held open
until the caller hangs up), or a ``Refuse``al. It keeps every call's body as
``GenerateBody.decode`` reads it and whether its signature held for this
node (``Verifier.verify``: None when it did).

``bare_disagg_app`` is the other way round: a node's real internal
endpoints, with no engine behind them, for tests of what they refuse.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import orjson
from aiohttp import web

from mooncaked.api.disagg import DisaggAPI
from mooncaked.cluster.state import ClusterView
from mooncaked.request import FinishReason, RequestOutput
from mooncaked.rpc import Target, Verifier
from mooncaked.wire.errors import ErrorAnswer
from mooncaked.wire.generate import GenerateBody
from mooncaked.wire.paths import GENERATE_PATH
from mooncaked.wire.request import encode_output
from tests.cluster_views import add_node
from tests.conftest import serving

SECRET = b"decode-nodes-secret"
# The generation ``tests.cluster_views.member`` gives every member.
GENERATION = 1


def line(rid: str, tokens: Sequence[int], *, finished: bool = False, **fields: object) -> bytes:
    """One output line as a decode node writes it."""
    out = RequestOutput(
        rid,
        list(tokens),
        "",
        finished,
        finish_reason=FinishReason.LENGTH if finished else None,
        **fields,  # type: ignore[arg-type]
    )
    return encode_output(out)


@dataclass(frozen=True, slots=True)
class Stream:
    """A 200 with these lines; then the body ends, or with ``hang`` it stays
    open with nothing more sent (a frozen node) until the caller hangs up."""

    lines: tuple[bytes, ...]
    hang: bool = False


@dataclass(frozen=True, slots=True)
class Refuse:
    status: int
    answer: ErrorAnswer
    retry_after: str | None = None


class DecodeNode:
    def __init__(self, node_id: str, answers: list[Stream | Refuse]) -> None:
        self.node_id = node_id
        self.answers = answers
        self.port: int | None = None
        self.calls: list[GenerateBody] = []
        # Per call: why its signature was refused (None: it held).
        self.refusals: list[str | None] = []
        # Streams the caller hung up on while they were held open.
        self.num_hung_up = 0

    @property
    def api_addr(self) -> str:
        if self.port is None:
            raise RuntimeError(f"{self.node_id} is not serving")
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.api_addr}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        verifier = Verifier(SECRET, identity=lambda: Target(self.node_id, GENERATION))
        self.refusals.append(verifier.verify("POST", GENERATE_PATH, request.headers, raw))
        self.calls.append(GenerateBody.decode(orjson.loads(raw)))
        if not self.answers:
            raise RuntimeError(f"{self.node_id} was called more often than scripted")
        answer = self.answers.pop(0)
        if isinstance(answer, Refuse):
            headers = {"Retry-After": answer.retry_after} if answer.retry_after else None
            return web.Response(status=answer.status, body=answer.answer.encode(), headers=headers)
        resp = web.StreamResponse()
        await resp.prepare(request)
        for data in answer.lines:
            await resp.write(data)
        if answer.hang:
            try:
                await asyncio.Event().wait()
            finally:
                # The server cancels a handler whose caller hung up.
                self.num_hung_up += 1
        await resp.write_eof()
        return resp


@asynccontextmanager
async def serve(nodes: Sequence[DecodeNode]) -> AsyncIterator[None]:
    """Each node on a loopback port of its own while the block runs."""
    async with AsyncExitStack() as stack:
        for node in nodes:
            app = web.Application()
            app.router.add_post(GENERATE_PATH, node.handle)
            # A caller that hangs up cancels the handler, as on a node.
            node.port = await stack.enter_async_context(serving(app, handler_cancellation=True))
        yield


def bare_disagg_app(
    secret: bytes, node_id: str, generation: int, role: str, queue_s: float = 0.0
) -> tuple[DisaggAPI, web.Application]:
    """``node_id``'s disaggregation endpoints (not draining, no engine, no
    sender; ``queue_s`` of prefill queue), and an app that serves them."""
    api = DisaggAPI(
        secret=secret,
        node_id=lambda: node_id,
        generation=generation,
        role=role,
        engine=lambda: None,
        sender=lambda: None,
        draining=lambda: False,
        queue_s=lambda: queue_s,
    )
    app = web.Application()
    app.add_routes(api.routes())
    return api, app


def view_of(entry: str, nodes: Sequence[DecodeNode], model: str) -> ClusterView:
    """A view from ``entry`` (a prefill node) of itself and ``nodes`` as decode nodes."""
    view = ClusterView(entry, clock=lambda: 0.0)
    add_node(view, entry, "prefill", model=model)
    for node in nodes:
        add_node(view, node.node_id, "decode", model=model, api_addr=node.api_addr)
    return view
