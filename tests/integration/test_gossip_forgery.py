"""Forged membership news on real loopback sockets: no packet cuts a node out for good.

Three ``ClusterService`` nodes in one event loop. Someone holding the
cluster secret signs one ``alive`` (with an address where nobody listens) or
one ``suspect`` about s0, sends it from a socket of its own, and s0 is then
frozen or restarted. Whatever the claim's incarnation, the restarted s0 must
be back in every member's view, alive at its real address in its new
generation, within the bound below.

Every wait is a correctness bound, never a timing measurement; the time to
recover is printed.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import pytest

from mooncaked.cluster import wire
from mooncaked.cluster.gossip.service import ClusterService, DropPeers
from mooncaked.cluster.state import LocalState, MemberStatus
from tests.gossip_nodes import FAST, seeded, wait_for

SECRET = b"forgery-test-cluster-secret"
# What the restarted node must meet: back in every view within this.
RECOVERY_BOUND_S = 10.0

pytestmark = pytest.mark.timeout(120)


def seen_by_all(services: list[ClusterService], node: ClusterService) -> bool:
    """Every service holds ``node`` alive at its address, in its generation."""
    for s in services:
        m = s.view.members.get(node.node_id)
        if (
            m is None
            or m.status is not MemberStatus.ALIVE
            or m.addr != node.gossip_addr
            or m.generation != node.core.generation
        ):
            return False
    return True


@pytest.fixture
async def trio() -> AsyncIterator[list[ClusterService]]:
    services: list[ClusterService] = []
    try:
        first = ClusterService(FAST, "s0", SECRET, local_state=lambda: LocalState(model_id="m"))
        await first.start()
        services.append(first)
        for i in (1, 2):
            s = ClusterService(seeded(first), f"s{i}", SECRET, local_state=LocalState)
            assert await s.start() == 1
            services.append(s)
        await wait_for(lambda: all(seen_by_all(services, s) for s in services), 10)
        yield services
    finally:
        for s in services:
            await s.close()


def send_forged(claim: dict[str, object], *to: ClusterService) -> None:
    """Signs ``claim`` with the cluster secret and sends it from a socket of no member."""
    packet = wire.Codec(SECRET, "intruder").seal([wire.msg_frame(claim)])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for s in to:
            sock.sendto(packet, s.gossip_addr)


def claimed_incarnation(which: str, *, accusation: bool) -> int:
    if which == "top":
        return wire.MAX_INCARNATION - 1 if accusation else wire.MAX_INCARNATION
    # The highest a receiver accepts: as far ahead of its wall clock as allowed.
    return time.time_ns() // 1_000_000 + int(FAST.max_clock_skew_s * 1000)


async def restart(trio: list[ClusterService], which: str, label: str) -> ClusterService:
    """Stops s0 (a crash: no leave) and starts a new s0, on a new port, through s1 and s2."""
    old, s1, s2 = trio
    await old.close()
    started = time.monotonic()
    new = ClusterService(seeded(s1, s2), "s0", SECRET, local_state=LocalState)
    trio[0] = new
    await new.start()
    await wait_for(lambda: seen_by_all(trio, new), RECOVERY_BOUND_S)
    print(
        f"\n{label}: restarted s0 back in every view {time.monotonic() - started:.2f} s after start"
    )
    if which == "top":
        # Refused on receipt: nothing was there to outrank.
        assert s1.counters.dropped_invalid >= 1
    else:
        # Its old entry outranked its new generation: it had to refute it.
        assert new.counters.refutations >= 1
        assert new.core.incarnation > new.core.generation
    assert new.counters.handler_errors == 0
    # The new s0's own view may still carry a suspicion the old s0 spread
    # while frozen (relayed by s1 or s2 before their refutation reached it):
    # it must clear within the same bound, not be gone at this instant.
    await wait_for(
        lambda: all(m.status is MemberStatus.ALIVE for m in new.view.members.values()),
        RECOVERY_BOUND_S,
    )
    return new


@pytest.mark.parametrize("which", ["top", "highest_accepted"])
async def test_a_forged_alive_then_a_restart(trio: list[ClusterService], which: str) -> None:
    s0, s1, s2 = trio
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as unused:
        unused.bind(("127.0.0.1", 0))
        nowhere = unused.getsockname()
    send_forged(
        {
            "t": "alive",
            "node": "s0",
            "inc": claimed_incarnation(which, accusation=False),
            "gen": s0.core.generation,
            "addr": list(nowhere),
        },
        s1,
        s2,
    )
    # Taken or refused, the claim reached both (each packet moves a counter).
    await wait_for(lambda: s1.counters.packets_received > 0 and s2.counters.packets_received > 0, 5)
    await asyncio.sleep(FAST.probe_interval_s * 2)
    await restart(trio, which, f"forged alive ({which})")


@pytest.mark.parametrize("which", ["top", "highest_accepted"])
async def test_a_forged_suspicion_a_freeze_then_a_restart(
    trio: list[ClusterService], which: str
) -> None:
    s0, s1, s2 = trio
    # s0 hears and answers nothing for longer than the suspect timeout.
    s0.set_packet_filter(DropPeers(frozenset({"s1", "s2", "intruder"})))
    send_forged(
        {
            "t": "suspect",
            "node": "s0",
            "inc": claimed_incarnation(which, accusation=True),
            "from": "s2",
        },
        s1,
    )
    await wait_for(
        lambda: all(s.view.members["s0"].status is MemberStatus.DEAD for s in (s1, s2)),
        FAST.probe_interval_s * 4 + FAST.suspect_timeout_s + 5,
    )
    s0.set_packet_filter(None)
    # Unfrozen, s0 answers for itself.
    await wait_for(lambda: seen_by_all(trio, s0), RECOVERY_BOUND_S)
    await restart(trio, which, f"forged suspect ({which}) and a freeze")
