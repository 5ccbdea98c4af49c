"""``GossipCore``: the gossip protocol of one node, without I/O.

It takes packets and the passing of time (an injected clock, an injected
``random.Random``) and leaves packets in ``outbox`` and work requests (syncs,
pulls) for its host. Unit tests drive several cores over an in-memory
network deterministically; ``ClusterService`` hosts one on real sockets.

The core composes the membership (``membership.py``), the block-index
replication (``blocks.py``) and the broadcast queue (``queue.py``), and
itself carries what ties them together:

- Dissemination: news (alive/suspect/dead, ``NodeState`` changes,
  block-index deltas) is queued once and piggy-backed on every probe, ack and
  gossip packet until sent ``retransmit_mult * ceil(log10(N + 1))`` times;
  newer news about the same thing replaces older. Every ``gossip_interval_s``
  the node also sends a packet of pending news to ``gossip_fanout`` random
  members.
- Anti-entropy: every ``sync_interval_s`` a push-pull exchange of the full
  member list and states over TCP with one random live member, and one
  attempt with a random dead one (so a healed partition reconnects; remote
  "dead" is only taken as "suspect", which the live node then refutes).
  Whatever is still missing after gossip (a block-index gap, a delta too big
  for datagrams, new segment descriptors) is pulled from its owner over TCP.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from mooncaked.cluster import wire
from mooncaked.cluster.block_index import BlockDelta, BlockEvent, BlockLog
from mooncaked.cluster.gossip.blocks import BlockReplication
from mooncaked.cluster.gossip.membership import (
    Membership,
    WallClock,
    next_tick,
    suspect_frame,
)
from mooncaked.cluster.gossip.queue import BroadcastQueue
from mooncaked.cluster.state import ClusterView, LocalState, Member, MemberStatus, NodeState
from mooncaked.config import ClusterConfig

log = structlog.get_logger(__name__)

Addr = tuple[str, int]
Clock = Callable[[], float]
Frames = list[tuple[int, memoryview]]


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
        wall_clock: WallClock,
        rng: random.Random,
        generation: int,
        local_state: Callable[[], LocalState],
        addr: Addr = ("127.0.0.1", 0),
    ) -> None:
        """``clock`` reads monotonic seconds (liveness, timers); ``wall_clock`` reads
        wall-clock milliseconds, where incarnations start: ``generation`` is the
        process's start time on it.
        """
        if generation <= 0:
            raise ValueError(f"generation must be > 0 (it orders restarts), got {generation}")
        ahead_ms = generation - wall_clock()
        if ahead_ms > config.max_clock_skew_s * 1000:
            # Every peer would refuse this node's news.
            raise ValueError(
                f"generation {generation} is {ahead_ms / 1000:.3f} s ahead of the wall clock, "
                f"beyond cluster.max_clock_skew_s = {config.max_clock_skew_s}; "
                "use the start time in milliseconds"
            )
        self.config = config
        self.node_id = node_id
        self.codec = wire.Codec(secret, node_id)
        self._clock = clock
        self._rng = rng
        self._local_state = local_state
        self.view = ClusterView(node_id, clock)
        self.counters = self.view.counters
        self.generation = generation
        self._queue = BroadcastQueue(config.max_broadcasts, self.counters)
        self._datagram_budget = config.max_message_bytes - self.codec.overhead
        self.outbox: list[tuple[Addr, bytes]] = []
        self.sync_requests: list[SyncTarget] = []
        self.replication = BlockReplication(
            config,
            self.view,
            generation=generation,
            clock=clock,
            queue=self._queue,
            datagram_budget=self._datagram_budget,
        )
        self.membership = Membership(
            config,
            self.view,
            clock=clock,
            wall_clock=wall_clock,
            rng=rng,
            generation=generation,
            addr=addr,
            queue=self._queue,
            send=self._send,
            listener=_MemberEvents(self.replication, self.view),
        )
        self._local = self._poll_local() or LocalState()
        self._state_version = 0
        self._segments: tuple[Mapping[str, Any], ...] = ()
        self._segments_version = 0
        now = clock()
        self._next_gossip = now + rng.uniform(0, config.gossip_interval_s)
        self._next_sync = now + config.sync_interval_s * rng.uniform(0.5, 1.0)
        self.seeds: list[Addr] = [wire.parse_addr(s) for s in config.seeds]
        self._bump_state()

    # ------------------------------------------------------------- accessors

    @property
    def incarnation(self) -> int:
        return self.membership.incarnation

    @property
    def leaving(self) -> bool:
        return self.membership.leaving

    @property
    def blocks(self) -> BlockLog:
        """This node's own block log."""
        return self.replication.log

    @property
    def pull_requests(self) -> list[str]:
        """Members whose replica lags; the host pulls each and reports ``pull_done``."""
        return self.replication.pull_requests

    @property
    def num_pending_broadcasts(self) -> int:
        """News still to be piggy-backed (0 once everything was sent often enough)."""
        return len(self._queue)

    def take_outbox(self) -> list[tuple[Addr, bytes]]:
        out, self.outbox = self.outbox, []
        return out

    def take_sync_requests(self) -> list[SyncTarget]:
        out, self.sync_requests = self.sync_requests, []
        return out

    def take_pull_requests(self) -> list[str]:
        out = list(self.replication.pull_requests)
        self.replication.pull_requests.clear()
        return out

    # ------------------------------------------------------------------ setup

    def bind(self, addr: Addr) -> None:
        """Sets the address peers reach this node at; call before any traffic."""
        self.membership.me.addr = addr
        self._bump_state()
        self.membership.announce()

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
        me = self.membership.me
        self._segments = tuple(descriptors)
        self._segments_version += 1
        me.segments = self._segments
        me.segments_version = self._segments_version
        self._bump_state()

    def publish_block_events(self, events: Iterable[BlockEvent]) -> int:
        return self.replication.log.record(events)

    def _self_state(self) -> NodeState:
        local = self._local
        addr = self.membership.me.addr
        log_ = self.replication.log
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
            block_version=log_.version,
            num_blocks=len(log_.index),
            segments_version=self._segments_version,
            costs=local.costs,
            forecast=local.forecast,
            stage=local.stage,
            memory=local.memory,
            offload=local.offload,
        )

    def _bump_state(self) -> None:
        self._state_version += 1
        st = self._self_state()
        self.membership.me.state = st
        self._queue.put(("s", self.node_id, 0), state_frame(st))

    # ---------------------------------------------------------------- timers

    def next_deadline(self) -> float:
        return min(self.membership.next_deadline(), self._next_gossip, self._next_sync)

    def on_timer(self) -> None:
        """Runs whatever is due at ``clock()``."""
        now = self._clock()
        self.membership.on_timer(now)
        # Every timer that next_deadline() reports moves on here, leaving or
        # not: a deadline left in the past would spin the host's loop.
        if now >= self._next_gossip:
            self._gossip_tick(now)
            self._next_gossip = next_tick(self._next_gossip, self.config.gossip_interval_s, now)
        if now >= self._next_sync:
            if not self.leaving:
                self._sync_tick(now)
            self._next_sync = next_tick(self._next_sync, self.config.sync_interval_s, now)

    def _gossip_tick(self, now: float) -> None:
        if not self.leaving:
            self.refresh_local()
            if self.replication.flush():
                self._bump_state()
            self.replication.schedule_pulls(now)
        if not len(self._queue):
            return
        peers = self.membership.peers_up()
        k = min(self.config.gossip_fanout, len(peers))
        for m in self._rng.sample(peers, k):
            self._send(m.addr, [wire.msg_frame({"t": "g"})], m.node_id, require_news=True)

    def _sync_tick(self, now: float) -> None:
        members = self.view.members
        up = self.membership.peers_up()
        if up:
            m = self._rng.choice(up)
            self.sync_requests.append(SyncTarget(m.addr, m.node_id))
        elif self.seeds:
            # Alone: keep knocking on the seeds (they may start after us).
            for addr in self.seeds:
                if addr != self.membership.me.addr:
                    self.sync_requests.append(SyncTarget(addr, None, join=True))
        dead = [m for m in members.values() if m.status is MemberStatus.DEAD]
        if dead:
            m = self._rng.choice(dead)
            self.sync_requests.append(SyncTarget(m.addr, m.node_id))
        self.membership.reap(now)

    # ------------------------------------------------------------------ send

    def _send(
        self,
        addr: Addr,
        frames: list[bytes],
        to_node: str | None,
        *,
        require_news: bool = False,
    ) -> None:
        budget = self._datagram_budget - sum(len(f) for f in frames)
        if to_node is not None:
            m = self.view.members.get(to_node)
            if m is not None and m.status is MemberStatus.SUSPECT:
                # Tell a suspect it is suspected, so it can refute at once.
                frame = suspect_frame(to_node, m.incarnation, self.node_id)
                frames = [*frames, frame]
                budget -= len(frame)
        news = self._queue.take(budget, self.membership.retransmit_limit())
        if require_news and not news:
            return
        packet = self.codec.seal([*frames, *news])
        self.outbox.append((addr, packet))
        self.counters.packets_sent += 1
        self.counters.bytes_sent += len(packet)

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
                self._handle_msg(sender, addr, wire.decode_msg(payload), payload)
            elif kind == wire.FRAME_BLOCKS:
                self.replication.on_delta(wire.decode_blocks(payload), payload)
            else:
                raise wire.WireError(f"unknown frame kind {kind}")
        except wire.BoundsError as exc:
            self.counters.dropped_invalid += 1
            log.debug("dropped invalid message", node=self.node_id, sender=sender, error=str(exc))
        except wire.WireError as exc:
            self.counters.dropped_malformed += 1
            log.debug("dropped malformed frame", node=self.node_id, sender=sender, error=str(exc))

    def _heard(self, sender: str) -> None:
        m = self.view.members.get(sender)
        if m is not None:
            m.last_heard = self._clock()

    def _handle_msg(self, sender: str, addr: Addr, msg: dict[str, Any], raw: memoryview) -> None:
        t = msg["t"]
        swim = self.membership
        if t == "g":
            return
        if t == "ping":
            swim.on_ping(sender, addr, msg)
        elif t == "ack":
            swim.on_ack(msg)
        elif t == "preq":
            swim.on_ping_req(sender, addr, msg)
        elif t == "alive":
            node_id, inc, gen, member_addr = wire.get_member(msg)
            swim.check_incarnation(node_id, inc)
            swim.on_alive(node_id, inc, gen, member_addr, wire.reframe(wire.FRAME_MSG, raw))
        elif t == "suspect" or t == "dead":
            node_id, inc, source = _accusation(msg)
            swim.check_incarnation(node_id, inc)
            if t == "suspect":
                swim.on_suspect(node_id, inc, source)
            else:
                swim.on_dead(node_id, inc, source)
        elif t == "state":
            # Most state news arrives again and again: check before decoding it all.
            node_id = msg.get("node")
            if not isinstance(node_id, str):
                raise wire.WireError("field 'node' must be a string")
            m = self.view.members.get(node_id)
            if m is None or _is_known_state(m, msg):
                return
            self._on_state(wire.state_from_json(msg), wire.reframe(wire.FRAME_MSG, raw))
        else:
            raise wire.WireError(f"unknown message type {t!r}")

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
            self._queue.put(("s", st.node_id, 0), frame if frame is not None else state_frame(st))
        self.replication.check_lag(m)
        return True

    # --------------------------------------------------- authenticated TCP

    def open_tcp(self, packet: bytes, expect_sender: str | None = None) -> tuple[str, Frames]:
        """Verifies one TCP message; returns (sender, frames).

        Raises AuthError (counted) for a forgery and WireError for garbage or
        a reply from someone other than ``expect_sender``.
        """
        try:
            sender, frames = self.codec.open(packet, self.config.max_sync_bytes)
        except wire.AuthError:
            self.counters.dropped_bad_mac += 1
            raise
        if expect_sender is not None and sender != expect_sender:
            raise wire.WireError(f"expected a message from {expect_sender}, got one from {sender}")
        return sender, frames

    def open_control(
        self, packet: bytes, expect_sender: str | None = None, *, expect: str | None = None
    ) -> tuple[str, dict[str, Any]]:
        """``open_tcp`` for a message that starts with a control message (of type ``expect``)."""
        sender, frames = self.open_tcp(packet, expect_sender)
        if not frames or frames[0][0] != wire.FRAME_MSG:
            raise wire.WireError("TCP message does not start with a control message")
        msg = wire.decode_msg(frames[0][1])
        if expect is not None and msg["t"] != expect:
            raise wire.WireError(f"expected a {expect!r} message, got {msg['t']!r}")
        return sender, msg

    @contextlib.contextmanager
    def _invalid_counted(self) -> Iterator[None]:
        try:
            yield
        except wire.BoundsError:
            self.counters.dropped_invalid += 1
            raise

    def handle_tcp_request(self, packet: bytes) -> list[bytes]:
        """Serves one TCP request (sync or pull); returns the reply packets.

        Raises WireError for garbage or forgeries (BoundsError, counted, for a
        value out of bounds: nothing of such a request is applied).
        """
        with self._invalid_counted():
            sender, msg = self.open_control(packet)
            self._heard(sender)
            if msg["t"] == "sync":
                self.merge_sync(sender, msg)
                self.counters.syncs_ok += 1
                return [self.sync_packet("sync_reply")]
            if msg["t"] == "pull":
                return self.serve_pull(msg)
        raise wire.WireError(f"unknown TCP request {msg['t']!r}")

    # --------------------------------------------------------------- pulls

    def pull_request(self, node_id: str) -> bytes:
        """The TCP request asking ``node_id`` for what this replica lacks."""
        return self.codec.seal([self.replication.pull_frame(node_id)])

    def pull_done(self, node_id: str, ok: bool) -> None:
        self.replication.pull_done(node_id, ok)

    def handle_pull_reply(self, node_id: str, packets: Sequence[bytes]) -> None:
        """Applies the owner's answer to ``pull_request``; raises WireError if it is bad.

        The whole reply is decoded before any of it is applied.
        """
        if not packets:
            raise wire.WireError("empty pull reply")
        with self._invalid_counted():
            _, msg = self.open_control(packets[0], node_id, expect="pulled")
            st_obj = msg.get("state")
            if not isinstance(st_obj, dict):
                raise wire.WireError("pull reply without a state")
            st = wire.state_from_json(st_obj)
            if st.node_id != node_id:
                raise wire.WireError("pull reply describes another node")
            segments = wire.get_segments(msg, "seg")
            pieces: list[BlockDelta] = []
            for packet in packets[1:]:
                for kind, payload in self.open_tcp(packet, node_id)[1]:
                    if kind != wire.FRAME_BLOCKS:
                        raise wire.WireError("pull reply chunk is not a block delta")
                    pieces.append(wire.decode_blocks(payload))
            delta = self.replication.join_pulled(node_id, pieces)
        self._on_state(st)
        m = self.view.members.get(node_id)
        if (
            m is not None
            and m.generation == st.generation
            and st.segments_version > m.segments_version
        ):
            m.segments = segments
            m.segments_version = st.segments_version
        if delta is not None:
            self.replication.on_delta(delta)

    def serve_pull(self, msg: Mapping[str, Any]) -> list[bytes]:
        """Answers a pull: our full state and segments, then block-index chunks."""
        chunks = self.replication.chunks_since(wire.get_int(msg, "gen"), wire.get_int(msg, "since"))
        head = {
            "t": "pulled",
            "state": wire.state_to_json(self.membership.me.state or self._self_state()),
            "seg": list(self._segments),
            "chunks": len(chunks),
        }
        out = [self.codec.seal([wire.msg_frame(head)])]
        out.extend(self.codec.seal([wire.blocks_frame(c)]) for c in chunks)
        return out

    # ------------------------------------------------------- push-pull sync

    def sync_packet(self, t: str = "sync", join: bool = False) -> bytes:
        members = [
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
            for m in self.view.members.values()
        ]
        return self.codec.seal([wire.msg_frame({"t": t, "join": join, "members": members})])

    def handle_sync_reply(self, packet: bytes, expect_sender: str | None) -> str:
        """Merges the reply of a sync we started; returns the peer's node id."""
        with self._invalid_counted():
            sender, msg = self.open_control(packet, expect_sender, expect="sync_reply")
            self._heard(sender)
            self.merge_sync(sender, msg)
        self.counters.syncs_ok += 1
        return sender

    def merge_sync(self, sender: str, msg: Mapping[str, Any]) -> None:
        """Merges a remote member list; remote 'dead' is only taken as 'suspect'.

        Every entry is decoded before any is applied: a list with one bad
        entry is dropped whole (WireError), never half-merged. An entry whose
        incarnation is too far ahead of this node's clock is skipped (and
        counted) rather than failing the list: it is well-formed, just not
        acceptable yet, and the rest of the list is news we need.

        Alive and state news about third parties is applied but not passed on:
        the peer already spreads what it learned by gossip, and re-spreading a
        whole member list would make every join cost O(N) broadcasts per
        node. News about the peer itself (how a joiner becomes known) and
        every accusation (so the accused hears it and can refute) do spread.
        """
        raw = msg.get("members")
        if not isinstance(raw, list):
            raise wire.WireError("sync without a member list")
        entries = [self._decode_sync_entry(e) for e in raw]
        swim = self.membership
        for e in entries:
            node_id = e.node_id
            try:
                swim.check_incarnation(node_id, e.inc)
            except wire.BoundsError:
                self.counters.dropped_invalid += 1
                continue
            spread = node_id == sender
            if e.status is MemberStatus.ALIVE:
                swim.on_alive(node_id, e.inc, e.gen, e.addr, spread=spread)
            elif e.status is MemberStatus.LEFT:
                swim.on_dead(node_id, e.inc, node_id)
            else:
                swim.on_suspect(node_id, e.inc, sender)
            if e.state is None:
                continue
            self._on_state(e.state, spread=spread)
            m = self.view.members.get(node_id)
            # The sender's copy of the segments, at the version it holds.
            if (
                m is not None
                and node_id != self.node_id
                and m.generation == e.state.generation
                and m.segments_version < e.sver
            ):
                m.segments = e.segments
                m.segments_version = e.sver
                self.replication.check_lag(m)

    def _decode_sync_entry(self, e: object) -> _SyncEntry:
        if not isinstance(e, dict):
            raise wire.WireError("sync member entry is not an object")
        try:
            status = MemberStatus(e.get("status"))
        except ValueError:
            raise wire.WireError(f"unknown member status {e.get('status')!r}") from None
        node_id, inc, gen, addr = wire.get_member(e, accusation=status is not MemberStatus.ALIVE)
        entry = _SyncEntry(node_id, inc, gen, addr, status)
        st_obj = e.get("state")
        if st_obj is None:
            return entry
        if not isinstance(st_obj, dict):
            raise wire.WireError("sync member state is not an object")
        entry.sver = wire.get_int(e, "sver")
        m = self.view.members.get(node_id)
        if m is not None and _is_known_state(m, st_obj) and entry.sver <= m.segments_version:
            return entry  # nothing new: skip decoding it
        entry.state = wire.state_from_json(st_obj)
        if entry.state.node_id != node_id:
            raise wire.WireError("sync member state names another node")
        entry.segments = wire.get_segments(e, "seg")
        return entry

    # ------------------------------------------------------------------ leave

    def leave(self) -> None:
        """Announces a graceful departure to every live member at once."""
        self.membership.leave()


class _MemberEvents:
    """Member events to the block-index replica first (what placement reads),
    then to the view's watchers (what cuts calls to a lost node)."""

    __slots__ = ("_replica", "_view")

    def __init__(self, replica: BlockReplication, view: ClusterView) -> None:
        self._replica = replica
        self._view = view

    def member_up(self, node_id: str, generation: int) -> None:
        self._replica.member_up(node_id, generation)
        self._view.member_event(node_id, generation, True)

    def member_down(self, node_id: str, generation: int) -> None:
        self._replica.member_down(node_id, generation)
        self._view.member_event(node_id, generation, False)

    def member_forgotten(self, node_id: str) -> None:
        self._replica.member_forgotten(node_id)


@dataclass(slots=True)
class _SyncEntry:
    """One decoded member of a sync's list."""

    node_id: str
    inc: int
    gen: int
    addr: Addr
    status: MemberStatus
    # None when absent or no newer than ours (then it is not decoded).
    state: NodeState | None = None
    sver: int = 0
    segments: tuple[dict[str, Any], ...] = ()


def _accusation(msg: Mapping[str, Any]) -> tuple[str, int, str]:
    """(accused node, its incarnation, accuser) of a suspect or dead message."""
    return (
        wire.get_str(msg, "node"),
        wire.get_incarnation(msg, accusation=True),
        wire.get_str(msg, "from"),
    )


def state_frame(st: NodeState) -> bytes:
    return wire.msg_frame({"t": "state", **wire.state_to_json(st)})


def _is_known_state(m: Member, st_obj: Mapping[str, Any]) -> bool:
    """True when ``st_obj`` (undecoded) is no newer than the state we hold of ``m``."""
    cur = m.state
    ver = st_obj.get("ver")
    return (
        cur is not None
        and st_obj.get("gen") == cur.generation
        and isinstance(ver, int)
        and ver <= cur.version
    )
