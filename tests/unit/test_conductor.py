"""``conductor.decide`` on constructed gossip views: exact choices, every branch."""

from __future__ import annotations

import random
from typing import Any

from mooncaked.cluster.conductor import decide
from mooncaked.cluster.placement import Placement, PlacementRequest, Reject
from mooncaked.cluster.state import ClusterView, MemberStatus, NodeLoad
from tests.cluster_views import EXACT, MODEL, h
from tests.cluster_views import add_node as add


def place(view: ClusterView, request: PlacementRequest, **options: Any) -> Placement | Reject:
    """Where ``decide`` runs ``request``, or why not."""
    return decide(view, request, **options).result


def request(n: int = 4) -> PlacementRequest:
    return PlacementRequest(MODEL, tuple(h(i) for i in range(n)), n * 16)


def ids(p: Placement | Reject) -> tuple[str, tuple[str, ...]]:
    assert isinstance(p, Placement), p
    return p.decode.node_id, tuple(c.node_id for c in p.prefill)


def test_a_single_both_node_does_everything() -> None:
    view = ClusterView("a", clock=lambda: 0.0)
    add(view, "a", "both")
    p = place(view, request(), rng=random.Random(0), params=EXACT)
    assert ids(p) == ("a", ()) and isinstance(p, Placement) and p.colocated


def test_a_both_entry_serves_what_enters_it() -> None:
    view = ClusterView("a", clock=lambda: 0.0)
    add(view, "a", "both", load=NodeLoad(queued_prefill_tokens=10))
    add(view, "b", "both", cached=3)
    assert ids(place(view, request(), rng=random.Random(0), params=EXACT)) == ("a", ())


def test_both_nodes_colocate_on_the_least_work_queued_plus_uncached() -> None:
    # The entry cannot serve (draining): the best of the others does it all.
    # Costs unknown: queued tokens + tokens to compute rank the nodes.
    view = ClusterView("e", clock=lambda: 0.0)
    add(view, "e", "both", draining=True)
    add(view, "a", "both", load=NodeLoad(queued_prefill_tokens=10))
    add(view, "b", "both", load=NodeLoad(queued_prefill_tokens=20), cached=3)
    add(view, "c", "both", load=NodeLoad(queued_prefill_tokens=500), cached=3)
    add(view, "d", "both")
    assert ids(place(view, request(), rng=random.Random(0), params=EXACT)) == ("b", ())  # 20 + 16
    assert ids(
        place(view, request(), rng=random.Random(0), params=EXACT, exclude=frozenset({"b"}))
    ) == (
        "d",
        (),
    )  # 0 + 64


def test_dedicated_roles_disaggregate() -> None:
    view = ClusterView("p1", clock=lambda: 0.0)
    add(view, "p1", "prefill", load=NodeLoad(queued_prefill_tokens=100))
    add(view, "p2", "prefill", cached=2)
    add(view, "p3", "prefill")
    add(view, "d1", "decode", load=NodeLoad(running_decode_batch=5))
    add(view, "d2", "decode", load=NodeLoad(running_decode_batch=1, kv_usage=0.5))
    add(view, "d3", "decode", load=NodeLoad(running_decode_batch=1, kv_usage=0.1))
    # Decode: fewest decodes, then KV usage; prefill: longest cached prefix,
    # then shortest queue, up to three to try in order.
    assert ids(place(view, request(), rng=random.Random(0), params=EXACT)) == (
        "d3",
        ("p2", "p3", "p1"),
    )
    assert ids(place(view, request(), rng=random.Random(0), params=EXACT, max_prefill=1)) == (
        "d3",
        ("p2",),
    )


def test_roles_never_get_what_they_cannot_serve() -> None:
    view = ClusterView("p1", clock=lambda: 0.0)
    add(view, "p1", "prefill")
    add(view, "b1", "both")
    # A both node decodes; the prefill node prefills.
    assert ids(place(view, request(), rng=random.Random(0), params=EXACT)) == ("b1", ("p1",))
    view2 = ClusterView("p1", clock=lambda: 0.0)
    add(view2, "p1", "prefill")
    add(view2, "p2", "prefill")
    r = place(view2, request(), rng=random.Random(0), params=EXACT)
    assert isinstance(r, Reject) and r.status == 503 and "no decode node" in r.reason


def test_a_decode_node_without_a_prefill_node_prefills_itself() -> None:
    view = ClusterView("d1", clock=lambda: 0.0)
    add(view, "d1", "decode")
    add(view, "p1", "prefill", status=MemberStatus.DEAD)
    add(view, "p2", "prefill", draining=True)
    p = place(view, request(), rng=random.Random(0), params=EXACT)
    assert ids(p) == ("d1", ())


def test_dead_draining_other_models_and_excluded_nodes_are_left_out() -> None:
    view = ClusterView("d1", clock=lambda: 0.0)
    add(view, "d1", "decode", status=MemberStatus.DEAD)
    add(view, "d2", "decode", draining=True)
    add(view, "d3", "decode", model="other")
    add(view, "d4", "decode")
    add(view, "d5", "decode", status=MemberStatus.LEFT)
    add(view, "p1", "prefill")
    assert ids(place(view, request(), rng=random.Random(0), params=EXACT)) == ("d4", ("p1",))
    r = place(view, request(), rng=random.Random(0), params=EXACT, exclude=frozenset({"d4"}))
    assert isinstance(r, Reject) and "no decode node" in r.reason
    empty = ClusterView("x", clock=lambda: 0.0)
    add(empty, "x", "both", model="other")
    r = place(empty, request(), rng=random.Random(0), params=EXACT)
    assert isinstance(r, Reject) and r.status == 503 and repr(MODEL) in r.reason


def test_suspects_come_after_every_alive_node() -> None:
    view = ClusterView("d1", clock=lambda: 0.0)
    add(view, "d1", "decode", status=MemberStatus.SUSPECT)
    add(view, "d2", "decode", load=NodeLoad(running_decode_batch=50))
    add(view, "p1", "prefill", status=MemberStatus.SUSPECT, cached=4)
    add(view, "p2", "prefill")
    assert ids(place(view, request(), rng=random.Random(0), params=EXACT)) == ("d2", ("p2", "p1"))
    # A suspect rather than no node at all.
    assert ids(
        place(view, request(), rng=random.Random(0), params=EXACT, exclude=frozenset({"d2"}))
    ) == (
        "d1",
        ("p2", "p1"),
    )
