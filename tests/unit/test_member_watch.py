"""``MemberWatch``: a call to a member is cut when membership says it is lost."""

from __future__ import annotations

import asyncio

import pytest

from mooncaked.cluster.state import ClusterView, Member, MemberStatus
from mooncaked.cluster.watch import MemberLost, MemberWatch


def view_with(
    node_id: str, generation: int, status: MemberStatus = MemberStatus.ALIVE
) -> ClusterView:
    view = ClusterView("me", lambda: 0.0)
    view.members[node_id] = Member(
        node_id, ("127.0.0.1", 1), generation, generation, status, 0.0, 0.0
    )
    return view


async def waiting_call(
    node_id: str, generation: int
) -> tuple[ClusterView, MemberWatch, asyncio.Future[None], asyncio.Future[None]]:
    """A call to a live member that never answers by itself, once it waits:
    the view, the watch, the call's own future and the race."""
    view = view_with(node_id, generation)
    watch = MemberWatch(lambda: view)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    call = asyncio.ensure_future(watch.race(node_id, never))
    await asyncio.sleep(0)
    return view, watch, never, call


async def test_a_call_to_a_node_that_goes_down_is_cut() -> None:
    view, watch, never, call = await waiting_call("p1", 7)
    assert watch.num_waiting == 1
    view.member_event("p2", 3, False)  # another node: nothing happens
    await asyncio.sleep(0)
    assert not call.done()
    view.member_event("p1", 7, False)
    with pytest.raises(MemberLost, match="p1 is down"):
        await call
    # The call itself is cancelled, and nothing is left registered.
    assert never.cancelled() and watch.num_waiting == 0 and watch.num_cut == 1


async def test_a_restart_cuts_but_a_return_of_the_same_process_does_not() -> None:
    view, _watch, _gate, call = await waiting_call("d1", 7)
    view.member_event("d1", 7, True)  # back from suspicion: the same process
    await asyncio.sleep(0)
    assert not call.done()
    view.member_event("d1", 8, True)
    with pytest.raises(MemberLost, match="restarted"):
        await call


async def test_results_pass_through_and_unknown_nodes_are_not_watched() -> None:
    view = view_with("p1", 7)
    watch = MemberWatch(lambda: view)

    async def answer() -> int:
        return 42

    assert await watch.race("p1", answer()) == 42
    assert await watch.race("static-peer", answer()) == 42
    assert await MemberWatch(lambda: None).race("p1", answer()) == 42
    assert watch.num_waiting == 0


async def test_a_member_already_dead_is_lost_at_once() -> None:
    view = view_with("p1", 7, MemberStatus.DEAD)
    watch = MemberWatch(lambda: view)
    never = asyncio.get_running_loop().create_future()
    with pytest.raises(MemberLost, match="dead"):
        await watch.race("p1", never)
