"""SWIM membership: probes, indirect probes, suspicion, alive/suspect/dead, refutation.

Each probe interval a node pings the next member of a shuffled round-robin
list; without an ack within ``probe_timeout_s`` it asks ``indirect_probes``
others to ping it; without any ack by the next probe it suspects the member.
A suspect that does not refute (by gossiping ``alive`` with a higher
incarnation) within ``suspect_timeout_s`` is declared dead. Ordering is by
incarnation: news about a node with a lower incarnation than known is
dropped. A process starts its incarnation (and its ``generation``) at its
start time in wall-clock milliseconds and raises it by one per refutation,
so a restarted node outranks everything honestly said about its previous
life and rejoins at once.

That origin is an invariant checked on receipt: news naming an incarnation
more than ``max_clock_skew_s`` ahead of this node's wall clock is refused
(``check_incarnation``). A node can therefore always answer what is said
about it, restarts included: a forged claim (signed by someone holding the
cluster secret) sits at most that far ahead, the node's refutation is one
more, and every receiver takes it once its clock allows, at the latest after
``max_clock_skew_s``. A node that hears itself accused at an incarnation below
its own (a peer missed or refused its refutation) says it again.
``leave()`` announces ``dead`` from the node itself (status ``left``).

No I/O: packets go out through the ``send`` function the core passes in,
news through the broadcast queue, and what the block-index replica must
forget through a ``MemberListener``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from mooncaked.cluster import wire
from mooncaked.cluster.gossip.queue import BroadcastQueue
from mooncaked.cluster.state import ClusterView, Member, MemberStatus
from mooncaked.config import ClusterConfig

log = structlog.get_logger(__name__)

Addr = tuple[str, int]
Clock = Callable[[], float]
# Wall-clock milliseconds: the origin of incarnations and generations.
WallClock = Callable[[], int]
# (address, frames, node it is meant for): the core seals the frames with news.
Send = Callable[[Addr, list[bytes], str | None], None]

# A clock-skew warning names a node at most this often (news repeats a lot).
_SKEW_WARNING_EVERY_S = 10.0
# Nodes whose skew warnings are remembered; beyond it the memory is cleared.
_MAX_SKEW_WARNED = 1024


def wall_clock_ms() -> int:
    """This host's wall clock in milliseconds: where a process starts its incarnation."""
    return time.time_ns() // 1_000_000


class MemberListener(Protocol):
    """What another part of the protocol keeps per member and must reset with it."""

    def member_up(self, node_id: str, generation: int) -> None:
        """The member joined, restarted or came back: its old replica is void."""

    def member_down(self, node_id: str, generation: int) -> None:
        """The member is dead or left: it serves nothing any more."""

    def member_forgotten(self, node_id: str) -> None:
        """The member was reaped from the member list."""


@dataclass(slots=True)
class _Probe:
    target: str
    seq: int
    indirect_at: float
    acked: bool = False
    indirect_sent: bool = False


class Membership:
    """The SWIM failure detector of one node, over the member list of its ``ClusterView``."""

    __slots__ = (
        "_clock",
        "_limit_cache",
        "_listener",
        "_next_probe",
        "_probe",
        "_probe_order",
        "_probe_pos",
        "_queue",
        "_relays",
        "_rng",
        "_send",
        "_seq",
        "_skew_warned",
        "_suspect_deadlines",
        "_up_peers",
        "_wall_clock",
        "config",
        "counters",
        "generation",
        "incarnation",
        "leaving",
        "me",
        "node_id",
        "view",
    )

    def __init__(
        self,
        config: ClusterConfig,
        view: ClusterView,
        *,
        clock: Clock,
        wall_clock: WallClock,
        rng: random.Random,
        generation: int,
        addr: Addr,
        queue: BroadcastQueue,
        send: Send,
        listener: MemberListener,
    ) -> None:
        self.config = config
        self.view = view
        self.node_id = view.self_id
        self.counters = view.counters
        self._clock = clock
        self._wall_clock = wall_clock
        self._rng = rng
        self._queue = queue
        self._send = send
        self._listener = listener
        self.incarnation = generation
        self.generation = generation
        now = clock()
        self.me = Member(self.node_id, addr, generation, generation, MemberStatus.ALIVE, now, now)
        view.members[self.node_id] = self.me
        self.leaving = False
        self._suspect_deadlines: dict[str, float] = {}
        # Pings sent on behalf of a ping-req: our seq -> (requester addr, its seq, it, expiry).
        self._relays: dict[int, tuple[Addr, int, str, float]] = {}
        self._seq = 0
        # Derived from the member list; None when a status change made it stale.
        self._up_peers: list[Member] | None = None
        self._limit_cache = 0
        self._probe: _Probe | None = None
        self._probe_order: list[str] = []
        self._probe_pos = 0
        self._next_probe = now + rng.uniform(0, config.probe_interval_s)
        # node id -> when (monotonic) its clock skew was last logged.
        self._skew_warned: dict[str, float] = {}

    def announce(self) -> None:
        """Queues this node's own alive news (after binding, or a refutation)."""
        self._queue.put(("m", self.node_id, 0), alive_frame(self.me))

    # ---------------------------------------------------------------- timers

    def next_deadline(self) -> float:
        t = self._next_probe
        if self.leaving:
            # on_timer judges no one while leaving, so a probe or suspicion
            # deadline (news that arrives after leave() can still start one)
            # would never move on and would spin the host's loop.
            return t
        probe = self._probe
        if probe is not None and not probe.acked and not probe.indirect_sent:
            t = min(t, probe.indirect_at)
        if self._suspect_deadlines:
            t = min(t, min(self._suspect_deadlines.values()))
        return t

    def on_timer(self, now: float) -> None:
        if not self.leaving:
            probe = self._probe
            if (
                probe is not None
                and not probe.acked
                and not probe.indirect_sent
                and now >= probe.indirect_at
            ):
                self._send_indirect(probe)
            if now >= self._next_probe:
                self._probe_tick(now, late=now - self._next_probe)
            if self._suspect_deadlines:
                self._expire_suspicions(now)
        # The probe deadline moves on leaving or not: a deadline left in the
        # past would spin the host's loop.
        if now >= self._next_probe:
            self._next_probe = next_tick(self._next_probe, self.config.probe_interval_s, now)

    def _probe_tick(self, now: float, late: float = 0.0) -> None:
        probe = self._probe
        self._probe = None
        if probe is not None and not probe.acked:
            m = self.view.members.get(probe.target)
            if late > self.config.probe_timeout_s:
                # This node ran late (a stalled loop, a starved CPU): the ack may
                # be unread rather than missing. Judge no one on our own slowness
                # (Lifeguard's local-health idea, in its simplest form).
                self.counters.probes_inconclusive += 1
            elif m is not None and m.status is MemberStatus.ALIVE:
                self.counters.suspicions_raised += 1
                log.info("probe failed; suspecting", node=self.node_id, target=probe.target)
                self.on_suspect(probe.target, m.incarnation, self.node_id)
        self._expire_relays(now)
        target = self._next_probe_target()
        if target is None:
            return
        self._seq += 1
        self.counters.probes += 1
        self._probe = _Probe(target.node_id, self._seq, now + self.config.probe_timeout_s)
        self._send(
            target.addr,
            [wire.msg_frame({"t": "ping", "seq": self._seq, "target": target.node_id})],
            target.node_id,
        )

    def _next_probe_target(self) -> Member | None:
        members = self.view.members
        for _ in range(2):
            while self._probe_pos < len(self._probe_order):
                node_id = self._probe_order[self._probe_pos]
                self._probe_pos += 1
                m = members.get(node_id)
                if m is not None and m.is_up:
                    return m
            # A full round done: reshuffle, as SWIM's round-robin probing does.
            self._probe_order = [n for n, m in members.items() if n != self.node_id and m.is_up]
            self._rng.shuffle(self._probe_order)
            self._probe_pos = 0
            if not self._probe_order:
                return None
        return None

    def _send_indirect(self, probe: _Probe) -> None:
        probe.indirect_sent = True
        target = self.view.members.get(probe.target)
        if target is None or self.config.indirect_probes == 0:
            return
        helpers = [
            m
            for n, m in self.view.members.items()
            if m.status is MemberStatus.ALIVE and n not in (self.node_id, probe.target)
        ]
        k = min(self.config.indirect_probes, len(helpers))
        for m in self._rng.sample(helpers, k):
            self.counters.indirect_probes += 1
            frame = wire.msg_frame(
                {"t": "preq", "seq": probe.seq, "target": probe.target, "addr": list(target.addr)}
            )
            self._send(m.addr, [frame], m.node_id)

    def _expire_relays(self, now: float) -> None:
        if self._relays:
            for seq in [s for s, r in self._relays.items() if r[3] <= now]:
                del self._relays[seq]

    def _expire_suspicions(self, now: float) -> None:
        for node_id, deadline in list(self._suspect_deadlines.items()):
            if deadline > now:
                continue
            del self._suspect_deadlines[node_id]
            m = self.view.members.get(node_id)
            if m is not None and m.status is MemberStatus.SUSPECT:
                log.info("suspicion timed out; declaring dead", node=self.node_id, target=node_id)
                self.on_dead(node_id, m.incarnation, self.node_id)

    def reap(self, now: float) -> None:
        """Forgets members down for longer than ``dead_reap_s``."""
        horizon = now - self.config.dead_reap_s
        for node_id, m in list(self.view.members.items()):
            if not m.is_up and m.status_since <= horizon and node_id != self.node_id:
                del self.view.members[node_id]
                self._members_changed()
                self._listener.member_forgotten(node_id)
                log.info("forgot member", node=self.node_id, target=node_id, status=m.status.value)

    # ----------------------------------------------------------- peer lists

    def _members_changed(self) -> None:
        self._up_peers = None
        self._limit_cache = 0

    def peers_up(self) -> list[Member]:
        """Alive and suspect members other than this node."""
        # Cached between status changes: sends and gossip rounds must not walk
        # the whole member list each time.
        if self._up_peers is None:
            self._up_peers = [
                m for n, m in self.view.members.items() if n != self.node_id and m.is_up
            ]
        return self._up_peers

    def retransmit_limit(self) -> int:
        """How often each piece of news is sent: ``retransmit_mult * ceil(log10(N + 1))``."""
        if self._limit_cache <= 0:
            n = len(self.peers_up()) + 1
            self._limit_cache = self.config.retransmit_mult * max(1, math.ceil(math.log10(n + 1)))
        return self._limit_cache

    # --------------------------------------------------------- probe messages

    def on_ping(self, sender: str, addr: Addr, msg: dict[str, Any]) -> None:
        seq = wire.get_int(msg, "seq")
        if wire.get_str(msg, "target") != self.node_id:
            # Meant for a previous owner of this address.
            self.counters.dropped_malformed += 1
            return
        self._send(addr, [wire.msg_frame({"t": "ack", "seq": seq})], sender)

    def on_ack(self, msg: dict[str, Any]) -> None:
        seq = wire.get_int(msg, "seq")
        probe = self._probe
        if probe is not None and probe.seq == seq:
            probe.acked = True
        relay = self._relays.pop(seq, None)
        if relay is not None:
            requester_addr, requester_seq, requester, _ = relay
            self._send(
                requester_addr, [wire.msg_frame({"t": "ack", "seq": requester_seq})], requester
            )

    def on_ping_req(self, sender: str, addr: Addr, msg: dict[str, Any]) -> None:
        seq = wire.get_int(msg, "seq")
        target = wire.get_str(msg, "target")
        target_addr = wire.get_addr(msg, "addr")
        m = self.view.members.get(target)
        if m is None or target == self.node_id or m.addr != target_addr:
            # Otherwise one signed packet would make this node ping any host:port.
            raise wire.BoundsError(
                f"ping-req for {target!r} at {target_addr[0]}:{target_addr[1]}: not a member there"
            )
        self._seq += 1
        self._relays[self._seq] = (addr, seq, sender, self._clock() + self.config.probe_interval_s)
        self._send(
            target_addr,
            [wire.msg_frame({"t": "ping", "seq": self._seq, "target": target})],
            target,
        )

    # ------------------------------------------------------- membership rules

    def check_incarnation(self, node_id: str, inc: int) -> None:
        """Refuses (``BoundsError``) an incarnation too far ahead of this node's wall clock.

        Without this bound one signed claim at the top incarnation would stand
        until the member is reaped: nothing can outrank it, not even the node
        itself after a restart (its new generation is its start time).
        """
        ahead_ms = inc - self._wall_clock()
        if ahead_ms <= self.config.max_clock_skew_s * 1000:
            return
        self._warn_skew(node_id, inc, ahead_ms)
        raise wire.BoundsError(
            f"incarnation {inc} of {node_id!r} is {ahead_ms / 1000:.3f} s ahead of this node's "
            f"clock (max_clock_skew_s = {self.config.max_clock_skew_s})"
        )

    def _warn_skew(self, node_id: str, inc: int, ahead_ms: int) -> None:
        now = self._clock()
        last = self._skew_warned.get(node_id)
        if last is not None and now - last < _SKEW_WARNING_EVERY_S:
            return
        if len(self._skew_warned) >= _MAX_SKEW_WARNED:
            self._skew_warned.clear()
        self._skew_warned[node_id] = now
        log.warning(
            "refused news of a node ahead of this node's clock; check NTP on both hosts",
            node=self.node_id,
            target=node_id,
            incarnation=inc,
            ahead_s=round(ahead_ms / 1000, 3),
            max_clock_skew_s=self.config.max_clock_skew_s,
        )

    def _set_status(self, m: Member, status: MemberStatus) -> None:
        if m.status is not status:
            log.info(
                "member status",
                node=self.node_id,
                target=m.node_id,
                status=status.value,
                was=m.status.value,
                incarnation=m.incarnation,
            )
            m.status = status
            m.status_since = self._clock()
            self._members_changed()

    def _refute(self, inc: int) -> None:
        new = max(self.incarnation, inc) + 1
        if new > wire.MAX_INCARNATION:
            # Only an alive claim at the very top gets here (decoding keeps
            # accusations below it): nobody would accept an answer.
            log.warning("cannot outrank incarnation", node=self.node_id, incarnation=inc)
            return
        self.incarnation = new
        self.me.incarnation = self.incarnation
        self.counters.refutations += 1
        log.info("refuting suspicion", node=self.node_id, incarnation=self.incarnation)
        self.announce()

    def _deny(self, inc: int) -> None:
        """Answers a suspicion or death of this node heard at incarnation ``inc``."""
        if self.leaving:
            return
        if inc >= self.incarnation:
            self._refute(inc)
        elif ("m", self.node_id, 0) not in self._queue:
            # The accuser holds an older suspicion: it missed our refutation
            # (lost, or refused while ahead of its clock) or knew our previous
            # life. Say it again; news already queued is on its way.
            self.announce()

    def on_alive(
        self,
        node_id: str,
        inc: int,
        gen: int,
        addr: Addr,
        frame: bytes | None = None,
        *,
        spread: bool = True,
    ) -> None:
        if node_id == self.node_id:
            # News of an older self with a higher incarnation: outrank it.
            if inc > self.incarnation and not self.leaving:
                self._refute(inc)
            return
        m = self.view.members.get(node_id)
        now = self._clock()
        if m is None:
            m = Member(node_id, addr, inc, gen, MemberStatus.ALIVE, now, now)
            self.view.members[node_id] = m
            self._members_changed()
            self._listener.member_up(node_id, gen)
            log.info(
                "member joined", node=self.node_id, target=node_id, addr=f"{addr[0]}:{addr[1]}"
            )
        else:
            if inc <= m.incarnation:
                return
            was_up = m.is_up
            m.incarnation = inc
            m.addr = addr
            m.last_heard = now
            self._suspect_deadlines.pop(node_id, None)
            self._set_status(m, MemberStatus.ALIVE)
            if gen != m.generation:
                # A restart: its state, segments and blocks are those of the new process.
                m.generation = gen
                m.state = None
                m.segments = ()
                m.segments_version = 0
                self._listener.member_up(node_id, gen)
            elif not was_up:
                self._listener.member_up(node_id, gen)
        if spread:
            self._queue.put(("m", node_id, 0), frame if frame is not None else alive_frame(m))

    def on_suspect(self, node_id: str, inc: int, source: str) -> None:
        if node_id == self.node_id:
            self._deny(inc)
            return
        m = self.view.members.get(node_id)
        if m is None or inc < m.incarnation or m.status is not MemberStatus.ALIVE:
            return
        m.incarnation = inc
        self._set_status(m, MemberStatus.SUSPECT)
        self._suspect_deadlines[node_id] = self._clock() + self.config.suspect_timeout_s
        self._queue.put(("m", node_id, 0), suspect_frame(node_id, inc, source))

    def on_dead(self, node_id: str, inc: int, source: str) -> None:
        left = source == node_id
        if node_id == self.node_id:
            self._deny(inc)
            return
        m = self.view.members.get(node_id)
        if m is None or inc < m.incarnation or not m.is_up:
            return
        m.incarnation = inc
        self._suspect_deadlines.pop(node_id, None)
        self._set_status(m, MemberStatus.LEFT if left else MemberStatus.DEAD)
        # A down node serves nothing: forget its blocks (a pull restores them
        # if it turns out to be alive after all).
        self._listener.member_down(node_id, m.generation)
        self._queue.put(("m", node_id, 0), dead_frame(node_id, inc, source))

    # ------------------------------------------------------------------ leave

    def leave(self) -> None:
        """Announces a graceful departure to every live member at once."""
        if self.leaving:
            return
        self.leaving = True
        self._probe = None
        self._suspect_deadlines.clear()
        me = self.me
        me.status = MemberStatus.LEFT
        me.status_since = self._clock()
        frame = dead_frame(self.node_id, self.incarnation, self.node_id)
        self._queue.put(("m", self.node_id, 0), frame)
        for n, m in self.view.members.items():
            if n != self.node_id and m.is_up:
                self._send(m.addr, [frame], n)


def alive_frame(m: Member) -> bytes:
    return wire.msg_frame(
        {
            "t": "alive",
            "node": m.node_id,
            "inc": m.incarnation,
            "gen": m.generation,
            "addr": list(m.addr),
        }
    )


def suspect_frame(node_id: str, inc: int, source: str) -> bytes:
    return wire.msg_frame({"t": "suspect", "node": node_id, "inc": inc, "from": source})


def dead_frame(node_id: str, inc: int, source: str) -> bytes:
    return wire.msg_frame({"t": "dead", "node": node_id, "inc": inc, "from": source})


def next_tick(previous: float, interval: float, now: float) -> float:
    """The next tick on the original grid, skipping missed ones (time spent is subtracted)."""
    nxt = previous + interval
    if nxt <= now:
        nxt = now + interval - ((now - previous) % interval)
    return nxt
