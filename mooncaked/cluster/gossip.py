"""SWIM-style membership, state dissemination and block-index replication.

Two layers:

- ``GossipCore`` is the protocol with no I/O: it takes packets and the
  passing of time (an injected clock, an injected ``random.Random``) and
  leaves packets in ``outbox`` and work requests (syncs, pulls) for its host.
  Unit tests drive several cores over an in-memory network deterministically.
- ``ClusterService`` hosts one core on a real UDP socket and a TCP listener
  on the same port, runs its timers, syncs and pulls, and owns every task.

Membership (SWIM with memberlist's adaptations): each probe interval a node
pings the next member of a shuffled round-robin list; without an ack within
``probe_timeout_s`` it asks ``indirect_probes`` others to ping it; without
any ack by the next probe it suspects the member. A suspect that does not
refute (by gossiping ``alive`` with a higher incarnation) within
``suspect_timeout_s`` is declared dead. Ordering is by incarnation: news about
a node with a lower incarnation than known is dropped. A process starts its
incarnation (and its ``generation``) at its start time in milliseconds, so a
restarted node outranks everything said about its previous life and rejoins
at once. ``leave()`` announces ``dead`` from the node itself (status ``left``).

Dissemination: news (alive/suspect/dead, ``NodeState`` changes, block-index
deltas) is queued once and piggy-backed on every probe, ack and gossip packet
until sent ``retransmit_mult * ceil(log10(N + 1))`` times; newer news about
the same thing replaces older. Every ``gossip_interval_s`` the node also sends
a packet of pending news to ``gossip_fanout`` random members.

Anti-entropy: every ``sync_interval_s`` a push-pull exchange of the full member
list and states over TCP with one random live member, and one attempt with a
random dead one (so a healed partition reconnects; remote "dead" is only taken
as "suspect", which the live node then refutes). Whatever is still missing
after gossip (a block-index gap, a delta too big for datagrams, new segment
descriptors) is pulled from the node that owns it over TCP.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import structlog

from mooncaked.cluster import wire
from mooncaked.cluster.state import (
    ApplyResult,
    BlockDelta,
    BlockEvent,
    BlockLog,
    ClusterCounters,
    ClusterView,
    LocalState,
    Member,
    MemberStatus,
    NodeBlocks,
    NodeState,
    join_chunks,
)
from mooncaked.config import ClusterConfig

log = structlog.get_logger(__name__)

Addr = tuple[str, int]
Clock = Callable[[], float]

# Deltas bigger than this many datagrams are left to pulls instead of gossip,
# so a burst of cache activity cannot crowd membership news out of the queue.
_MAX_GOSSIP_DELTA_PACKETS = 8
# At most this many pulls and syncs run at once per node.
_MAX_INFLIGHT_PULLS = 4
_MAX_INFLIGHT_SYNCS = 2
# Room kept in a datagram for the primary message (ping, ack, ping-req).
_PRIMARY_RESERVE = 160


Key = tuple[str, str, int]


# Membership news first, then states, then block deltas: a receiver drops a
# state or delta of a member it has not heard of, so the alive must come first.
_KIND_RANK = {"m": 0, "s": 1, "b": 2}


class BroadcastQueue:
    """News waiting to be piggy-backed: fewest-sent first, bounded, keyed for replacement.

    Items sit in buckets by how often they were sent (newest first within a
    bucket), so ``take`` visits only what it sends instead of sorting the
    queue for every packet.
    """

    def __init__(self, max_items: int, counters: ClusterCounters) -> None:
        self._where: dict[Key, int] = {}
        self._buckets: list[dict[Key, bytes]] = [{}]
        self._max_items = max_items
        self._counters = counters

    def __len__(self) -> int:
        return len(self._where)

    def put(self, key: Key, frame: bytes) -> None:
        """Queue ``frame``; it replaces queued news under the same key."""
        old = self._where.get(key)
        if old is not None:
            del self._buckets[old][key]
        self._buckets[0][key] = frame
        self._where[key] = 0
        if len(self._where) > self._max_items:
            # The oldest of the most-sent items has done most of its work.
            for bucket in reversed(self._buckets):
                if bucket:
                    victim = next(iter(bucket))
                    del bucket[victim]
                    del self._where[victim]
                    self._counters.dropped_broadcasts += 1
                    break

    def take(self, budget: int, limit: int) -> list[bytes]:
        """Frames fitting in ``budget`` bytes, each counted as sent once more."""
        if not self._where or budget <= 0:
            return []
        sent: list[tuple[int, Key, bytes]] = []
        buckets = self._buckets
        for t, bucket in enumerate(buckets):
            if not bucket:
                continue
            if t >= limit:
                # The cluster shrank: these were sent often enough.
                for key in bucket:
                    del self._where[key]
                bucket.clear()
                continue
            for key in reversed(bucket):
                frame = bucket[key]
                if len(frame) > budget:
                    continue
                budget -= len(frame)
                sent.append((t, key, frame))
                if budget < 32:
                    break
            if budget < 32:
                break
        sent.sort(key=lambda item: _KIND_RANK[item[1][0]])
        out = [frame for _, _, frame in sent]
        for t, key, frame in sent:
            del buckets[t][key]
            if t + 1 >= limit:
                del self._where[key]
                continue
            if t + 1 == len(buckets):
                buckets.append({})
            buckets[t + 1][key] = frame
            self._where[key] = t + 1
        return out


@dataclass(slots=True)
class _Probe:
    target: str
    seq: int
    indirect_at: float
    acked: bool = False
    indirect_sent: bool = False


@dataclass(slots=True)
class SyncTarget:
    addr: Addr
    # None for a seed we have not met yet.
    node_id: str | None
    join: bool = False


class GossipCore:
    """The gossip protocol of one node, without I/O. See the module docstring."""

    def __init__(
        self,
        config: ClusterConfig,
        node_id: str,
        secret: bytes,
        *,
        clock: Clock,
        rng: random.Random,
        generation: int,
        local_state: Callable[[], LocalState],
        addr: Addr = ("127.0.0.1", 0),
    ) -> None:
        if generation <= 0:
            raise ValueError(f"generation must be > 0 (it orders restarts), got {generation}")
        self.config = config
        self.node_id = node_id
        self.codec = wire.Codec(secret, node_id)
        self._clock = clock
        self._rng = rng
        self._local_state = local_state
        self.view = ClusterView(node_id, clock)
        self.counters = self.view.counters
        self.incarnation = generation
        self.generation = generation
        now = clock()
        me = Member(node_id, addr, generation, generation, MemberStatus.ALIVE, now, now)
        self._me = me
        self.view.members[node_id] = me
        own = NodeBlocks(generation)
        self.view.blocks[node_id] = own
        self.blocks = BlockLog(node_id, generation, own, config.block_log_entries)
        self._local = self._poll_local() or LocalState()
        self._state_version = 0
        self._segments: tuple[Mapping[str, Any], ...] = ()
        self._segments_version = 0
        self._queue = BroadcastQueue(config.max_broadcasts, self.counters)
        self.outbox: list[tuple[Addr, bytes]] = []
        self.sync_requests: list[SyncTarget] = []
        self.pull_requests: list[str] = []
        self._pulls_inflight: set[str] = set()
        self._lag_since: dict[str, float] = {}
        # Block versions learned from deltas that did not apply (a gap), when
        # they run ahead of the version the node's state advertises.
        self._gap_versions: dict[str, tuple[int, int]] = {}
        self._suspect_deadlines: dict[str, float] = {}
        self._relays: dict[int, tuple[Addr, int, str, float]] = {}
        self._seq = 0
        # Derived from the member list; None when a status change made it stale.
        self._up_peers: list[Member] | None = None
        self._limit_cache = 0
        self._probe: _Probe | None = None
        self._probe_order: list[str] = []
        self._probe_pos = 0
        self._next_probe = now + rng.uniform(0, config.probe_interval_s)
        self._next_gossip = now + rng.uniform(0, config.gossip_interval_s)
        self._next_sync = now + config.sync_interval_s * rng.uniform(0.5, 1.0)
        self.seeds: list[Addr] = [wire.parse_addr(s) for s in config.seeds]
        self.leaving = False
        # Test hook: members whose packets are dropped both ways (a partition).
        self.blocked: frozenset[str] = frozenset()
        self._datagram_budget = config.max_message_bytes - self.codec.overhead
        self._delta_entries_per_packet = max(
            1, (self._datagram_budget - _PRIMARY_RESERVE - 64 - len(node_id.encode())) // 17
        )
        self._bump_state()

    @property
    def num_pending_broadcasts(self) -> int:
        """News still to be piggy-backed (0 once everything was sent often enough)."""
        return len(self._queue)

    # ------------------------------------------------------------------ setup

    def bind(self, addr: Addr) -> None:
        """Sets the address peers reach this node at; call before any traffic."""
        self._me.addr = addr
        self._bump_state()
        self._queue.put(("m", self.node_id, 0), self._alive_frame(self._me))

    # ----------------------------------------------------------- local changes

    def _poll_local(self) -> LocalState | None:
        try:
            local = self._local_state()
        except Exception:
            log.exception("local_state callback failed; keeping the last state")
            return None
        if not isinstance(local, LocalState):
            log.error("local_state callback returned a non-LocalState", got=type(local).__name__)
            return None
        return local

    def refresh_local(self) -> bool:
        """Polls the local state and announces it if it changed; True if it did."""
        local = self._poll_local()
        if local is None or local == self._local:
            return False
        self._local = local
        self._bump_state()
        return True

    def set_segments(self, descriptors: Sequence[Mapping[str, Any]]) -> None:
        self._segments = tuple(descriptors)
        self._segments_version += 1
        self._me.segments = self._segments
        self._me.segments_version = self._segments_version
        self._bump_state()

    def publish_block_events(self, events: Iterable[BlockEvent]) -> int:
        return self.blocks.record(events)

    def _self_state(self) -> NodeState:
        local = self._local
        addr = self._me.addr
        return NodeState(
            node_id=self.node_id,
            generation=self.generation,
            version=self._state_version,
            gossip_addr=f"{addr[0]}:{addr[1]}",
            role=local.role,
            model_id=local.model_id,
            api_addr=local.api_addr,
            draining=local.draining,
            load=local.load,
            block_version=self.blocks.version,
            num_blocks=len(self.blocks.index),
            segments_version=self._segments_version,
        )

    def _bump_state(self) -> None:
        self._state_version += 1
        st = self._self_state()
        self._me.state = st
        self._queue.put(
            ("s", self.node_id, 0), wire.msg_frame({"t": "state", **wire.state_to_json(st)})
        )

    def _flush_blocks(self) -> None:
        delta = self.blocks.flush()
        if delta is None:
            return
        pieces = delta.split(self._delta_entries_per_packet)
        if len(pieces) <= _MAX_GOSSIP_DELTA_PACKETS:
            for piece in pieces:
                self._queue.put(("b", self.node_id, piece.from_version), wire.blocks_frame(piece))
        # Either way the new block_version goes out in the state; peers that
        # miss the deltas see the lag and pull.
        self._bump_state()

    # ---------------------------------------------------------------- timers

    def next_deadline(self) -> float:
        t = min(self._next_probe, self._next_gossip, self._next_sync)
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

    def on_timer(self) -> None:
        """Runs whatever is due at ``clock()``."""
        now = self._clock()
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
        # Every timer that next_deadline() reports moves on here, leaving or
        # not: a deadline left in the past would spin the host's loop.
        if now >= self._next_probe:
            self._next_probe = _next_tick(self._next_probe, self.config.probe_interval_s, now)
        if now >= self._next_gossip:
            self._gossip_tick(now)
            self._next_gossip = _next_tick(self._next_gossip, self.config.gossip_interval_s, now)
        if now >= self._next_sync:
            if not self.leaving:
                self._sync_tick(now)
            self._next_sync = _next_tick(self._next_sync, self.config.sync_interval_s, now)

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
                self._on_suspect(probe.target, m.incarnation, self.node_id)
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
                # Blocked (partitioned) members are probed too: the probe is
                # lost on the way, as it would be in a real partition.
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
            self._send(
                m.addr,
                [
                    wire.msg_frame(
                        {
                            "t": "preq",
                            "seq": probe.seq,
                            "target": probe.target,
                            "addr": list(target.addr),
                        }
                    )
                ],
                m.node_id,
            )

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
                self._on_dead(node_id, m.incarnation, self.node_id)

    def _gossip_tick(self, now: float) -> None:
        if not self.leaving:
            self.refresh_local()
            self._flush_blocks()
            self._schedule_pulls(now)
        if not len(self._queue):
            return
        peers = self._peers_up()
        k = min(self.config.gossip_fanout, len(peers))
        for m in self._rng.sample(peers, k):
            self._send(m.addr, [wire.msg_frame({"t": "g"})], m.node_id, require_news=True)

    def _sync_tick(self, now: float) -> None:
        members = self.view.members
        up = [
            m for n, m in members.items() if n != self.node_id and m.is_up and n not in self.blocked
        ]
        if up:
            m = self._rng.choice(up)
            self.sync_requests.append(SyncTarget(m.addr, m.node_id))
        elif self.seeds:
            # Alone: keep knocking on the seeds (they may start after us).
            for addr in self.seeds:
                if addr != self._me.addr:
                    self.sync_requests.append(SyncTarget(addr, None, join=True))
        dead = [
            m for n, m in members.items() if m.status is MemberStatus.DEAD and n not in self.blocked
        ]
        if dead:
            m = self._rng.choice(dead)
            self.sync_requests.append(SyncTarget(m.addr, m.node_id))
        self._reap(now)

    def _reap(self, now: float) -> None:
        horizon = now - self.config.dead_reap_s
        for node_id, m in list(self.view.members.items()):
            if not m.is_up and m.status_since <= horizon and node_id != self.node_id:
                del self.view.members[node_id]
                self._members_changed()
                self.view.blocks.pop(node_id, None)
                self._lag_since.pop(node_id, None)
                self._gap_versions.pop(node_id, None)
                log.info("forgot member", node=self.node_id, target=node_id, status=m.status.value)

    # ------------------------------------------------------------------ send

    def _members_changed(self) -> None:
        self._up_peers = None
        self._limit_cache = 0

    def _peers_up(self) -> list[Member]:
        # Cached between status changes: sends and gossip rounds must not walk
        # the whole member list each time.
        if self._up_peers is None:
            self._up_peers = [
                m for n, m in self.view.members.items() if n != self.node_id and m.is_up
            ]
        return self._up_peers

    def _limit(self) -> int:
        if self._limit_cache <= 0:
            n = len(self._peers_up()) + 1
            self._limit_cache = self.config.retransmit_mult * max(1, math.ceil(math.log10(n + 1)))
        return self._limit_cache

    def _send(
        self,
        addr: Addr,
        frames: list[bytes],
        to_node: str | None,
        *,
        require_news: bool = False,
    ) -> None:
        if to_node is not None and to_node in self.blocked:
            self.counters.dropped_blocked += 1
            return
        budget = self._datagram_budget - sum(len(f) for f in frames)
        if to_node is not None:
            m = self.view.members.get(to_node)
            if m is not None and m.status is MemberStatus.SUSPECT:
                # Tell a suspect it is suspected, so it can refute at once.
                frame = wire.msg_frame(
                    {"t": "suspect", "node": to_node, "inc": m.incarnation, "from": self.node_id}
                )
                frames = [*frames, frame]
                budget -= len(frame)
        news = self._queue.take(budget, self._limit())
        if require_news and not news:
            return
        packet = self.codec.seal([*frames, *news])
        self.outbox.append((addr, packet))
        self.counters.packets_sent += 1
        self.counters.bytes_sent += len(packet)

    def take_outbox(self) -> list[tuple[Addr, bytes]]:
        out, self.outbox = self.outbox, []
        return out

    # --------------------------------------------------------------- receive

    def on_datagram(self, data: bytes, addr: Addr) -> None:
        """Handles one UDP datagram; garbage and forgeries are counted and dropped."""
        self.counters.packets_received += 1
        self.counters.bytes_received += len(data)
        try:
            sender, frames = self.codec.open(data, self.config.max_message_bytes)
        except wire.AuthError:
            self.counters.dropped_bad_mac += 1
            return
        except wire.WireError:
            if len(data) > self.config.max_message_bytes:
                self.counters.dropped_oversize += 1
            else:
                self.counters.dropped_malformed += 1
            return
        if sender in self.blocked:
            self.counters.dropped_blocked += 1
            return
        if sender == self.node_id:
            # Another process claims our id: a misconfiguration, not news.
            self.counters.dropped_malformed += 1
            return
        self._heard(sender)
        for kind, payload in frames:
            self._handle_frame(sender, addr, kind, payload)

    def _handle_frame(self, sender: str, addr: Addr, kind: int, payload: memoryview) -> None:
        try:
            if kind == wire.FRAME_MSG:
                msg = wire.decode_msg(payload)
                self._handle_msg(sender, addr, msg, payload)
            elif kind == wire.FRAME_BLOCKS:
                self._on_delta(wire.decode_blocks(payload), payload)
            else:
                raise wire.WireError(f"unknown frame kind {kind}")
        except wire.WireError as exc:
            self.counters.dropped_malformed += 1
            log.debug("dropped malformed frame", node=self.node_id, sender=sender, error=str(exc))

    def _heard(self, sender: str) -> None:
        m = self.view.members.get(sender)
        if m is not None:
            m.last_heard = self._clock()

    def _handle_msg(self, sender: str, addr: Addr, msg: dict[str, Any], raw: memoryview) -> None:
        t = msg["t"]
        if t == "g":
            return
        if t == "ping":
            seq = wire.get_int(msg, "seq")
            if wire.get_str(msg, "target") != self.node_id:
                # Meant for a previous owner of this address.
                self.counters.dropped_malformed += 1
                return
            self._send(addr, [wire.msg_frame({"t": "ack", "seq": seq})], sender)
        elif t == "ack":
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
        elif t == "preq":
            seq = wire.get_int(msg, "seq")
            target = wire.get_str(msg, "target")
            target_addr = wire.get_addr(msg, "addr")
            self._seq += 1
            self._relays[self._seq] = (
                addr,
                seq,
                sender,
                self._clock() + self.config.probe_interval_s,
            )
            self._send(
                target_addr,
                [wire.msg_frame({"t": "ping", "seq": self._seq, "target": target})],
                target,
            )
        elif t == "alive":
            self._on_alive(
                wire.get_str(msg, "node"),
                wire.get_int(msg, "inc"),
                wire.get_int(msg, "gen"),
                wire.get_addr(msg, "addr"),
                _frame(wire.FRAME_MSG, raw),
            )
        elif t == "suspect":
            self._on_suspect(
                wire.get_str(msg, "node"), wire.get_int(msg, "inc"), wire.get_str(msg, "from")
            )
        elif t == "dead":
            self._on_dead(
                wire.get_str(msg, "node"), wire.get_int(msg, "inc"), wire.get_str(msg, "from")
            )
        elif t == "state":
            # Most state news arrives again and again: check before decoding it all.
            node_id = msg.get("node")
            if not isinstance(node_id, str):
                raise wire.WireError("field 'node' must be a string")
            m = self.view.members.get(node_id)
            cur = None if m is None else m.state
            if m is None or (
                cur is not None
                and msg.get("gen") == cur.generation
                and isinstance(msg.get("ver"), int)
                and msg["ver"] <= cur.version
            ):
                return
            self._on_state(wire.state_from_json(msg), _frame(wire.FRAME_MSG, raw))
        else:
            raise wire.WireError(f"unknown message type {t!r}")

    # ------------------------------------------------------- membership rules

    def _alive_frame(self, m: Member) -> bytes:
        return wire.msg_frame(
            {
                "t": "alive",
                "node": m.node_id,
                "inc": m.incarnation,
                "gen": m.generation,
                "addr": list(m.addr),
            }
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
        self.incarnation = max(self.incarnation, inc) + 1
        self._me.incarnation = self.incarnation
        self.counters.refutations += 1
        log.info("refuting suspicion", node=self.node_id, incarnation=self.incarnation)
        self._queue.put(("m", self.node_id, 0), self._alive_frame(self._me))

    def _on_alive(
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
            self.view.blocks[node_id] = NodeBlocks(gen)
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
                self.view.blocks[node_id] = NodeBlocks(gen)
            elif not was_up:
                self.view.blocks[node_id] = NodeBlocks(gen)
        if spread:
            self._queue.put(("m", node_id, 0), frame if frame is not None else self._alive_frame(m))

    def _on_suspect(self, node_id: str, inc: int, source: str) -> None:
        if node_id == self.node_id:
            if inc >= self.incarnation and not self.leaving:
                self._refute(inc)
            return
        m = self.view.members.get(node_id)
        if m is None or inc < m.incarnation or m.status is not MemberStatus.ALIVE:
            return
        m.incarnation = inc
        self._set_status(m, MemberStatus.SUSPECT)
        self._suspect_deadlines[node_id] = self._clock() + self.config.suspect_timeout_s
        self._queue.put(
            ("m", node_id, 0),
            wire.msg_frame({"t": "suspect", "node": node_id, "inc": inc, "from": source}),
        )

    def _on_dead(self, node_id: str, inc: int, source: str) -> None:
        left = source == node_id
        if node_id == self.node_id:
            if inc >= self.incarnation and not self.leaving:
                self._refute(inc)
            return
        m = self.view.members.get(node_id)
        if m is None or inc < m.incarnation or not m.is_up:
            return
        m.incarnation = inc
        self._suspect_deadlines.pop(node_id, None)
        self._set_status(m, MemberStatus.LEFT if left else MemberStatus.DEAD)
        # A down node serves nothing: forget its blocks (a pull restores them
        # if it turns out to be alive after all).
        self.view.blocks[node_id] = NodeBlocks(m.generation)
        self._lag_since.pop(node_id, None)
        self._queue.put(
            ("m", node_id, 0),
            wire.msg_frame({"t": "dead", "node": node_id, "inc": inc, "from": source}),
        )

    def _on_state(self, st: NodeState, frame: bytes | None = None, *, spread: bool = True) -> bool:
        if st.node_id == self.node_id:
            return False
        m = self.view.members.get(st.node_id)
        # States of unknown members or other generations wait for the alive news.
        if m is None or st.generation != m.generation:
            return False
        cur = m.state
        if cur is not None and st.version <= cur.version:
            return False
        m.state = st
        m.last_heard = self._clock()
        if spread:
            self._queue.put(
                ("s", st.node_id, 0),
                frame
                if frame is not None
                else wire.msg_frame({"t": "state", **wire.state_to_json(st)}),
            )
        self._check_lag(m)
        return True

    def _on_delta(self, delta: BlockDelta, raw: memoryview | None = None) -> ApplyResult | None:
        node_id = delta.node_id
        if node_id == self.node_id:
            return None
        m = self.view.members.get(node_id)
        if m is None or not m.is_up or delta.generation != m.generation:
            return None
        index = self.view.blocks[node_id]
        result = index.apply(delta)
        if result is ApplyResult.STALE:
            return result
        if result is ApplyResult.APPLIED:
            self.counters.block_deltas_applied += 1
            self.counters.block_entries_applied += delta.num_entries
        else:
            self.counters.block_gaps += 1
            self._gap_versions[node_id] = (delta.generation, delta.to_version)
        if raw is not None and not delta.is_snapshot:
            # Pass it on: others may still miss it, gap or not here.
            self._queue.put(("b", node_id, delta.from_version), _frame(wire.FRAME_BLOCKS, raw))
        self._check_lag(m)
        return result

    # --------------------------------------------------------- repair (pulls)

    def _is_lagging(self, m: Member) -> bool:
        st = m.state
        if st is None or not m.is_up:
            return False
        index = self.view.blocks.get(m.node_id)
        if index is None:
            return False
        wanted = st.block_version
        gap = self._gap_versions.get(m.node_id)
        if gap is not None:
            if gap[0] == index.generation and gap[1] > index.version:
                wanted = max(wanted, gap[1])
            else:
                del self._gap_versions[m.node_id]
        return (
            index.generation != st.generation
            or index.version < wanted
            or m.segments_version < st.segments_version
        )

    def _check_lag(self, m: Member) -> None:
        if self._is_lagging(m):
            self._lag_since.setdefault(m.node_id, self._clock())
        else:
            self._lag_since.pop(m.node_id, None)

    def _schedule_pulls(self, now: float) -> None:
        # Gossip gets two rounds to deliver before a pull is worth a connection.
        delay = 2 * self.config.gossip_interval_s
        for node_id, since in list(self._lag_since.items()):
            if len(self._pulls_inflight) >= _MAX_INFLIGHT_PULLS:
                return
            if node_id in self._pulls_inflight or now - since < delay or node_id in self.blocked:
                continue
            m = self.view.members.get(node_id)
            if m is None or not self._is_lagging(m):
                del self._lag_since[node_id]
                continue
            self._pulls_inflight.add(node_id)
            self.pull_requests.append(node_id)

    def pull_request(self, node_id: str) -> bytes:
        """The TCP request asking ``node_id`` for what this replica lacks."""
        index = self.view.blocks.get(node_id)
        gen, version = (0, 0) if index is None else (index.generation, index.version)
        return self.codec.seal([wire.msg_frame({"t": "pull", "gen": gen, "since": version})])

    def pull_done(self, node_id: str, ok: bool) -> None:
        self._pulls_inflight.discard(node_id)
        if ok:
            self.counters.pulls_ok += 1
        else:
            self.counters.pulls_failed += 1
        m = self.view.members.get(node_id)
        if m is not None and self._is_lagging(m):
            # Still behind (or failed): wait a full delay before trying again.
            self._lag_since[node_id] = self._clock()
        else:
            self._lag_since.pop(node_id, None)

    def handle_pull_reply(self, node_id: str, packets: Sequence[bytes]) -> None:
        """Applies the owner's answer to ``pull_request``; raises WireError if it is bad."""
        if not packets:
            raise wire.WireError("empty pull reply")
        head = self.open_tcp(packets[0], expect_sender=node_id)
        msg = wire.decode_msg(head[0][1]) if head and head[0][0] == wire.FRAME_MSG else None
        if msg is None or msg["t"] != "pulled":
            raise wire.WireError("pull reply does not start with a 'pulled' message")
        st_obj = msg.get("state")
        if not isinstance(st_obj, dict):
            raise wire.WireError("pull reply without a state")
        st = wire.state_from_json(st_obj)
        if st.node_id != node_id:
            raise wire.WireError("pull reply describes another node")
        segments = wire.get_segments(msg, "seg")
        self._on_state(st)
        m = self.view.members.get(node_id)
        if (
            m is not None
            and m.generation == st.generation
            and st.segments_version > m.segments_version
        ):
            m.segments = segments
            m.segments_version = st.segments_version
        pieces: list[BlockDelta] = []
        for packet in packets[1:]:
            for kind, payload in self.open_tcp(packet, expect_sender=node_id):
                if kind != wire.FRAME_BLOCKS:
                    raise wire.WireError("pull reply chunk is not a block delta")
                pieces.append(wire.decode_blocks(payload))
        if pieces:
            delta = join_chunks(pieces)
            if delta.node_id != node_id:
                raise wire.WireError("pull reply carries another node's blocks")
            self._on_delta(delta)

    def serve_pull(self, msg: Mapping[str, Any]) -> list[bytes]:
        """Answers a pull: our full state and segments, then block-index chunks."""
        gen = wire.get_int(msg, "gen")
        since = wire.get_int(msg, "since")
        delta = self.blocks.since(gen, since)
        max_entries = max(1, (self.config.max_sync_bytes - 1024) // 17)
        chunks = [] if delta is None else delta.chunks(max_entries)
        head = {
            "t": "pulled",
            "state": wire.state_to_json(self._me.state or self._self_state()),
            "seg": list(self._segments),
            "chunks": len(chunks),
        }
        out = [self.codec.seal([wire.msg_frame(head)])]
        out.extend(self.codec.seal([wire.blocks_frame(c)]) for c in chunks)
        return out

    # ------------------------------------------------------- push-pull sync

    def sync_packet(self, t: str = "sync", join: bool = False) -> bytes:
        members = []
        for m in self.view.members.values():
            members.append(
                {
                    "node": m.node_id,
                    "inc": m.incarnation,
                    "gen": m.generation,
                    "status": m.status.value,
                    "addr": list(m.addr),
                    "state": None if m.state is None else wire.state_to_json(m.state),
                    "seg": list(m.segments),
                    "sver": m.segments_version,
                }
            )
        return self.codec.seal([wire.msg_frame({"t": t, "join": join, "members": members})])

    def merge_sync(self, sender: str, msg: Mapping[str, Any]) -> None:
        """Merges a remote member list; remote 'dead' is only taken as 'suspect'.

        Alive and state news about third parties is applied but not passed on:
        the peer already spreads what it learned by gossip, and re-spreading a
        whole member list would make every join cost O(N) broadcasts per
        node. News about the peer itself (how a joiner becomes known) and
        every accusation (so the accused hears it and can refute) do spread.
        """
        entries = msg.get("members")
        if not isinstance(entries, list):
            raise wire.WireError("sync without a member list")
        for e in entries:
            if not isinstance(e, dict):
                raise wire.WireError("sync member entry is not an object")
            node_id = wire.get_str(e, "node")
            inc = wire.get_int(e, "inc")
            gen = wire.get_int(e, "gen")
            addr = wire.get_addr(e, "addr")
            status = e.get("status")
            spread = node_id == sender
            if status == MemberStatus.ALIVE:
                self._on_alive(node_id, inc, gen, addr, spread=spread)
            elif status in (MemberStatus.SUSPECT, MemberStatus.DEAD):
                self._on_suspect(node_id, inc, sender)
            elif status == MemberStatus.LEFT:
                self._on_dead(node_id, inc, node_id)
            else:
                raise wire.WireError(f"unknown member status {status!r}")
            st_obj = e.get("state")
            if st_obj is None:
                continue
            if not isinstance(st_obj, dict):
                raise wire.WireError("sync member state is not an object")
            m = self.view.members.get(node_id)
            cur = None if m is None else m.state
            if (
                cur is not None
                and st_obj.get("gen") == cur.generation
                and isinstance(st_obj.get("ver"), int)
                and st_obj["ver"] <= cur.version
                and m is not None
                and wire.get_int(e, "sver") <= m.segments_version
            ):
                continue  # nothing new: skip decoding it
            st = wire.state_from_json(st_obj)
            if st.node_id != node_id:
                raise wire.WireError("sync member state names another node")
            self._on_state(st, spread=spread)
            m = self.view.members.get(node_id)
            # The sender's copy of the segments, at the version it holds.
            sver = wire.get_int(e, "sver")
            if (
                m is not None
                and node_id != self.node_id
                and m.generation == st.generation
                and m.segments_version < sver
            ):
                m.segments = wire.get_segments(e, "seg")
                m.segments_version = sver
                self._check_lag(m)

    def open_tcp(
        self, packet: bytes, expect_sender: str | None = None
    ) -> list[tuple[int, memoryview]]:
        try:
            sender, frames = self.codec.open(packet, self.config.max_sync_bytes)
        except wire.AuthError:
            self.counters.dropped_bad_mac += 1
            raise
        if expect_sender is not None and sender != expect_sender:
            raise wire.WireError(f"expected a reply from {expect_sender}, got one from {sender}")
        return frames

    def handle_tcp_request(self, packet: bytes) -> list[bytes]:
        """Serves one TCP request (sync or pull); returns the reply packets.

        Raises WireError for garbage or forgeries, and PermissionError for a
        blocked sender (test partitions).
        """
        try:
            sender, frames = self.codec.open(packet, self.config.max_sync_bytes)
        except wire.AuthError:
            self.counters.dropped_bad_mac += 1
            raise
        if sender in self.blocked:
            self.counters.dropped_blocked += 1
            raise PermissionError(f"{sender} is blocked")
        if not frames or frames[0][0] != wire.FRAME_MSG:
            raise wire.WireError("TCP request does not start with a control message")
        msg = wire.decode_msg(frames[0][1])
        self._heard(sender)
        if msg["t"] == "sync":
            self.merge_sync(sender, msg)
            self.counters.syncs_ok += 1
            return [self.sync_packet("sync_reply")]
        if msg["t"] == "pull":
            return self.serve_pull(msg)
        raise wire.WireError(f"unknown TCP request {msg['t']!r}")

    def handle_sync_reply(self, packet: bytes, expect_sender: str | None) -> str:
        """Merges the reply of a sync we started; returns the peer's node id."""
        try:
            sender, frames = self.codec.open(packet, self.config.max_sync_bytes)
        except wire.AuthError:
            self.counters.dropped_bad_mac += 1
            raise
        if expect_sender is not None and sender != expect_sender:
            raise wire.WireError(f"sync reply from {sender}, expected {expect_sender}")
        if sender in self.blocked:
            self.counters.dropped_blocked += 1
            raise PermissionError(f"{sender} is blocked")
        if not frames or frames[0][0] != wire.FRAME_MSG:
            raise wire.WireError("sync reply does not start with a control message")
        msg = wire.decode_msg(frames[0][1])
        if msg["t"] != "sync_reply":
            raise wire.WireError(f"expected a sync_reply, got {msg['t']!r}")
        self._heard(sender)
        self.merge_sync(sender, msg)
        self.counters.syncs_ok += 1
        return sender

    # ------------------------------------------------------------------ leave

    def leave(self) -> None:
        """Announces a graceful departure to every live member at once."""
        if self.leaving:
            return
        self.leaving = True
        self._probe = None
        self._suspect_deadlines.clear()
        me = self._me
        me.status = MemberStatus.LEFT
        me.status_since = self._clock()
        frame = wire.msg_frame(
            {"t": "dead", "node": self.node_id, "inc": self.incarnation, "from": self.node_id}
        )
        self._queue.put(("m", self.node_id, 0), frame)
        for n, m in self.view.members.items():
            if n != self.node_id and m.is_up:
                self._send(m.addr, [frame], n)


def _frame(kind: int, payload: memoryview) -> bytes:
    return wire.FRAME_HEAD.pack(kind, len(payload)) + bytes(payload)


def _next_tick(previous: float, interval: float, now: float) -> float:
    """The next tick on the original grid, skipping missed ones (time spent is subtracted)."""
    nxt = previous + interval
    if nxt <= now:
        nxt = now + interval - ((now - previous) % interval)
    return nxt


# ============================================================================ service


class TaskOwner:
    """Keeps a reference to every background task, logs their failures, cancels them on close."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=f"{self._name}:{name}")
        self.adopt(task)
        return task

    def adopt(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", task=task.get_name(), exc_info=task.exception())

    async def close(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, service: ClusterService) -> None:
        self._service = service

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self._service._on_datagram(data, (addr[0], addr[1]))

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable from a dead peer and the like: the probe logic
        # already treats the silence as failure.
        log.debug("udp error", error=str(exc))


class ClusterService:
    """One node's gossip subsystem on real sockets.

    Lifecycle: ``await start()`` binds UDP and TCP on one port and joins the
    seeds; ``await leave()`` announces a graceful departure; ``await close()``
    stops every task and socket (safe to call twice, and after a failed start).
    """

    def __init__(
        self,
        config: ClusterConfig,
        node_id: str,
        secret: bytes,
        *,
        local_state: Callable[[], LocalState] = LocalState,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
        generation: int | None = None,
    ) -> None:
        self.config = config
        self.node_id = node_id
        self._clock = clock
        self.core = GossipCore(
            config,
            node_id,
            secret,
            clock=clock,
            rng=rng if rng is not None else random.Random(),
            generation=generation if generation is not None else time.time_ns() // 1_000_000,
            local_state=local_state,
            addr=(config.gossip_host, config.gossip_port),
        )
        self._tasks = TaskOwner(f"gossip[{node_id}]")
        self._udp: asyncio.DatagramTransport | None = None
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._wake = asyncio.Event()
        self._sleep_until = 0.0
        self._syncs_inflight = 0
        # Open inbound TCP connections (sync and pull requests being served).
        self._conns: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        self._closed = False

    # ------------------------------------------------------------- accessors

    @property
    def view(self) -> ClusterView:
        return self.core.view

    @property
    def counters(self) -> ClusterCounters:
        return self.core.counters

    @property
    def gossip_port(self) -> int:
        if self._port is None:
            raise RuntimeError("the cluster service is not bound; call start() first")
        return self._port

    @property
    def gossip_addr(self) -> Addr:
        return (self.config.gossip_host, self.gossip_port)

    # ------------------------------------------------------- local publishing

    def publish_block_events(self, events: Iterable[BlockEvent]) -> int:
        """Records local (hash, tier, stored|removed) events; they spread with the next gossip round.

        Returns how many changed the local index. Raises ValueError on a bad event.
        """
        return self.core.publish_block_events(events)

    def set_segments(self, descriptors: Sequence[Mapping[str, Any]]) -> None:
        """Publishes transfer segment descriptors (JSON-able dicts, opaque to gossip)."""
        try:
            orjson.dumps(list(descriptors))
        except TypeError as exc:
            raise ValueError(f"segment descriptors must be JSON-able dicts: {exc}") from None
        if not all(isinstance(d, Mapping) for d in descriptors):
            raise ValueError("segment descriptors must be dicts")
        self.core.set_segments([dict(d) for d in descriptors])

    def refresh_state(self) -> None:
        """Polls ``local_state`` now instead of at the next gossip round (e.g. on drain)."""
        self.core.refresh_local()

    def set_blocked_peers(self, node_ids: Iterable[str]) -> None:
        """Test hook: drop all traffic to and from these members (a partition)."""
        self.core.blocked = frozenset(node_ids)

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> int:
        """Binds, starts the protocol loop and joins the seeds; returns how many seeds answered."""
        if self._udp is not None or self._closed:
            raise RuntimeError("a ClusterService starts once")
        try:
            await self._bind()
            self.core.bind(self.gossip_addr)
            self._tasks.spawn(self._run(), "loop")
            return await self._join()
        except BaseException:
            await self.close()
            raise

    async def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        host, port = self.config.gossip_host, self.config.gossip_port
        # UDP and TCP share the port number; with port 0 the UDP bind picks it
        # and TCP may find it taken, so try a few.
        attempts = 1 if port else 8
        for attempt in range(attempts):
            udp, _ = await loop.create_datagram_endpoint(
                lambda: _UdpProtocol(self), local_addr=(host, port)
            )
            bound = udp.get_extra_info("sockname")[1]
            try:
                self._server = await asyncio.start_server(
                    self._serve_tcp, host, bound, reuse_address=True
                )
            except OSError:
                udp.close()
                if attempt == attempts - 1:
                    raise
                continue
            self._udp = udp
            self._port = bound
            log.info("gossip listening", node=self.node_id, addr=f"{host}:{bound}")
            return

    async def _join(self) -> int:
        own = self.gossip_addr
        seeds = [a for a in self.core.seeds if a != own]
        if not seeds:
            return 0
        results = await asyncio.gather(
            *(self._sync_with(SyncTarget(a, None, join=True)) for a in seeds)
        )
        joined = sum(1 for ok in results if ok)
        if joined == 0:
            log.warning(
                "no seed answered; retrying every sync interval",
                node=self.node_id,
                seeds=self.config.seeds,
            )
        return joined

    async def leave(self) -> None:
        """Tells the cluster this node is leaving, then lets one more gossip round go out."""
        if self._udp is None or self.core.leaving:
            return
        alone = not any(m.is_up for n, m in self.view.members.items() if n != self.node_id)
        self.core.leave()
        self._flush()
        if alone:
            return  # nobody to tell: no round to wait for
        await asyncio.sleep(self.config.gossip_interval_s)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in self._conns.values():
            writer.transport.abort()
        if self._conns:
            await asyncio.wait(list(self._conns), timeout=self.config.sync_timeout_s)
        await self._tasks.close()
        if server is not None:
            await server.wait_closed()
        udp, self._udp = self._udp, None
        if udp is not None:
            udp.close()

    # ------------------------------------------------------------------- loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        while True:
            delay = core.next_deadline() - self._clock()
            if delay > 0:
                self._wake.clear()
                self._sleep_until = core.next_deadline()
                handle = loop.call_later(delay, self._wake.set)
                try:
                    await self._wake.wait()
                finally:
                    handle.cancel()
            # One loop turn first: acks and refutations already in the socket
            # buffer are read before a timer judges anyone (and an overdue
            # deadline can never starve the loop).
            await asyncio.sleep(0)
            try:
                core.on_timer()
            except Exception:
                self.counters.handler_errors += 1
                log.exception("gossip timer failed", node=self.node_id)
            self._flush()
            self._dispatch()

    def _on_datagram(self, data: bytes, addr: Addr) -> None:
        try:
            self.core.on_datagram(data, addr)
        except Exception:
            # A bug in a handler must not take the socket down with it.
            self.counters.handler_errors += 1
            log.exception("gossip packet handler failed", node=self.node_id)
        self._flush()
        if self.core.next_deadline() < self._sleep_until:
            self._wake.set()

    def _flush(self) -> None:
        out = self.core.take_outbox()
        udp = self._udp
        if udp is None or udp.is_closing():
            return
        for addr, packet in out:
            udp.sendto(packet, addr)

    def _dispatch(self) -> None:
        core = self.core
        if core.sync_requests:
            requests, core.sync_requests = core.sync_requests, []
            for target in requests:
                if self._syncs_inflight >= _MAX_INFLIGHT_SYNCS:
                    break
                self._syncs_inflight += 1
                self._tasks.spawn(self._sync_task(target), "sync")
        if core.pull_requests:
            requests, core.pull_requests = core.pull_requests, []
            for node_id in requests:
                self._tasks.spawn(self._pull(node_id), f"pull:{node_id}")

    # ------------------------------------------------------------------- TCP

    async def _sync_task(self, target: SyncTarget) -> None:
        try:
            await self._sync_with(target)
        finally:
            self._syncs_inflight -= 1

    async def _sync_with(self, target: SyncTarget) -> bool:
        try:
            async with asyncio.timeout(self.config.sync_timeout_s):
                reader, writer = await asyncio.open_connection(*target.addr)
                try:
                    await _write_packets(writer, [self.core.sync_packet("sync", target.join)])
                    reply = await _read_packet(reader, self.config.max_sync_bytes)
                    self.core.handle_sync_reply(reply, target.node_id)
                finally:
                    writer.close()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, wire.WireError) as exc:
            self.counters.syncs_failed += 1
            log.debug(
                "sync failed",
                node=self.node_id,
                peer=target.node_id,
                addr=target.addr,
                error=repr(exc),
            )
            return False
        self._flush()
        self._wake.set()
        return True

    async def _pull(self, node_id: str) -> None:
        ok = False
        try:
            m = self.view.members.get(node_id)
            if m is None:
                return
            async with asyncio.timeout(self.config.sync_timeout_s * 4):
                reader, writer = await asyncio.open_connection(*m.addr)
                try:
                    await _write_packets(writer, [self.core.pull_request(node_id)])
                    head = await _read_packet(reader, self.config.max_sync_bytes)
                    frames = self.core.open_tcp(head, expect_sender=node_id)
                    if not frames or frames[0][0] != wire.FRAME_MSG:
                        raise wire.WireError("pull reply does not start with a control message")
                    num_chunks = wire.get_int(wire.decode_msg(frames[0][1]), "chunks")
                    packets = [head]
                    for _ in range(num_chunks):
                        packets.append(await _read_packet(reader, self.config.max_sync_bytes))
                finally:
                    writer.close()
            self.core.handle_pull_reply(node_id, packets)
            ok = True
        except (OSError, TimeoutError, asyncio.IncompleteReadError, wire.WireError) as exc:
            log.debug("pull failed", node=self.node_id, peer=node_id, error=repr(exc))
        finally:
            self.core.pull_done(node_id, ok)
            self._flush()

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # asyncio owns this task; close() ends it by aborting its transport
        # (cancelling it would make asyncio report the cancellation as an error).
        task = asyncio.current_task()
        if self._closed or task is None:
            writer.close()
            return
        self._conns[task] = writer
        try:
            async with asyncio.timeout(self.config.sync_timeout_s * 4):
                packet = await _read_packet(reader, self.config.max_sync_bytes)
                replies = self.core.handle_tcp_request(packet)
                await _write_packets(writer, replies)
        except wire.WireError as exc:
            if not isinstance(exc, wire.AuthError):
                self.counters.dropped_malformed += 1
            log.debug("rejected TCP request", node=self.node_id, error=str(exc))
        except (OSError, TimeoutError, asyncio.IncompleteReadError, PermissionError):
            pass
        except Exception:
            self.counters.handler_errors += 1
            log.exception("gossip TCP handler failed", node=self.node_id)
        finally:
            self._conns.pop(task, None)
            writer.close()
        self._flush()
        self._wake.set()


async def _read_packet(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    head = await reader.readexactly(wire.TCP_LEN.size)
    (length,) = wire.TCP_LEN.unpack(head)
    if length > max_bytes:
        raise wire.WireError(f"TCP message of {length} bytes exceeds the {max_bytes} byte limit")
    return await reader.readexactly(length)


async def _write_packets(writer: asyncio.StreamWriter, packets: Sequence[bytes]) -> None:
    for packet in packets:
        writer.write(wire.TCP_LEN.pack(len(packet)))
        writer.write(packet)
        await writer.drain()
