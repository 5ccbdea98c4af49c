"""The entry's side of ``/internal/generate`` against a real server on loopback:
what ``GenerateClient.open`` sends and makes of each answer, and how an
``OutputStream`` ends (the last output, a cut, garbage, a node gossip lost)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
import pytest_asyncio

from mooncaked.cluster.state import ClusterView
from mooncaked.cluster.watch import MemberWatch
from mooncaked.request import SamplingParams
from mooncaked.rpc import Target, derive_key
from mooncaked.wire.errors import ErrorAnswer
from mooncaked.wire.generate import (
    DecodeNodeLost,
    GenerateBody,
    GenerateClient,
    GenerateRefused,
    OutputStream,
)
from tests.conftest import wait_until
from tests.decode_nodes import GENERATION, SECRET, DecodeNode, Refuse, Stream, line, serve, view_of

BODY = GenerateBody("r~2", [5, 6, 7], SamplingParams(max_tokens=3), output_offset=2)


class Rig:
    def __init__(self, node: DecodeNode, session: aiohttp.ClientSession) -> None:
        self.node = node
        self.view: ClusterView = view_of("e", [node], "m")
        self.watch = MemberWatch(lambda: self.view)
        self.client = GenerateClient(
            key=derive_key(SECRET),
            session=lambda: session,
            targets=self.target_of,
            watch=self.watch,
        )

    def target_of(self, node_id: str) -> Target | None:
        member = self.view.get(node_id)
        return Target(node_id, member.generation) if member is not None else None

    async def open(self) -> OutputStream:
        return await self.client.open(self.node.node_id, self.node.url, BODY)


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@asynccontextmanager
async def rig_for(
    answers: list[Stream | Refuse], session: aiohttp.ClientSession
) -> AsyncIterator[Rig]:
    node = DecodeNode("d1", answers)
    async with serve([node]):
        yield Rig(node, session)


async def tokens(stream: OutputStream) -> list[list[int]]:
    return [out.new_token_ids async for out in stream]


async def test_a_call_is_signed_for_the_node_and_read_back_up_to_its_last_output(
    session: aiohttp.ClientSession,
) -> None:
    lines = (line("r~2", [1, 2]), line("r~2", [3], finished=True), line("r~2", [4]))
    async with rig_for([Stream(lines)], session) as rig:
        stream = await rig.open()
        # The line after the last output is never read.
        assert await tokens(stream) == [[1, 2], [3]]
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        await stream.aclose()
        assert rig.node.calls == [BODY] and rig.node.refusals == [None]


async def test_a_node_not_in_the_view_is_lost_without_a_call(
    session: aiohttp.ClientSession,
) -> None:
    async with rig_for([Stream(())], session) as rig:
        del rig.view.members["d1"]
        with pytest.raises(DecodeNodeLost, match="d1 is not in this node's cluster view"):
            await rig.open()
        assert rig.node.calls == []


async def test_an_unreachable_node_is_lost(session: aiohttp.ClientSession) -> None:
    view = view_of("e", [], "m")
    client = GenerateClient(
        key=derive_key(SECRET),
        session=lambda: session,
        targets=lambda node_id: Target(node_id, GENERATION),
        watch=MemberWatch(lambda: view),
    )
    # Port 1 on loopback: nothing listens there.
    with pytest.raises(DecodeNodeLost, match=r"^d9: ClientConnectorError"):
        await client.open("d9", "http://127.0.0.1:1", BODY)


@pytest.mark.parametrize("status", [502, 503])
async def test_a_gateway_or_unavailable_answer_is_a_lost_node(
    status: int, session: aiohttp.ClientSession
) -> None:
    async with rig_for([Refuse(status, ErrorAnswer("draining"))], session) as rig:
        with pytest.raises(DecodeNodeLost) as exc:
            await rig.open()
        assert str(exc.value) == f"d1 answered {status}: draining"


@pytest.mark.parametrize(("retry_after", "retry_after_s"), [("7", 7.0), ("soon", None)])
async def test_any_other_refusal_is_passed_on_with_what_the_node_said(
    retry_after: str, retry_after_s: float | None, session: aiohttp.ClientSession
) -> None:
    said = ErrorAnswer("queue is full", code="queue_full")
    async with rig_for([Refuse(429, said, retry_after)], session) as rig:
        with pytest.raises(GenerateRefused) as exc:
            await rig.open()
        refused = exc.value
        assert (refused.status, refused.answer, refused.retry_after_s) == (
            429,
            said,
            retry_after_s,
        )


async def test_a_stream_cut_before_its_last_output_is_a_lost_node(
    session: aiohttp.ClientSession,
) -> None:
    async with rig_for([Stream((line("r~2", [1]),))], session) as rig:
        stream = await rig.open()
        assert (await stream.__anext__()).new_token_ids == [1]
        with pytest.raises(DecodeNodeLost, match=r"^d1 closed the stream before the end$"):
            await stream.__anext__()
        await stream.aclose()


async def test_a_line_that_is_not_an_output_is_a_lost_node(
    session: aiohttp.ClientSession,
) -> None:
    async with rig_for([Stream((b'{"request_id": 3}\n',))], session) as rig:
        stream = await rig.open()
        with pytest.raises(DecodeNodeLost) as exc:
            await stream.__anext__()
        assert str(exc.value) == (
            "d1 sent garbage: 'request_id' must be a string of 1..512 characters, got 3"
        )
        await stream.aclose()


async def test_a_frozen_node_is_cut_when_gossip_loses_it_and_closing_hangs_up(
    session: aiohttp.ClientSession,
) -> None:
    async with rig_for([Stream((line("r~2", [1]),), hang=True)], session) as rig:
        stream = await rig.open()
        assert (await stream.__anext__()).new_token_ids == [1]
        waiting = stream.__anext__()
        task = asyncio.ensure_future(waiting)
        await wait_until(lambda: rig.watch.num_waiting == 1, "the read to wait on d1")
        rig.view.member_event("d1", GENERATION, False)
        with pytest.raises(DecodeNodeLost, match="d1 is down"):
            await task
        assert rig.node.num_hung_up == 0
        await stream.aclose()
        await wait_until(lambda: rig.node.num_hung_up == 1, "d1 to see the hang-up")
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
