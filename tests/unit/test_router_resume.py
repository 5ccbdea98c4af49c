"""The router's resume loop against decode nodes played by real servers on
loopback: a stream that dies mid-request goes on on another decode node from
the prompt plus the tokens already sent, a refusal before streaming places
the request again, and the client sees one request throughout."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest

from mooncaked.cluster.state import ClusterView, MemberStatus
from mooncaked.config import ConductorConfig, Config
from mooncaked.engine.core import EngineCore
from mooncaked.engine.loader import load_model
from mooncaked.request import RequestOutput, SamplingParams
from mooncaked.router import MAX_DECODE_ATTEMPTS, RouteError, Router, Submission
from mooncaked.wire.errors import ErrorAnswer
from tests.conftest import wait_until
from tests.decode_nodes import GENERATION, SECRET, DecodeNode, Refuse, Stream, line, serve, view_of
from tests.routers import entry_router

PROMPT = [1, 2, 3, 4]
SAMPLING = SamplingParams(max_tokens=3, temperature=0.0, seed=5)


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineCore]:
    # Never started: the router asks it for the model's id alone.
    yield EngineCore(Config(), load_model(Config().model))


@asynccontextmanager
async def cluster(
    engine: EngineCore, nodes: list[DecodeNode]
) -> AsyncIterator[tuple[Router, ClusterView]]:
    """Entry ``e`` (a prefill node) routing to ``nodes``, and its view of them;
    ties go to the lowest id."""
    async with serve(nodes):
        view = view_of("e", nodes, engine.model_id)
        router = entry_router(
            "e",
            view,
            engine=engine,
            secret=SECRET,
            conductor=ConductorConfig(
                spread=0.0, decode_spread=0.0, late_binding=False, early_reject="off"
            ),
        )
        try:
            yield router, view
        finally:
            await router.close()


def submit(router: Router, sampling: SamplingParams = SAMPLING) -> Submission:
    return router.submit(PROMPT, sampling, "r", [])


def seen(outs: list[RequestOutput]) -> list[tuple[object, ...]]:
    """What the client sees of each output."""
    return [
        (o.request_id, o.new_token_ids, o.num_prompt_tokens, o.num_output_tokens, o.finished)
        for o in outs
    ]


def asked(node: DecodeNode) -> list[tuple[str, list[int], int, int]]:
    """Each call a node had: its request id, prompt, max tokens and output offset."""
    return [
        (c.request_id, c.prompt_token_ids, c.sampling.max_tokens, c.output_offset)
        for c in node.calls
    ]


async def test_a_stream_cut_mid_request_resumes_on_another_node_from_the_tokens_sent(
    engine: EngineCore,
) -> None:
    d1 = DecodeNode("d1", [Stream((line("r~1", [7, 8], prefill_node="p1"),))])
    d2 = DecodeNode("d2", [Stream((line("r~2", [9], finished=True, prefill_node="d2"),))])
    async with cluster(engine, [d1, d2]) as (router, _):
        sub = submit(router)
        outs = [o async for o in sub]
        assert seen(outs) == [("r", [7, 8], 4, 2, False), ("r", [9], 4, 3, True)]
        # The node that computed the prompt, as the first stream said, throughout.
        assert [o.prefill_node for o in outs] == ["p1", "p1"]
        assert asked(d1) == [("r~1", PROMPT, 3, 0)]
        assert asked(d2) == [("r~2", [*PROMPT, 7, 8], 1, 2)]
        # The rest of the sampling travels as it was: the continuation is the same.
        assert d2.calls[0].sampling == dataclasses.replace(SAMPLING, max_tokens=1)
        assert d1.refusals == d2.refusals == [None]
        assert (sub.decode_node, sub.resumed) == ("d2", True)
        assert (router.num_resumed, router.num_replaced) == (1, 0)


async def test_a_node_that_refuses_before_streaming_is_replaced(engine: EngineCore) -> None:
    d1 = DecodeNode("d1", [Refuse(503, ErrorAnswer("draining"))])
    d2 = DecodeNode("d2", [Stream((line("r~2", [7, 8, 9], finished=True),))])
    async with cluster(engine, [d1, d2]) as (router, _):
        sub = submit(router)
        outs = [o async for o in sub]
        assert seen(outs) == [("r", [7, 8, 9], 4, 3, True)]
        assert asked(d1) == [("r~1", PROMPT, 3, 0)]
        assert asked(d2) == [("r~2", PROMPT, 3, 0)]
        assert sub.decode_node == "d2"
        assert (router.num_resumed, router.num_replaced) == (0, 1)


async def test_a_refusal_other_than_gone_reaches_the_client_and_nothing_is_retried(
    engine: EngineCore,
) -> None:
    d1 = DecodeNode("d1", [Refuse(429, ErrorAnswer("queue is full", code="queue_full"), "3")])
    d2 = DecodeNode("d2", [])
    async with cluster(engine, [d1, d2]) as (router, _):
        with pytest.raises(RouteError) as exc:
            await submit(router).__anext__()
        err = exc.value
        assert (err.status, err.message, err.code, err.retry_after_s) == (
            429,
            "queue is full",
            "queue_full",
            3.0,
        )
        assert len(d1.calls) == 1 and d2.calls == []
        assert (router.num_resumed, router.num_replaced) == (0, 0)


async def test_a_frozen_node_gossip_declares_dead_is_hung_up_on_and_the_request_resumes(
    engine: EngineCore,
) -> None:
    d1 = DecodeNode("d1", [Stream((line("r~1", [7]),), hang=True)])
    d2 = DecodeNode("d2", [Stream((line("r~2", [8, 9], finished=True),))])
    async with cluster(engine, [d1, d2]) as (router, view):
        sub = submit(router)
        assert (await sub.__anext__()).new_token_ids == [7]
        rest = asyncio.ensure_future(sub.__anext__())
        await wait_until(lambda: router.watch.num_waiting == 1, "the read to wait on d1")
        view.members["d1"].status = MemberStatus.DEAD
        view.member_event("d1", GENERATION, False)
        assert seen([await rest]) == [("r", [8, 9], 4, 3, True)]
        assert asked(d2) == [("r~2", [*PROMPT, 7], 2, 1)]
        # The stream left behind is closed: d1 sees its caller hang up.
        await wait_until(lambda: d1.num_hung_up == 1, "d1 to see the hang-up")
        assert router.num_resumed == 1


async def test_a_request_is_tried_on_a_bounded_number_of_decode_nodes(engine: EngineCore) -> None:
    nodes = [
        DecodeNode(f"d{i}", [Stream((line(f"r~{i}", [10 + i]),))])
        for i in range(1, MAX_DECODE_ATTEMPTS + 2)
    ]
    async with cluster(engine, nodes) as (router, _):
        sub = submit(router, SamplingParams(max_tokens=10))
        outs: list[RequestOutput] = []
        with pytest.raises(RouteError) as exc:
            async for out in sub:
                outs.append(out)
        assert (exc.value.status, exc.value.message) == (
            503,
            f"the request failed on {MAX_DECODE_ATTEMPTS} decode node(s); retry later",
        )
        # One token from each, each node asked from where the last left off.
        assert seen(outs) == [
            ("r", [10 + i], 4, i, False) for i in range(1, MAX_DECODE_ATTEMPTS + 1)
        ]
        assert [asked(n) for n in nodes] == [
            [(f"r~{i}", PROMPT + [10 + j for j in range(1, i)], 11 - i, i - 1)]
            for i in range(1, MAX_DECODE_ATTEMPTS + 1)
        ] + [[]]
        assert router.num_resumed == MAX_DECODE_ATTEMPTS


async def test_closing_a_submission_hangs_up_on_its_decode_node(engine: EngineCore) -> None:
    d1 = DecodeNode("d1", [Stream((line("r~1", [7]),), hang=True)])
    async with cluster(engine, [d1]) as (router, _):
        sub = submit(router)
        assert (await sub.__anext__()).new_token_ids == [7]
        await sub.aclose()
        await wait_until(lambda: d1.num_hung_up == 1, "d1 to see the hang-up")
        with pytest.raises(StopAsyncIteration):
            await sub.__anext__()
        assert router.num_resumed == 0
