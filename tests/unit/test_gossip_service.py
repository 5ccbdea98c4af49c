"""ClusterService on real loopback sockets, several in one event loop."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator

import orjson
import pytest

from mooncaked.cluster import wire
from mooncaked.cluster.gossip.service import ClusterService, DropPeers
from mooncaked.cluster.state import BlockOp, LocalState, MemberStatus, NodeLoad, Tier
from tests.gossip_nodes import FAST, seeded, wait_for

SECRET = b"service-test-secret"


def all_alive(services: list[ClusterService]) -> bool:
    ids = {s.node_id for s in services}
    return all(
        set(s.view.members) >= ids
        and all(s.view.members[i].status is MemberStatus.ALIVE for i in ids)
        for s in services
    )


@pytest.fixture
async def trio() -> AsyncIterator[list[ClusterService]]:
    loads = {f"s{i}": LocalState(role="both", model_id="m") for i in range(3)}
    services: list[ClusterService] = []
    try:
        first = ClusterService(FAST, "s0", SECRET, local_state=lambda: loads["s0"])
        await first.start()
        services.append(first)
        for i in (1, 2):
            s = ClusterService(
                seeded(first), f"s{i}", SECRET, local_state=lambda i=i: loads[f"s{i}"]
            )
            assert await s.start() == 1
            services.append(s)
        await wait_for(lambda: all_alive(services), 10)
        yield services
    finally:
        for s in services:
            await s.close()


async def test_blocks_segments_and_leave_over_real_sockets(trio: list[ClusterService]) -> None:
    s0, s1, s2 = trio
    hashes = [os.urandom(16) for _ in range(300)]
    assert s1.publish_block_events([(h, Tier.DRAM, BlockOp.STORED) for h in hashes]) == 300
    s1.set_segments([{"name": "dram", "port": 1234, "length": 4096}])
    await wait_for(
        lambda: all(
            s.view.num_cached_blocks("s1") == 300
            and s.view.members["s1"].segments == ({"name": "dram", "port": 1234, "length": 4096},)
            for s in trio
        ),
        10,
    )
    assert s0.view.longest_prefix(hashes)["s1"].num_blocks == 300
    assert s1.counters.bytes_sent > 0 and s0.counters.packets_received > 0

    await s2.leave()
    await wait_for(
        lambda: (
            s0.view.members["s2"].status is MemberStatus.LEFT
            and s1.view.members["s2"].status is MemberStatus.LEFT
        ),
        5,
    )
    await s2.close()


async def test_forgeries_and_garbage_do_not_disturb(trio: list[ClusterService]) -> None:
    s0 = trio[0]
    forger = wire.Codec(b"not-the-cluster-secret", "s1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(os.urandom(300), ("127.0.0.1", s0.gossip_port))
        sock.sendto(
            forger.seal([wire.msg_frame({"t": "dead", "node": "s1", "inc": 10**15, "from": "x"})]),
            ("127.0.0.1", s0.gossip_port),
        )
        sock.sendto(b"z" * 3000, ("127.0.0.1", s0.gossip_port))
    # A TCP peer that sends a huge length prefix, one that sends junk, one that hangs up.
    for payload in (b"\xff\xff\xff\x7f", b"\x28\x00\x00\x00" + os.urandom(40), b""):
        _, writer = await asyncio.open_connection("127.0.0.1", s0.gossip_port)
        writer.write(payload)
        await writer.drain()
        writer.close()
    await wait_for(
        lambda: (
            s0.counters.dropped_bad_mac >= 3
            and s0.counters.dropped_oversize >= 1
            and s0.counters.dropped_malformed >= 1
        ),
        5,
    )
    # The loop survived it all: the cluster is (still, or again) whole.
    await wait_for(lambda: all_alive(trio), 10)
    assert s0.counters.handler_errors == 0


async def test_crashed_service_is_declared_dead_then_rejoins(
    trio: list[ClusterService],
) -> None:
    s0, s1, s2 = trio
    port = s2.gossip_port
    # close() without leave(): to the others it is a crash.
    await s2.close()
    await wait_for(
        lambda: (
            s0.view.members["s2"].status is MemberStatus.DEAD
            and s1.view.members["s2"].status is MemberStatus.DEAD
        ),
        FAST.probe_interval_s * 4 + FAST.suspect_timeout_s + 5,
    )
    again = ClusterService(
        seeded(s0, gossip_port=port),
        "s2",
        SECRET,
        local_state=lambda: LocalState(load=NodeLoad(queued_prefill_tokens=99)),
    )
    trio[2] = again
    await again.start()
    await wait_for(lambda: all_alive(trio), 10)
    st = s0.view.members["s2"].state
    assert st is not None and st.load.queued_prefill_tokens == 99
    assert s0.view.members["s2"].generation == again.core.generation


async def test_a_packet_filter_partitions_one_node_until_it_is_removed(
    trio: list[ClusterService],
) -> None:
    s0, s1, s2 = trio
    # Everything s2 sends or receives from the others is lost, both ways, UDP and TCP.
    s2.set_packet_filter(DropPeers(frozenset({"s0", "s1"})))
    await wait_for(
        lambda: (
            s0.view.members["s2"].status is MemberStatus.DEAD
            and s1.view.members["s2"].status is MemberStatus.DEAD
            and s2.view.members["s0"].status is MemberStatus.DEAD
            and s2.view.members["s1"].status is MemberStatus.DEAD
        ),
        FAST.probe_interval_s * 4 + FAST.suspect_timeout_s + 5,
    )
    assert s2.counters.dropped_blocked > 0
    assert s0.counters.dropped_blocked == 0 and s1.counters.dropped_blocked == 0
    s2.set_packet_filter(None)
    await wait_for(lambda: all_alive(trio), 10)


async def test_a_dead_protocol_loop_reaches_on_failure() -> None:
    failures: list[BaseException] = []
    failed = asyncio.Event()
    broken = False

    def clock() -> float:
        if broken:
            raise RuntimeError("clock source failed")
        return time.monotonic()

    def on_failure(exc: BaseException) -> None:
        failures.append(exc)
        failed.set()

    service = ClusterService(FAST, "lone", SECRET, clock=clock, on_failure=on_failure)
    await service.start()
    try:
        broken = True
        # The loop reads the clock at its next deadline (a gossip interval away).
        await asyncio.wait_for(failed.wait(), 10)
    finally:
        await service.close()
    assert [str(e) for e in failures] == ["clock source failed"]


async def test_one_signed_packet_at_the_top_incarnation_removes_no_one(
    trio: list[ClusterService],
) -> None:
    s0, s1, s2 = trio
    inc0 = s0.core.incarnation
    insider = wire.Codec(SECRET, "s2")
    attack = insider.seal(
        [wire.msg_frame({"t": "suspect", "node": "s0", "inc": 2**64 - 1, "from": "s2"})]
    )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(attack, ("127.0.0.1", s1.gossip_port))
        sock.sendto(attack, ("127.0.0.1", s0.gossip_port))
    await wait_for(lambda: s0.counters.dropped_invalid == 1 and s1.counters.dropped_invalid == 1, 5)
    # Accepted, the suspicion would show at once (s1 marks s0 suspect on receipt).
    assert all_alive(trio) and s0.core.incarnation == inc0
    assert s0.counters.handler_errors == 0 and s1.counters.handler_errors == 0
    # What /admin/cluster serves still encodes, and the graceful leave still works.
    for s in trio:
        assert orjson.loads(orjson.dumps(s.view.to_json()))["self"] == s.node_id
    await s0.leave()
    await wait_for(
        lambda: all(s.view.members["s0"].status is MemberStatus.LEFT for s in (s1, s2)), 5
    )
