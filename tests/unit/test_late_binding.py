"""Many entries on one gossip view: spread among near-equal candidates, and
late binding at the prefill nodes (their own queues have the last word)."""

from __future__ import annotations

import math
import random
from collections import Counter

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from mooncaked.cluster.admission import Admission
from mooncaked.cluster.costs import NodeCosts, StepCost
from mooncaked.cluster.placement import ConductorParams, Placement, PlacementRequest
from mooncaked.cluster.slo import Slo
from mooncaked.cluster.state import ClusterView, NodeLoad
from mooncaked.engine.connector import ConnectorContext
from mooncaked.engine.handoff import PrefillBusy, PrefillError, PrefillReply
from mooncaked.engine.kv_pool import BlockPool
from mooncaked.engine.kv_receiver import KVReceiver
from mooncaked.engine.late_binding import PrefillWalk
from mooncaked.engine.plan import LoadJob, SampledToken
from mooncaked.handoff import (
    Handoff,
    KVGrant,
    KVLayout,
    PrefillOffer,
    PrefillSource,
    PrefillTarget,
)
from mooncaked.request import Request, SamplingParams
from mooncaked.rpc import Target, derive_key, signed_headers
from mooncaked.wire.handoff import encode_grant
from mooncaked.wire.paths import PREFILL_PATH
from mooncaked.wire.prefill import PrefillClient
from mooncaked.wire.request import encode_sampling
from tests.decode_nodes import bare_disagg_app
from tests.unit.test_conductor_costs import add

# 10 ms a step, 1 ms a prompt token: a 100-token prompt takes 0.11 s anywhere.
COSTS = NodeCosts(StepCost(base_s=0.010, token_s=0.001, seq_s=0.001), kv_bytes_per_token=100)


def cluster(num_prefill: int, num_decode: int) -> ClusterView:
    view = ClusterView("d0", clock=lambda: 0.0)
    for i in range(num_prefill):
        add(view, f"p{i}", "prefill", costs=COSTS, load=NodeLoad())
    for i in range(num_decode):
        add(view, f"d{i}", "decode", costs=COSTS, load=NodeLoad())
    return view


def entries(n: int, params: ConductorParams) -> list[Admission]:
    # Seeded per entry, as the simulator seeds them (the daemon draws its own).
    return [Admission(params, Slo(), rng=random.Random(f"0:e{i}")) for i in range(n)]


def burst(view: ClusterView, params: ConductorParams, n: int) -> list[Placement]:
    """``n`` requests entering ``n`` entries at the same instant, each on the
    same view (none sees the others' placements)."""
    out = []
    for i, adm in enumerate(entries(n, params)):
        hashes = (i.to_bytes(16, "little"),)
        d = adm.place(view, PlacementRequest(view.members["p0"].state.model_id, hashes, 100), 0.0)
        assert isinstance(d.result, Placement)
        out.append(d.result)
    return out


def test_entries_deciding_alone_on_one_view_spread_a_burst() -> None:
    view = cluster(8, 8)
    exact = ConductorParams(spread=0.0, decode_spread=0.0, late_binding=False)
    herd = burst(view, exact, 8)
    # Each picks the best alone: every one the same node.
    assert {p.prefill[0].node_id for p in herd} == {"p0"}
    assert {p.decode.node_id for p in herd} == {"d0"}
    spread = burst(view, ConductorParams(late_binding=False), 8)
    first = Counter(p.prefill[0].node_id for p in spread)
    decode = Counter(p.decode.node_id for p in spread)
    # Picked at random among equals (each entry its own seeded source): the
    # burst lands on 5 of the 8 nodes, both sides (late binding evens out
    # what remains: the next test).
    assert len(first) == 5 and len(decode) == 5, (first, decode)


def test_late_binding_gives_each_prefill_node_of_a_burst_one_request() -> None:
    view = cluster(8, 8)
    queued = dict.fromkeys((f"p{i}" for i in range(8)), 0.0)
    for p in burst(view, ConductorParams(), 8):
        # Offered in turn; each node judges by its own queue, which grows
        # with what it took (0.11 s a request).
        walk = PrefillWalk(p.offers, len(p.prefill), 0.005)
        while (step := walk.next()) is not None:
            i, max_wait = step
            node = p.prefill[i].node_id
            if queued[node] <= max_wait:
                queued[node] += 0.11
                break
        else:
            raise AssertionError("nobody took the request")
    assert sorted(queued.values()) == [pytest.approx(0.11)] * 8


def test_walk_limits_each_candidate_by_those_left_and_lets_the_last_take_it() -> None:
    offers = (
        PrefillOffer(ttft_s=1.0, move_s=0.0, rest_s=1.0),
        PrefillOffer(ttft_s=2.0, move_s=0.0, rest_s=1.5, slack=0.5),
        PrefillOffer(ttft_s=1.2, move_s=0.0, rest_s=1.2),
    )
    walk = PrefillWalk(offers, 3, rtt_s=0.01)
    # The first beats the third (1.2 s two hops away) while its queue is
    # under 1.22 - 1.0 s; its own forecast (no queue, no slack) is lower.
    assert walk.next() == (0, pytest.approx(0.22))
    # The second: its forecast with slack (3.0 s) is above the third's 1.21.
    assert walk.next() == (1, pytest.approx(3.0 - 1.5))
    assert walk.next() == (2, math.inf)
    assert walk.next() is None
    # Without offers (no late binding) every candidate takes the request.
    plain = PrefillWalk((), 2, rtt_s=0.01)
    assert [plain.next(), plain.next(), plain.next()] == [(0, math.inf), (1, math.inf), None]


def test_a_fetch_overlaps_the_queue() -> None:
    o = PrefillOffer(ttft_s=1.5, move_s=0.5, rest_s=1.0)
    assert o.ttft_at(0.2) == 1.5 and o.ttft_at(0.8) == pytest.approx(1.8)


async def test_the_decode_node_asks_the_next_when_a_prefill_node_passes_it_on() -> None:
    asked: list[tuple[str, float]] = []

    async def prefill(
        target: PrefillTarget, req: Request, grant: object, max_wait_s: float
    ) -> PrefillReply:
        asked.append((target.node_id, max_wait_s))
        if target.node_id == "p1":
            raise PrefillBusy("p1: prompts queued here take 5.000 s")
        return PrefillReply(target.node_id, SampledToken(7, None), num_cached_tokens=0)

    receiver = KVReceiver(
        node_id="d1",
        transfer_address="127.0.0.1:1",
        segment="kv",
        layout=KVLayout(num_layers=1, num_blocks=8, block_size=16, row_bytes=8),
        prefill=prefill,
    )
    pool = BlockPool(8)
    receiver.bind(ConnectorContext(pool, [], 16, lambda: None))
    blocks = pool.allocate(3)
    assert blocks is not None
    offers = (PrefillOffer(1.0, 0.0, 1.0), PrefillOffer(1.5, 0.0, 1.5))
    source = PrefillSource(
        (
            PrefillTarget("p1", "http://p1", offer=offers[0]),
            PrefillTarget("p2", "http://p2", offer=offers[1]),
        ),
        hop_s=0.01,
    )
    req = Request(
        "r1", list(range(40)), SamplingParams(max_tokens=4), handoff=Handoff(source=source)
    )
    result = await receiver.load(req, LoadJob("r1", 0, blocks, 39))
    assert result.prefill_node == "p2" and result.sampled == SampledToken(7, None)
    # p1 may take it while its queue is under 1.51 - 1.0 s; p2, the last, always.
    assert asked == [("p1", pytest.approx(0.51)), ("p2", math.inf)]
    assert receiver.stats.passed_on == 1 and receiver.stats.ok == 1
    assert receiver.stats.retried == 0 and receiver.stats.fell_back == 0
    # Answered: nothing outside writes the blocks any more, none is held.
    assert result.hold is None and pool.num_holds == 0
    await receiver.close()
    pool.free(blocks)
    assert pool.num_free_blocks == 8


async def test_a_prefill_node_whose_queue_is_too_long_passes_the_request_on() -> None:
    """The real endpoint and client over HTTP: the node judges the offer by
    its own queue (2 s here) before anything else, and the decode node's
    client reads a refusal as PrefillBusy, not as a failure."""
    secret = b"s" * 32
    api, app = bare_disagg_app(secret, "p1", P1.generation, "prefill", queue_s=2.0)
    async with TestServer(app) as server:
        url = str(server.make_url(""))

        async def call(extra: dict[str, object]) -> tuple[int, dict[str, object]]:
            body = orjson.dumps(
                {
                    "request_id": "r1",
                    "prompt_token_ids": [1, 2, 3],
                    "sampling": encode_sampling(SamplingParams(max_tokens=4)),
                    "grant": encode_grant(GRANT),
                    **extra,
                }
            )
            headers = signed_headers(derive_key(secret), "POST", PREFILL_PATH, body, target=P1)
            async with (
                aiohttp.ClientSession() as session,
                session.post(url.rstrip("/") + PREFILL_PATH, data=body, headers=headers) as r,
            ):
                return r.status, orjson.loads(await r.read())

        status, doc = await call({"max_wait_s": 1.0})
        assert status == 409 and doc["error"]["code"] == "prefill_busy"
        assert "2.000 s" in doc["error"]["message"]
        # Within its limit, or with none, the node goes on (and, not serving
        # in this test, answers 503: nothing was queued by the refusal).
        for extra in ({"max_wait_s": 5.0}, {}):
            status, doc = await call(extra)
            assert status == 503, doc
        status, doc = await call({"max_wait_s": -1.0})
        assert status == 400 and "max_wait_s" in doc["error"]["message"]

        targets = {"p1": P1}
        async with PrefillClient(secret=secret, targets=targets.get) as client:
            target = PrefillTarget("p1", url)
            req = Request("r1", [1, 2, 3], SamplingParams(max_tokens=4))
            with pytest.raises(PrefillBusy, match=r"2\.000 s"):
                await client.prefill(target, req, GRANT, 1.0)
            with pytest.raises(PrefillError) as exc:
                await client.prefill(target, req, GRANT, 5.0)
            assert not isinstance(exc.value, PrefillBusy) and "503" in str(exc.value)
            # Its view says p1 restarted since: the call it signs is refused there.
            targets["p1"] = Target("p1", P1.generation + 1)
            with pytest.raises(PrefillError, match=r"401.*signed for node p1 generation"):
                await client.prefill(target, req, GRANT, 5.0)
            assert api.verifier.num_misdirected == 1
            # Not in its view at all: nothing is sent, rather than a call any node would take.
            del targets["p1"]
            with pytest.raises(PrefillError, match="not in this node's cluster view"):
                await client.prefill(target, req, GRANT, 5.0)
            assert api.verifier.num_unauthorized == 1


P1 = Target("p1", 1_700_000_000_000)
GRANT = KVGrant(
    request_id="r1",
    node_id="d1",
    transfer_address="127.0.0.1:1",
    segment="kv",
    layout=KVLayout(num_layers=1, num_blocks=8, block_size=16, row_bytes=8),
    first_block=0,
    block_ids=(0,),
    ttl_s=5.0,
)
