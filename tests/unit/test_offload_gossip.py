"""Offload placement's inputs and outputs: the gossiped memory and offload
fields on the wire, the Conductor pairing a decode node with a memory node,
the memory node carried to the decode engine, and ``up --memory``'s plan."""

from __future__ import annotations

import dataclasses
import random

import orjson
import pytest

from mooncakectl.local.plan import entry_index, offload_sections, plan_nodes
from mooncakectl.local.process import _serves
from mooncaked.cluster.conductor import decide
from mooncaked.cluster.costs import NodeCosts, StepCost
from mooncaked.cluster.memory import memory_info
from mooncaked.cluster.placement import Placement, PlacementRequest, Reject
from mooncaked.cluster.slo import Slo
from mooncaked.cluster.state import AttentionShape, ClusterView, MemoryInfo, NodeLoad, OffloadInfo
from mooncaked.cluster.wire import BoundsError, WireError, state_from_json, state_to_json
from mooncaked.engine.offload.client import memory_node_for
from mooncaked.engine.offload.server import AttentionServer
from mooncaked.request import Request, SamplingParams
from mooncaked.wire.generate import GenerateBody
from tests.cluster_views import MODEL, h, node_state
from tests.cluster_views import add_node as add

SHAPE = AttentionShape(4, 8, 2, 64, "bfloat16", 16)
COSTS = NodeCosts(
    step=StepCost(base_s=0.01, token_s=1e-5, seq_s=1e-4, ctx_s=1e-7),
    kv_bytes_per_token=SHAPE.kv_bytes_per_token,
    max_batch=64,
)
GIB = 1 << 30


def mem(
    addr: str = "10.0.0.9:7000", bps: float = 1e10, free: int = GIB, **kw: object
) -> MemoryInfo:
    fields: dict[str, object] = {
        "attention_addr": addr,
        "total_bytes": 2 * GIB,
        "free_bytes": free,
        "num_seqs": 3,
        "kv_read_bps": bps,
        **kw,
    }
    return MemoryInfo(**fields)  # type: ignore[arg-type]


# -- the wire -------------------------------------------------------------------


def test_memory_and_offload_fields_round_trip_and_are_optional() -> None:
    st = node_state("m0", "memory", model="", memory=mem(model=MODEL, shape=SHAPE))
    assert state_from_json(state_to_json(st)) == st
    c = node_state("c0", "decode", offload=OffloadInfo(SHAPE, 2))
    doc = state_to_json(c)
    assert "mem" not in doc and doc["offl"] == [SHAPE.to_list(), 2]
    assert state_from_json(doc) == c
    # An older node's state has neither: both read as None.
    plain = state_to_json(node_state("p0", "prefill"))
    assert "mem" not in plain and "offl" not in plain
    got = state_from_json(plain)
    assert got.memory is None and got.offload is None


def test_a_newer_nodes_longer_lists_decode_and_bad_values_are_refused() -> None:
    doc = state_to_json(node_state("m0", "memory", memory=mem(shape=SHAPE)))
    doc["mem"] = [*doc["mem"], "a field from the future"]
    assert state_from_json(doc).memory == mem(shape=SHAPE)
    over = state_to_json(node_state("m0", "memory", memory=mem(free=3 * GIB)))
    with pytest.raises(BoundsError):
        state_from_json(over)
    odd = state_to_json(node_state("c0", "decode", offload=OffloadInfo(SHAPE)))
    odd["offl"][0][4] = "int8"
    with pytest.raises(BoundsError):
        state_from_json(odd)
    short = state_to_json(node_state("m0", "memory", memory=mem()))
    short["mem"] = short["mem"][:3]
    with pytest.raises(WireError):
        state_from_json(short)


def test_an_unused_memory_node_offers_its_whole_pool() -> None:
    server = AttentionServer(
        node_id="m0", secret=b"secret-secret", host="127.0.0.1", port=0, pool_bytes=64 << 20
    )
    try:
        info = memory_info(server, "10.0.0.9:7000", 2e9, "")
    finally:
        server._executor.shutdown()
    assert info == MemoryInfo("10.0.0.9:7000", 64 << 20, 64 << 20, 0, 2e9, "", None)
    # Unbound, it serves any model; bound, the shape must match, and a
    # configured model must too.
    assert info.serves(MODEL, SHAPE)
    bound = dataclasses.replace(info, shape=SHAPE, model=MODEL)
    assert bound.serves(MODEL, SHAPE)
    assert not bound.serves("other", SHAPE)
    assert not bound.serves(MODEL, dataclasses.replace(SHAPE, dtype="float32"))


# -- placement ------------------------------------------------------------------


def view_of(*memories: tuple[str, MemoryInfo], offload: bool = True) -> ClusterView:
    view = ClusterView("d0", clock=lambda: 0.0)
    add(
        view,
        "d0",
        "both",
        costs=COSTS,
        load=NodeLoad(running_decode_batch=4, decode_context_tokens=4000),
        offload=OffloadInfo(SHAPE, 2) if offload else None,
    )
    for node_id, info in memories:
        add(view, node_id, "memory", model="", memory=info)
    return view


def request(slo: Slo | None = None) -> PlacementRequest:
    return PlacementRequest(MODEL, tuple(h(i) for i in range(4)), 64, max_tokens=32, slo=slo)


def test_the_decode_node_is_paired_with_the_memory_node_of_least_tbt() -> None:
    view = view_of(("m-slow", mem("10.0.0.8:7000", bps=1e9)), ("m-fast", mem(bps=1e11)))
    d = decide(view, request(), rng=random.Random(0))
    p = d.result
    assert isinstance(p, Placement) and p.memory is not None
    assert (p.memory.node_id, p.memory.attention_addr) == ("m-fast", "10.0.0.9:7000")
    (score,) = d.decode
    assert score.offload is not None and p.model_tbt_s == score.tbt_s == score.offload.tbt_s
    doc = d.to_json()
    placed = doc["placement"]
    assert isinstance(placed, dict)
    assert placed["memory"] == {"node": "m-fast", "attention_addr": "10.0.0.9:7000"}
    assert placed["offload"]["attention_s"] == pytest.approx(score.offload.attention_s, abs=1e-6)
    assert "attention on memory node m-fast" in d.why


def test_without_memory_nodes_or_offloading_placement_is_as_before() -> None:
    before = decide(view_of(offload=False), request(), rng=random.Random(0))
    alone = decide(view_of(), request(), rng=random.Random(0))
    assert alone.to_json() == before.to_json()
    untouched = decide(view_of(("m0", mem()), offload=False), request(), rng=random.Random(0))
    assert untouched.to_json() == before.to_json()
    assert isinstance(before.result, Placement) and before.result.memory is None


def test_a_memory_node_that_cannot_serve_the_request_is_passed_over() -> None:
    full = mem(free=1024)
    other_model = mem(model="other")
    other_shape = mem(shape=dataclasses.replace(SHAPE, num_layers=8))
    view = view_of(("m0", full), ("m1", other_model), ("m2", other_shape))
    p = decide(view, request(), rng=random.Random(0)).result
    # Its attention runs on the node itself, as without memory nodes.
    assert isinstance(p, Placement) and p.memory is None


def test_admission_judges_the_offloaded_tbt() -> None:
    slo = Slo(tbt_s=0.05)
    local = decide(view_of(offload=False), request(slo), rng=random.Random(0)).result
    assert isinstance(local, Placement)
    # A memory node that reads KV slowly makes the offloaded step miss the SLO.
    view = view_of(("m0", mem(bps=1e6)))
    rejected = decide(view, request(slo), rng=random.Random(0)).result
    assert isinstance(rejected, Reject) and rejected.code == "tbt_slo"


# -- the request path and tooling ----------------------------------------------


def test_the_memory_node_travels_with_the_generate_body_to_the_request() -> None:
    body = GenerateBody("r1", [1, 2, 3], SamplingParams(max_tokens=4), memory_node="10.0.0.9:7000")

    back = GenerateBody.decode(orjson.loads(body.encode()))
    assert back == body
    req = Request("r1", [1, 2, 3], SamplingParams(), handoff=back.handoff(0.0))
    assert req.memory_node == "10.0.0.9:7000"
    plain = GenerateBody("r2", [1], SamplingParams())
    assert "memory_node" not in orjson.loads(plain.encode())
    assert Request("r2", [1], SamplingParams()).memory_node is None
    with pytest.raises(ValueError, match="memory_node"):
        GenerateBody.decode({**orjson.loads(plain.encode()), "memory_node": "nowhere"})
    assert memory_node_for("10.0.0.9:7000", "auto") == "10.0.0.9:7000"
    assert memory_node_for(None, "auto") == ""
    assert memory_node_for(None, "10.0.0.1:7000") == "10.0.0.1:7000"


def test_up_memory_plans_memory_nodes_after_a_compute_node() -> None:
    plans = plan_nodes(None, None, None, num_memory=2)
    assert [(p.node_id, p.role) for p in plans] == [
        ("compute-0", "both"),
        ("memory-0", "memory"),
        ("memory-1", "memory"),
    ]
    assert entry_index(plans) == 0
    assert offload_sections(plans[0]) == {"offload": {"memory_node": "auto"}}
    assert offload_sections(plans[1]) == {"offload": {"port": 0}}
    dis = plan_nodes(1, 1, None, num_memory=1)
    assert [p.role for p in dis] == ["prefill", "decode", "memory"]
    assert offload_sections(dis[0]) == {}
    with pytest.raises(ValueError, match="--memory"):
        plan_nodes(None, None, None, num_memory=-1)


def test_tooling_counts_a_memory_node_once_its_attention_service_is_known() -> None:
    assert _serves({"api_addr": "a:1", "role": "memory", "memory": {"attention_addr": "a:2"}})
    assert not _serves({"api_addr": "a:1", "role": "memory", "memory": None})
    assert _serves({"api_addr": "a:1", "role": "both", "model_id": MODEL})
    assert not _serves({"api_addr": "a:1", "role": "both", "model_id": ""})
