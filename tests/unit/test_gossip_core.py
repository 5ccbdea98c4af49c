"""The gossip protocol on an injected clock over an in-memory network.

``SimNet`` moves the cores' datagrams instantly, runs their TCP exchanges
(sync, pull) as direct calls, and advances a fake clock from deadline to
deadline, so every run is deterministic and takes no wall time.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest
from structlog.testing import capture_logs

from mooncaked.cluster import wire
from mooncaked.cluster.gossip.core import GossipCore
from mooncaked.cluster.state import BlockDelta, BlockOp, LocalState, MemberStatus, NodeLoad, Tier
from mooncaked.config import ClusterConfig

SECRET = b"test-cluster-secret"
Addr = tuple[str, int]


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class SimNet:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.clock = FakeClock()
        self.cores: dict[Addr, GossipCore] = {}
        self.down: set[str] = set()
        # Pairs of nodes that cannot reach each other (a partition).
        self.cut: set[frozenset[str]] = set()
        self.paused: dict[str, list[tuple[bytes, Addr]]] = {}
        self.loads: dict[str, LocalState] = {}
        # Status history per (observer, target): what each node believed, in order.
        self.history: dict[tuple[str, str], list[MemberStatus]] = {}
        # How far a node's wall clock runs ahead of the others', in milliseconds.
        self.clock_ahead_ms: dict[str, int] = {}

    def addr_of(self, node_id: str) -> Addr:
        for addr, core in self.cores.items():
            if core.node_id == node_id:
                return addr
        raise KeyError(node_id)

    def core(self, node_id: str) -> GossipCore:
        return self.cores[self.addr_of(node_id)]

    def add(
        self, node_id: str, port: int, *, seeds: tuple[str, ...] = (), generation: int = 0
    ) -> GossipCore:
        self.loads[node_id] = LocalState(role="both", model_id="m")
        core = GossipCore(
            replace(self.config, seeds=seeds),
            node_id,
            SECRET,
            clock=self.clock,
            wall_clock=lambda: int(self.clock.t * 1000) + self.clock_ahead_ms.get(node_id, 0),
            rng=random.Random(f"{node_id}:{port}"),
            generation=generation or 1_000 + port,
            local_state=lambda: self.loads[node_id],
        )
        addr = ("127.0.0.1", port)
        core.bind(addr)
        # Replace an older process at the same address (a restart).
        self.cores[addr] = core
        self.down.discard(node_id)
        for seed in seeds:
            self._sync(core, wire.parse_addr(seed), None, join=True)
        self.deliver()
        return core

    def up(self, core: GossipCore) -> bool:
        return core.node_id not in self.down and core.node_id not in self.paused

    # ---------------------------------------------------------------- network

    def _reachable(self, src: GossipCore, addr: Addr) -> GossipCore | None:
        dst = self.cores.get(addr)
        if dst is None or dst.node_id in self.down or not self.up(src):
            return None
        if frozenset((src.node_id, dst.node_id)) in self.cut:
            return None
        return dst

    def deliver(self) -> None:
        moved = True
        while moved:
            moved = False
            for src_addr, src in list(self.cores.items()):
                if not self.up(src):
                    src.take_outbox()
                    continue
                for addr, packet in src.take_outbox():
                    dst = self._reachable(src, addr)
                    if dst is None:
                        continue
                    if dst.node_id in self.paused:
                        self.paused[dst.node_id].append((packet, src_addr))
                        continue
                    dst.on_datagram(packet, src_addr)
                    moved = True
                for target in src.sync_requests:
                    self._sync(src, target.addr, target.node_id, join=target.join)
                    moved = True
                src.sync_requests.clear()
                for node_id in src.pull_requests:
                    self._pull(src, node_id)
                    moved = True
                src.pull_requests.clear()
            self._record()

    def _sync(self, src: GossipCore, addr: Addr, node_id: str | None, *, join: bool) -> bool:
        dst = self._reachable(src, addr)
        if dst is None or dst.node_id in self.paused:
            src.counters.syncs_failed += 1
            return False
        try:
            replies = dst.handle_tcp_request(src.sync_packet("sync", join))
            src.handle_sync_reply(replies[0], node_id)
        except wire.WireError:
            # As on real sockets: a refused request or reply is a failed sync.
            src.counters.syncs_failed += 1
            return False
        return True

    def _pull(self, src: GossipCore, node_id: str) -> None:
        m = src.view.members[node_id]
        dst = self._reachable(src, m.addr)
        if dst is None or dst.node_id in self.paused:
            src.pull_done(node_id, False)
            return
        replies = dst.handle_tcp_request(src.pull_request(node_id))
        src.handle_pull_reply(node_id, replies)
        src.pull_done(node_id, True)

    def _record(self) -> None:
        for core in self.cores.values():
            for m in core.view.members.values():
                hist = self.history.setdefault((core.node_id, m.node_id), [])
                if not hist or hist[-1] is not m.status:
                    hist.append(m.status)

    # ------------------------------------------------------------------- time

    def run_for(self, seconds: float) -> None:
        end = self.clock.t + seconds
        while True:
            live = [c for c in self.cores.values() if self.up(c)]
            nxt = min((c.next_deadline() for c in live), default=end)
            if nxt > end:
                self.clock.t = end
                return
            self.clock.t = max(self.clock.t, nxt)
            for core in live:
                if core.next_deadline() <= self.clock.t:
                    core.on_timer()
            self.deliver()
            for core in live:
                core.view.check_integrity()

    def run_until(self, cond, limit: float, step: float = 0.05) -> float:
        """Runs until ``cond()`` holds; returns the simulated seconds it took."""
        start = self.clock.t
        while not cond():
            if self.clock.t - start > limit:
                raise AssertionError(f"condition not met within {limit} simulated seconds")
            self.run_for(step)
        return self.clock.t - start

    def pause(self, node_id: str) -> None:
        self.paused[node_id] = []

    def resume(self, node_id: str) -> None:
        queued = self.paused.pop(node_id)
        core = self.core(node_id)
        for packet, src in queued:
            core.on_datagram(packet, src)
        self.deliver()

    # ---------------------------------------------------------------- queries

    def status(self, observer: str, target: str) -> MemberStatus | None:
        m = self.core(observer).view.members.get(target)
        return None if m is None else m.status

    def all_see(self, target: str, status: MemberStatus, *, except_: tuple[str, ...] = ()) -> bool:
        return all(
            self.status(c.node_id, target) is status
            for c in self.cores.values()
            if self.up(c) and c.node_id != target and c.node_id not in except_
        )


CONFIG = ClusterConfig(
    probe_interval_s=0.5,
    probe_timeout_s=0.2,
    suspect_timeout_s=2.0,
    gossip_interval_s=0.2,
    sync_interval_s=5.0,
    dead_reap_s=60.0,
)


def make_cluster(n: int, config: ClusterConfig = CONFIG) -> SimNet:
    net = SimNet(config)
    net.add("n0", 7000)
    for i in range(1, n):
        net.add(f"n{i}", 7000 + i, seeds=("127.0.0.1:7000",))
    net.run_until(lambda: all(net.all_see(f"n{i}", MemberStatus.ALIVE) for i in range(n)), 10)
    return net


def test_join_through_one_seed_reaches_everyone() -> None:
    net = make_cluster(5)
    for core in net.cores.values():
        assert sorted(core.view.members) == ["n0", "n1", "n2", "n3", "n4"]
        assert all(
            m.state is not None and m.state.model_id == "m" for m in core.view.members.values()
        )


def test_crash_goes_alive_suspect_dead_within_bound() -> None:
    net = make_cluster(5)
    crash_at = net.clock.t
    net.down.add("n3")
    suspected = net.run_until(
        lambda: any(net.status(o, "n3") is MemberStatus.SUSPECT for o in ("n0", "n1", "n2", "n4")),
        5,
    )
    # Every live node probes one member per interval round-robin, so someone
    # probes n3 within one full round (3 peers), plus the failed probe's interval.
    assert suspected <= 4 * CONFIG.probe_interval_s
    net.run_until(lambda: net.all_see("n3", MemberStatus.DEAD), 10)
    dead_after = net.clock.t - crash_at
    assert dead_after <= 4 * CONFIG.probe_interval_s + CONFIG.suspect_timeout_s + 1.0
    for observer in ("n0", "n1", "n2", "n4"):
        # Exactly the SWIM path, never straight to dead or back to alive.
        assert net.history[(observer, "n3")] == [
            MemberStatus.ALIVE,
            MemberStatus.SUSPECT,
            MemberStatus.DEAD,
        ]
        assert net.core(observer).view.num_cached_blocks("n3") == 0


def test_suspicion_lasts_suspect_timeout_at_the_first_suspecter() -> None:
    net = make_cluster(4)
    net.down.add("n2")
    net.run_until(
        lambda: any(net.status(o, "n2") is MemberStatus.SUSPECT for o in ("n0", "n1", "n3")), 5
    )
    first = next(o for o in ("n0", "n1", "n3") if net.status(o, "n2") is MemberStatus.SUSPECT)
    m = net.core(first).view.members["n2"]
    since = m.status_since
    net.run_until(lambda: net.status(first, "n2") is MemberStatus.DEAD, 5)
    # The first suspecter's timer is the first to run out: dead exactly then.
    assert m.status_since - since == pytest.approx(CONFIG.suspect_timeout_s)


def test_paused_node_refutes_its_suspicion() -> None:
    net = make_cluster(4)
    inc_before = net.core("n1").incarnation
    net.pause("n1")
    net.run_until(
        lambda: any(net.status(o, "n1") is MemberStatus.SUSPECT for o in ("n0", "n2", "n3")), 5
    )
    net.resume("n1")
    net.run_until(lambda: net.all_see("n1", MemberStatus.ALIVE), 1.5)
    n1 = net.core("n1")
    assert n1.counters.refutations >= 1
    assert n1.incarnation > inc_before
    for observer in ("n0", "n2", "n3"):
        assert MemberStatus.DEAD not in net.history[(observer, "n1")]
        assert net.core(observer).view.members["n1"].incarnation == n1.incarnation


def test_stale_suspicion_is_ignored_after_refutation() -> None:
    net = make_cluster(3)
    n0 = net.core("n0")
    inc = n0.view.members["n1"].incarnation
    # An old rumour: suspect n1 at an incarnation lower than known.
    packet = net.core("n2").codec.seal(
        [wire.msg_frame({"t": "suspect", "node": "n1", "inc": inc - 1, "from": "n2"})]
    )
    n0.on_datagram(packet, net.addr_of("n2"))
    assert n0.view.members["n1"].status is MemberStatus.ALIVE


def test_restarted_node_rejoins_with_new_incarnation() -> None:
    net = make_cluster(4)
    old = net.core("n2")
    old.publish_block_events([(bytes(16), Tier.DRAM, BlockOp.STORED)])
    net.run_for(1.0)
    assert net.core("n0").view.num_cached_blocks("n2") == 1
    net.down.add("n2")
    net.run_until(lambda: net.all_see("n2", MemberStatus.DEAD), 10)
    new = net.add("n2", 7002, seeds=("127.0.0.1:7000",), generation=old.generation + 5000)
    net.run_until(lambda: net.all_see("n2", MemberStatus.ALIVE), 5)
    assert new.incarnation > old.incarnation
    for observer in ("n0", "n1", "n3"):
        m = net.core(observer).view.members["n2"]
        assert m.generation == new.generation
        assert m.state is not None and m.state.generation == new.generation
        # The old process's blocks are not attributed to the new one.
        assert net.core(observer).view.num_cached_blocks("n2") == 0
    assert sorted(new.view.members) == ["n0", "n1", "n2", "n3"]
    assert all(m.status is MemberStatus.ALIVE for m in new.view.members.values())


def test_graceful_leave_is_seen_at_once_without_suspicion() -> None:
    net = make_cluster(4)
    net.core("n3").leave()
    net.deliver()
    assert net.all_see("n3", MemberStatus.LEFT)
    net.down.add("n3")
    net.run_for(5.0)
    for observer in ("n0", "n1", "n2"):
        assert net.history[(observer, "n3")] == [MemberStatus.ALIVE, MemberStatus.LEFT]


def test_dead_members_are_reaped() -> None:
    net = make_cluster(3, replace(CONFIG, dead_reap_s=6.0, sync_interval_s=1.0))
    net.down.add("n2")
    net.run_until(lambda: net.all_see("n2", MemberStatus.DEAD), 10)
    net.run_until(lambda: "n2" not in net.core("n0").view.members, 10)
    assert "n2" not in net.core("n0").view.blocks


def test_state_changes_spread_by_gossip() -> None:
    net = make_cluster(5)
    net.loads["n4"] = LocalState(role="prefill", model_id="m", load=NodeLoad(1234, 7, 0.5, 0.25))
    net.run_until(
        lambda: all(
            (st := c.view.members["n4"].state) is not None and st.load.queued_prefill_tokens == 1234
            for c in net.cores.values()
        ),
        2.0,
    )
    st = net.core("n0").view.members["n4"].state
    assert st is not None
    assert (st.role, st.load) == ("prefill", NodeLoad(1234, 7, 0.5, 0.25))
    assert sum(c.counters.syncs_ok for c in net.cores.values()) < 10  # by gossip, not sync


def test_segments_reach_peers_by_pull() -> None:
    net = make_cluster(3)
    segs = [{"name": "kv0", "addr": "127.0.0.1:9000", "length": 1 << 20}]
    net.core("n1").set_segments(segs)
    net.run_until(
        lambda: all(c.view.members["n1"].segments == tuple(segs) for c in net.cores.values()), 3
    )
    assert net.core("n0").counters.pulls_ok >= 1


def test_block_events_reach_every_index() -> None:
    net = make_cluster(5)
    hashes = [os.urandom(16) for _ in range(40)]
    n2 = net.core("n2")
    n2.publish_block_events([(h, Tier.DRAM, BlockOp.STORED) for h in hashes])
    n2.publish_block_events([(h, "ssd", "stored") for h in hashes[:10]])
    n2.publish_block_events([(h, Tier.DRAM, BlockOp.REMOVED) for h in hashes[30:]])
    expected = dict(n2.view.blocks["n2"].masks)
    assert len(expected) == 30
    net.run_until(
        lambda: all(c.view.blocks["n2"].masks == expected for c in net.cores.values()), 2.0
    )
    match = net.core("n0").view.longest_prefix(hashes)
    assert match["n2"].num_blocks == 30
    # The first 10 sit in DRAM and SSD: DRAM is the faster copy.
    assert match["n2"].tier_blocks == (0, 30, 0)
    assert sum(c.counters.pulls_ok for c in net.cores.values()) == 0


def test_block_gap_is_repaired_by_pull() -> None:
    net = make_cluster(3)
    n1, n0 = net.core("n1"), net.core("n0")
    net.down.add("n0")  # n0 misses the first batch entirely
    n1.publish_block_events([(os.urandom(16), Tier.DEVICE, BlockOp.STORED) for _ in range(5)])
    net.run_for(1.0)
    net.down.discard("n0")
    # Only the second batch reaches n0, straight from n1.
    n1.publish_block_events([(os.urandom(16), Tier.DEVICE, BlockOp.STORED) for _ in range(3)])
    second = n1.blocks.flush()
    assert second is not None
    n0.on_datagram(n1.codec.seal([wire.blocks_frame(second)]), net.addr_of("n1"))
    assert n0.counters.block_gaps == 1
    net.run_until(lambda: n0.view.blocks["n1"].masks == n1.view.blocks["n1"].masks, 3.0)
    assert n0.counters.pulls_ok >= 1


def test_burst_too_big_for_datagrams_is_pulled() -> None:
    net = make_cluster(3)
    n1 = net.core("n1")
    n1.publish_block_events([(os.urandom(16), Tier.SSD, BlockOp.STORED) for _ in range(5000)])
    net.run_until(lambda: all(len(c.view.blocks["n1"]) == 5000 for c in net.cores.values()), 3.0)
    assert net.core("n0").counters.pulls_ok >= 1


def test_partition_heals_after_it_ends() -> None:
    net = make_cluster(5, replace(CONFIG, sync_interval_s=1.0))
    a, b = ["n0", "n1", "n2"], ["n3", "n4"]
    net.cut = {frozenset((x, y)) for x in a for y in b}
    net.run_until(
        lambda: (
            all(net.status(x, y) is MemberStatus.DEAD for x in a for y in b)
            and all(net.status(y, x) is MemberStatus.DEAD for x in a for y in b)
        ),
        15,
    )
    net.cut.clear()
    net.run_until(lambda: all(net.all_see(f"n{i}", MemberStatus.ALIVE) for i in range(5)), 15)


def test_garbage_and_forgeries_are_counted_not_fatal() -> None:
    net = make_cluster(2)
    n0 = net.core("n0")
    src = net.addr_of("n1")
    before = {k: v for k, v in n0.counters.to_json().items()}
    forger = wire.Codec(b"some-other-secret", "n1")
    n0.on_datagram(
        forger.seal([wire.msg_frame({"t": "dead", "node": "n1", "inc": 10**12, "from": "n1"})]), src
    )
    n0.on_datagram(os.urandom(200), src)
    n0.on_datagram(b"", src)
    n0.on_datagram(b"x" * (CONFIG.max_message_bytes + 1), src)
    n1 = net.core("n1").codec
    n0.on_datagram(n1.seal([b"\x01\xff\xff\x00\x00garbage"]), src)  # truncated frame
    n0.on_datagram(n1.seal([wire.msg_frame({"t": "alive", "node": "x"})]), src)  # fields missing
    n0.on_datagram(n1.seal([wire.msg_frame({"t": "nonsense"})]), src)
    n0.on_datagram(n1.seal([b"\x02\x03\x00\x00\x00abc"]), src)  # bad block frame
    good = n1.seal([wire.msg_frame({"t": "g"})])
    n0.on_datagram(good[:-1] + bytes([good[-1] ^ 1]), src)  # one flipped bit
    after = n0.counters.to_json()
    # Forged, random and bit-flipped packets fail the MAC before any parsing.
    assert after["dropped_bad_mac"] - before["dropped_bad_mac"] == 3
    assert after["dropped_oversize"] - before["dropped_oversize"] == 1
    assert after["dropped_malformed"] - before["dropped_malformed"] == 5
    assert n0.view.members["n1"].status is MemberStatus.ALIVE
    net.run_for(2.0)
    assert net.all_see("n1", MemberStatus.ALIVE)


def test_tcp_request_forgery_raises_wire_error() -> None:
    net = make_cluster(2)
    forger = wire.Codec(b"some-other-secret", "n1")
    with pytest.raises(wire.AuthError):
        net.core("n0").handle_tcp_request(
            forger.seal([wire.msg_frame({"t": "sync", "members": []})])
        )
    assert net.core("n0").counters.dropped_bad_mac == 1


def assert_timers_move_on(net: SimNet, core: GossipCore, times: int) -> None:
    """Each of ``times`` timer runs at ``core``'s deadline leaves a later one."""
    for _ in range(times):
        net.clock.t = core.next_deadline()
        core.on_timer()
        assert core.next_deadline() > net.clock.t


def test_every_deadline_moves_on_while_leaving() -> None:
    # A timer reported by next_deadline() but not advanced by on_timer() would
    # make the host loop spin without ever yielding.
    net = make_cluster(3)
    n1 = net.core("n1")
    n1.leave()
    assert_timers_move_on(net, n1, 20)


def test_suspicion_heard_after_leaving_does_not_stall_the_timers() -> None:
    # News still arrives between leave() and close(): a suspicion learned then
    # must not leave an overdue deadline behind (the host loop would spin on it
    # until close, which during a daemon's drain is many seconds).
    net = make_cluster(3)
    n0, n1 = net.core("n0"), net.core("n1")
    n1.leave()
    inc = n1.view.members["n2"].incarnation
    n1.on_datagram(
        n0.codec.seal([wire.msg_frame({"t": "suspect", "node": "n2", "inc": inc, "from": "n0"})]),
        net.addr_of("n0"),
    )
    assert n1.view.members["n2"].status is MemberStatus.SUSPECT
    assert_timers_move_on(net, n1, 40)


def test_a_late_timer_judges_no_one() -> None:
    net = make_cluster(3)
    n0 = net.core("n0")
    net.down.update({"n1", "n2"})  # nobody answers n0 any more
    sent = n0.counters.probes
    # Step n0 alone, deadline by deadline, until it has a probe out.
    while n0.counters.probes == sent:
        net.clock.t = n0.next_deadline()
        n0.on_timer()
        net.deliver()
    # n0 stalls for far longer than a probe timeout before its next tick.
    net.clock.t += 10 * CONFIG.probe_interval_s
    n0.on_timer()
    assert n0.counters.probes_inconclusive == 1
    assert n0.counters.suspicions_raised == 0
    assert all(m.status is MemberStatus.ALIVE for m in n0.view.members.values())
    # On time again, the silence counts.
    net.run_until(lambda: n0.counters.suspicions_raised > 0, 3)


def test_broadcast_queue_order_replacement_limit_and_bound() -> None:
    from mooncaked.cluster.gossip.queue import BroadcastQueue
    from mooncaked.cluster.state import ClusterCounters

    counters = ClusterCounters()
    q = BroadcastQueue(max_items=3, counters=counters)
    q.put(("s", "a", 0), b"S-a-1")
    q.put(("m", "a", 0), b"M-a")
    q.put(("s", "a", 0), b"S-a-2")  # replaces the older state of a
    assert len(q) == 2
    # Membership news goes first in a packet, whatever its age.
    assert q.take(budget=100, limit=2) == [b"M-a", b"S-a-2"]
    q.put(("b", "a", 7), b"B-a-7")
    # Fewest sends first: the unsent delta before the items sent once; the budget caps it.
    assert q.take(budget=6, limit=2) == [b"B-a-7"]
    assert q.take(budget=100, limit=2) == [b"M-a", b"S-a-2", b"B-a-7"]
    # Each was sent twice (the limit): gone.
    assert len(q) == 0
    assert q.take(budget=100, limit=2) == []
    for i in range(5):
        q.put(("s", f"n{i}", 0), f"S{i}".encode())
    assert len(q) == 3 and counters.dropped_broadcasts == 2


# -- hostile messages that carry a valid signature ------------------------------------------

TOP = 2**64 - 1  # the largest integer the JSON codec still writes


def signed(net: SimNet, sender: str, *messages: dict[str, object]) -> bytes:
    return net.core(sender).codec.seal([wire.msg_frame(m) for m in messages])


def digest(core: GossipCore) -> dict[str, object]:
    """What a message may change in a view (last_heard aside: any packet refreshes it)."""
    return {
        "members": {
            n: (m.status, m.incarnation, m.generation, m.addr, m.state, m.segments_version)
            for n, m in core.view.members.items()
        },
        "blocks": {n: (b.generation, b.version, len(b)) for n, b in core.view.blocks.items()},
        "incarnation": core.incarnation,
    }


def test_a_suspicion_at_the_top_incarnation_is_dropped_not_fatal() -> None:
    # The attack: the target could never refute (inc + 1 does not encode), so
    # every node would declare it dead and its status and leave would fail.
    net = make_cluster(3)
    n0, n1 = net.core("n0"), net.core("n1")
    inc0 = n0.incarnation
    attack = signed(net, "n2", {"t": "suspect", "node": "n0", "inc": TOP, "from": "n2"})
    n1.on_datagram(attack, net.addr_of("n2"))  # a third party, which would spread it
    n0.on_datagram(attack, net.addr_of("n2"))  # and the target itself
    assert n1.counters.dropped_invalid == 1 and n0.counters.dropped_invalid == 1
    assert n0.incarnation == inc0
    assert n1.view.members["n0"].incarnation == inc0
    net.run_for(2 * CONFIG.suspect_timeout_s)
    assert net.all_see("n0", MemberStatus.ALIVE)
    n0.leave()
    net.deliver()
    assert net.all_see("n0", MemberStatus.LEFT)


def test_the_highest_accepted_accusation_can_still_be_refuted() -> None:
    net = make_cluster(3)
    n0, n1 = net.core("n0"), net.core("n1")
    # As far ahead of the wall clock as receivers allow.
    top = wall_ms(net) + int(CONFIG.max_clock_skew_s * 1000)
    accusation = signed(net, "n2", {"t": "suspect", "node": "n0", "inc": top, "from": "n2"})
    n1.on_datagram(accusation, net.addr_of("n2"))
    assert n1.view.members["n0"].status is MemberStatus.SUSPECT
    n0.on_datagram(accusation, net.addr_of("n2"))
    assert n0.incarnation == top + 1
    # n0's refutation, one more than allowed, reaches n1 in the same instant
    # (on the ack of a ping): refused there, it must be said again.
    n0.on_datagram(signed(net, "n1", {"t": "ping", "seq": 99, "target": "n0"}), net.addr_of("n1"))
    net.deliver()
    assert n1.counters.dropped_invalid == 1
    assert n1.view.members["n0"].status is MemberStatus.SUSPECT
    net.run_until(lambda: net.all_see("n0", MemberStatus.ALIVE), CONFIG.suspect_timeout_s)
    assert n1.view.members["n0"].incarnation == top + 1
    assert net.core("n2").view.members["n0"].incarnation == top + 1
    assert MemberStatus.DEAD not in net.history[("n1", "n0")]


def _state_of(net: SimNet, node_id: str, **changes: object) -> dict[str, object]:
    st = net.core(node_id).view.members[node_id].state
    assert st is not None
    return {"t": "state", **wire.state_to_json(st), **changes}


@pytest.mark.parametrize(
    "make",
    [
        lambda net: {"t": "alive", "node": "n9", "inc": TOP, "gen": 5, "addr": ["127.0.0.1", 1]},
        lambda net: {"t": "alive", "node": "n9", "inc": 5, "gen": TOP, "addr": ["127.0.0.1", 1]},
        # An incarnation starts at its generation and only grows.
        lambda net: {"t": "alive", "node": "n9", "inc": 4, "gen": 5, "addr": ["127.0.0.1", 1]},
        lambda net: {"t": "alive", "node": "n9", "inc": 5, "gen": 5, "addr": ["127.0.0.1", 0]},
        lambda net: {"t": "dead", "node": "n1", "inc": TOP, "from": "n2"},
        lambda net: {"t": "dead", "node": "n0", "inc": wire.MAX_INCARNATION, "from": "n2"},
        lambda net: {"t": "ping", "seq": TOP, "target": "n0"},
        lambda net: {"t": "ack", "seq": TOP},
        lambda net: _state_of(net, "n1", ver=TOP),
        lambda net: _state_of(net, "n1", ver=10**6, bver=TOP),
        lambda net: _state_of(net, "n1", ver=10**6, nblk=TOP),
        lambda net: _state_of(net, "n1", ver=10**6, sver=TOP),
        lambda net: _state_of(net, "n1", ver=10**6, load=[TOP, 0, 0.5, 0.0, 0, 0]),
        lambda net: _state_of(net, "n1", ver=10**6, load=[0, 0, 7.5, 0.0, 0, 0]),
        lambda net: _state_of(net, "n1", ver=10**6, load=[0, 0, 0.5, -1.0, 0, 0]),
    ],
)
def test_out_of_range_fields_are_dropped_counted_and_never_applied(make) -> None:
    net = make_cluster(3)
    n0 = net.core("n0")
    n0.take_outbox()
    before = digest(n0)
    n0.on_datagram(signed(net, "n2", make(net)), net.addr_of("n2"))
    assert n0.counters.dropped_invalid == 1
    assert n0.counters.dropped_malformed == 0
    assert digest(n0) == before
    assert n0.take_outbox() == []  # no ack, no refutation, no ping


@pytest.mark.parametrize(
    "bounds",
    [
        {"to_version": TOP},
        {"generation": TOP},
        {"masks": b"\x09"},  # a tier mask with bits beyond the three tiers
    ],
)
def test_a_block_delta_out_of_range_is_dropped_and_counted(bounds: dict[str, object]) -> None:
    net = make_cluster(2)
    n0, n1 = net.core("n0"), net.core("n1")
    index = n0.view.blocks["n1"]
    fields: dict[str, object] = {
        "node_id": "n1",
        "generation": n1.generation,
        "from_version": index.version,
        "to_version": index.version + 1,
        "hashes": os.urandom(16),
        "masks": b"\x02",
        "num_upserts": 1,
        **bounds,
    }
    delta = BlockDelta(**fields)  # type: ignore[arg-type]
    before = digest(n0)
    n0.on_datagram(n1.codec.seal([wire.blocks_frame(delta)]), net.addr_of("n1"))
    assert n0.counters.dropped_invalid == 1
    assert digest(n0) == before


def test_a_sync_with_one_bad_entry_applies_nothing() -> None:
    net = make_cluster(2)
    n0 = net.core("n0")
    good = {
        "node": "n7",
        "inc": 9000,
        "gen": 9000,
        "status": "alive",
        "addr": ["127.0.0.1", 7007],
        "state": None,
        "seg": [],
        "sver": 0,
    }
    bad = {**good, "node": "n8", "inc": TOP}
    before = digest(n0)
    with pytest.raises(wire.WireError):
        n0.handle_tcp_request(
            signed(net, "n1", {"t": "sync", "join": False, "members": [good, bad]})
        )
    assert digest(n0) == before
    assert n0.counters.dropped_invalid == 1


def test_a_pull_reply_with_a_bad_chunk_applies_nothing() -> None:
    net = make_cluster(2)
    n0, n1 = net.core("n0"), net.core("n1")
    n1.set_segments([{"name": "dram", "port": 1}])  # a newer state n0 has not heard of
    head = n1.handle_tcp_request(n0.pull_request("n1"))[0]
    before = digest(n0)
    with pytest.raises(wire.WireError):
        n0.handle_pull_reply("n1", [head, signed(net, "n1", {"t": "g"})])
    assert digest(n0) == before


def test_a_ping_req_probes_only_members_at_their_known_address() -> None:
    net = make_cluster(3)
    n0 = net.core("n0")
    n0.take_outbox()
    elsewhere = ["10.1.2.3", 9]
    for msg in (
        {"t": "preq", "seq": 1, "target": "n9", "addr": elsewhere},  # no member
        {"t": "preq", "seq": 2, "target": "n2", "addr": elsewhere},  # a member, not there
        {"t": "preq", "seq": 3, "target": "n0", "addr": list(net.addr_of("n0"))},  # itself
    ):
        n0.on_datagram(signed(net, "n1", msg), net.addr_of("n1"))
    assert n0.take_outbox() == []
    assert n0.counters.dropped_invalid == 3
    # A real indirect probe still goes out, to where the member is.
    n0.on_datagram(
        signed(net, "n1", {"t": "preq", "seq": 4, "target": "n2", "addr": list(net.addr_of("n2"))}),
        net.addr_of("n1"),
    )
    assert [addr for addr, _ in n0.take_outbox()] == [net.addr_of("n2")]


# -- forged membership news: a node can always refute what is said about it -----------------

# Where no node listens: a forged alive points a member here.
NOWHERE: Addr = ("127.0.0.1", 7999)


def wall_ms(net: SimNet) -> int:
    """The wall clock, in milliseconds, every core of ``net`` reads."""
    return int(net.clock.t * 1000)


def forged(*messages: dict[str, object]) -> bytes:
    """Signed with the cluster secret by a sender that is no member."""
    return wire.Codec(SECRET, "intruder").seal([wire.msg_frame(m) for m in messages])


def restart(net: SimNet, node_id: str, seed: str) -> GossipCore:
    """A new process of ``node_id`` at the same address, its generation its start time."""
    port = net.addr_of(node_id)[1]
    return net.add(node_id, port, seeds=(f"127.0.0.1:{seed}",), generation=wall_ms(net))


def seen_at(net: SimNet, node_id: str, observers: tuple[str, ...]) -> bool:
    """Every observer holds ``node_id`` alive, at its real address, in its current generation."""
    core = net.core(node_id)
    for observer in observers:
        m = net.core(observer).view.members.get(node_id)
        if (
            m is None
            or m.status is not MemberStatus.ALIVE
            or m.addr != net.addr_of(node_id)
            or m.generation != core.generation
        ):
            return False
    return True


def test_a_forged_alive_at_the_top_incarnation_cannot_cut_a_node_out() -> None:
    net = make_cluster(3)
    n0 = net.core("n0")
    claim = {
        "t": "alive",
        "node": "n0",
        "inc": wire.MAX_INCARNATION,
        "gen": n0.generation,
        "addr": list(NOWHERE),
    }
    for observer in ("n1", "n2"):
        net.core(observer).on_datagram(forged(claim), NOWHERE)
    net.deliver()
    net.run_until(lambda: seen_at(net, "n0", ("n1", "n2")), 10)
    # And it stays so: no probe of a dead address turns it into a suspect.
    net.run_for(2 * CONFIG.suspect_timeout_s)
    assert seen_at(net, "n0", ("n1", "n2"))
    for observer in ("n1", "n2"):
        assert MemberStatus.DEAD not in net.history[(observer, "n0")]


def test_a_forged_suspicion_at_the_top_then_a_pause_then_a_restart() -> None:
    net = make_cluster(3)
    net.pause("n0")
    claim = {"t": "suspect", "node": "n0", "inc": wire.MAX_INCARNATION - 1, "from": "n2"}
    net.core("n1").on_datagram(forged(claim), NOWHERE)
    net.deliver()
    # n0 does not answer for longer than the suspect timeout.
    net.run_for(CONFIG.suspect_timeout_s + 2.0)
    net.resume("n0")
    net.run_until(lambda: seen_at(net, "n0", ("n1", "n2")), 10)
    new = restart(net, "n0", "7001")
    net.run_until(lambda: seen_at(net, "n0", ("n1", "n2")), 10)
    assert all(m.status is MemberStatus.ALIVE for m in new.view.members.values())


def test_a_refutation_refused_as_too_far_ahead_is_said_again() -> None:
    # Syncs rare: only the node itself can repair a peer that missed its news.
    net = make_cluster(3, replace(CONFIG, sync_interval_s=60.0))
    net.clock_ahead_ms["n0"] = 1000  # n0's clock runs a second ahead of the others'
    n0, n1 = net.core("n0"), net.core("n1")
    old = n1.view.members["n0"].incarnation
    # A claim about n0 as far ahead as n0's own clock allows: n0 outranks it,
    # and every copy of its answer reaches peers that refuse it for a second.
    top = wall_ms(net) + 1000 + int(CONFIG.max_clock_skew_s * 1000)
    claim = {"t": "alive", "node": "n0", "inc": top, "gen": n0.generation, "addr": [*NOWHERE]}
    n0.on_datagram(forged(claim), NOWHERE)
    assert n0.incarnation == top + 1
    net.run_until(lambda: n0.num_pending_broadcasts == 0, 1.0)
    assert n1.view.members["n0"].incarnation == old
    assert n1.counters.dropped_invalid >= 1
    # Past the second, n1 suspects n0 at the incarnation it knows.
    net.run_for(1.0)
    n1.on_datagram(
        signed(net, "n2", {"t": "suspect", "node": "n0", "inc": old, "from": "n2"}),
        net.addr_of("n2"),
    )
    net.run_until(lambda: net.all_see("n0", MemberStatus.ALIVE), CONFIG.suspect_timeout_s)
    for observer in ("n1", "n2"):
        assert net.core(observer).view.members["n0"].incarnation == top + 1
        assert MemberStatus.DEAD not in net.history[(observer, "n0")]


def test_news_further_ahead_than_the_clock_skew_allows_is_refused_and_counted() -> None:
    net = make_cluster(3)
    n0 = net.core("n0")
    n0.take_outbox()
    limit = wall_ms(net) + int(CONFIG.max_clock_skew_s * 1000)
    ahead = {"t": "alive", "node": "n9", "inc": limit + 1, "gen": limit + 1, "addr": [*NOWHERE]}
    before = digest(n0)
    with capture_logs() as logs:
        n0.on_datagram(signed(net, "n1", ahead), net.addr_of("n1"))
    assert n0.counters.dropped_invalid == 1
    assert digest(n0) == before
    assert n0.take_outbox() == []
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1
    assert warnings[0]["target"] == "n9" and warnings[0]["incarnation"] == limit + 1
    assert warnings[0]["ahead_s"] == pytest.approx(CONFIG.max_clock_skew_s + 0.001)
    assert "NTP" in warnings[0]["event"]
    # Accusations likewise; the limit itself is accepted.
    n0.on_datagram(
        signed(net, "n1", {"t": "suspect", "node": "n2", "inc": limit + 1, "from": "n1"}),
        net.addr_of("n1"),
    )
    assert n0.counters.dropped_invalid == 2
    assert n0.view.members["n2"].status is MemberStatus.ALIVE
    n0.on_datagram(signed(net, "n1", {**ahead, "inc": limit, "gen": limit}), net.addr_of("n1"))
    assert n0.counters.dropped_invalid == 2
    assert n0.view.members["n9"].generation == limit


def test_a_sync_entry_too_far_ahead_is_skipped_and_the_rest_applied() -> None:
    net = make_cluster(2)
    n0 = net.core("n0")
    limit = wall_ms(net) + int(CONFIG.max_clock_skew_s * 1000)
    entry = {"status": "alive", "addr": [*NOWHERE], "state": None, "seg": [], "sver": 0}
    members = [
        {**entry, "node": "n7", "inc": 9000, "gen": 9000},
        {**entry, "node": "n8", "inc": limit + 1, "gen": limit + 1},
    ]
    n0.handle_tcp_request(signed(net, "n1", {"t": "sync", "join": False, "members": members}))
    assert n0.counters.dropped_invalid == 1
    assert "n7" in n0.view.members and "n8" not in n0.view.members


def test_a_node_whose_clock_runs_too_far_ahead_is_refused_by_its_peers() -> None:
    net = make_cluster(2)
    skew_ms = int(CONFIG.max_clock_skew_s * 1000)
    net.clock_ahead_ms["n2"] = skew_ms + 5000
    n2 = net.add("n2", 7002, seeds=("127.0.0.1:7000",), generation=wall_ms(net) + skew_ms + 5000)
    net.run_for(2.0)
    assert "n2" not in net.core("n0").view.members
    assert net.core("n0").counters.dropped_invalid >= 1
    # A generation beyond the bound of its own clock is a caller's mistake.
    with pytest.raises(ValueError, match="max_clock_skew_s"):
        GossipCore(
            CONFIG,
            "n3",
            SECRET,
            clock=net.clock,
            wall_clock=lambda: wall_ms(net),
            rng=random.Random(3),
            generation=wall_ms(net) + skew_ms + 1,
            local_state=LocalState,
        )
    assert n2.incarnation == n2.generation


@pytest.mark.parametrize("num_nodes", [2, 3])
def test_a_forged_alive_at_the_highest_accepted_incarnation_is_refuted(num_nodes: int) -> None:
    net = make_cluster(num_nodes)
    n0 = net.core("n0")
    top = wall_ms(net) + int(CONFIG.max_clock_skew_s * 1000)
    claim = {"t": "alive", "node": "n0", "inc": top, "gen": n0.generation, "addr": [*NOWHERE]}
    observers = tuple(f"n{i}" for i in range(1, num_nodes))
    # Only the others hear it, and they then send n0's news to nowhere.
    for observer in observers:
        net.core(observer).on_datagram(forged(claim), NOWHERE)
        assert net.core(observer).view.members["n0"].addr == NOWHERE
    net.run_until(lambda: seen_at(net, "n0", observers), 10)
    assert n0.incarnation == top + 1
    for observer in observers:
        assert net.core(observer).view.members["n0"].incarnation == top + 1
        assert MemberStatus.DEAD not in net.history[(observer, "n0")]
