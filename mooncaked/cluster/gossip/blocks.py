"""Block-index replication: this node's delta stream out, every member's replica in.

Local changes are recorded in a ``BlockLog`` and flushed each gossip round as
a ``BlockDelta``, cut into datagram-sized pieces that ride the broadcast
queue (a flush too big for a few datagrams is left to pulls, so a burst of
cache activity cannot crowd membership news out of the queue). A replica
applies the deltas it receives; one that does not chain on (a gap), or a
member whose state advertises a newer block or segments version than the
replica holds, is *lagging*; after two gossip rounds without catching up,
the core asks its host to pull the difference from the owner over TCP.

No I/O: pulls leave as ``pull_requests`` for the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mooncaked.cluster import wire
from mooncaked.cluster.block_index import ApplyResult, BlockDelta, BlockLog, NodeBlocks, join_chunks
from mooncaked.cluster.gossip.queue import BroadcastQueue
from mooncaked.cluster.state import ClusterView, Member
from mooncaked.config import ClusterConfig

Clock = Callable[[], float]

# Deltas bigger than this many datagrams are left to pulls instead of gossip,
# so a burst of cache activity cannot crowd membership news out of the queue.
_MAX_GOSSIP_DELTA_PACKETS = 8
# At most this many pulls run at once per node.
_MAX_INFLIGHT_PULLS = 4
# Room kept in a datagram for the primary message (ping, ack, ping-req) and
# the delta frame's header.
_PRIMARY_RESERVE = 160
_DELTA_HEADER_RESERVE = 64
# Bytes per delta entry on the wire: the hash and its tier mask.
_ENTRY_BYTES = 17
# Room kept in a pull reply's TCP message for its framing.
_PULL_CHUNK_RESERVE = 1024


class BlockReplication:
    """This node's block log and its replicas of every member's index (in ``view.blocks``)."""

    __slots__ = (
        "_clock",
        "_counters",
        "_delta_entries_per_packet",
        "_gap_versions",
        "_lag_since",
        "_pulls_inflight",
        "_queue",
        "config",
        "log",
        "node_id",
        "pull_requests",
        "view",
    )

    def __init__(
        self,
        config: ClusterConfig,
        view: ClusterView,
        *,
        generation: int,
        clock: Clock,
        queue: BroadcastQueue,
        datagram_budget: int,
    ) -> None:
        self.config = config
        self.view = view
        self.node_id = view.self_id
        self._counters = view.counters
        self._clock = clock
        self._queue = queue
        own = NodeBlocks(generation)
        view.blocks[self.node_id] = own
        self.log = BlockLog(self.node_id, generation, own, config.block_log_entries)
        self.pull_requests: list[str] = []
        self._pulls_inflight: set[str] = set()
        self._lag_since: dict[str, float] = {}
        # Block versions learned from deltas that did not apply (a gap), when
        # they run ahead of the version the node's state advertises.
        self._gap_versions: dict[str, tuple[int, int]] = {}
        self._delta_entries_per_packet = max(
            1,
            (
                datagram_budget
                - _PRIMARY_RESERVE
                - _DELTA_HEADER_RESERVE
                - len(self.node_id.encode())
            )
            // _ENTRY_BYTES,
        )

    # ------------------------------------------------------------ our deltas

    def flush(self) -> bool:
        """Queues the local changes since the last flush; True if there were any.

        Either way the caller announces the new block version in its state:
        peers that miss the deltas see the lag and pull.
        """
        delta = self.log.flush()
        if delta is None:
            return False
        pieces = delta.split(self._delta_entries_per_packet)
        if len(pieces) <= _MAX_GOSSIP_DELTA_PACKETS:
            for piece in pieces:
                self._queue.put(("b", self.node_id, piece.from_version), wire.blocks_frame(piece))
        return True

    def chunks_since(self, generation: int, since: int) -> list[BlockDelta]:
        """What a replica at ``(generation, since)`` lacks, in TCP-message-sized chunks."""
        delta = self.log.since(generation, since)
        max_entries = max(1, (self.config.max_sync_bytes - _PULL_CHUNK_RESERVE) // _ENTRY_BYTES)
        return [] if delta is None else delta.chunks(max_entries)

    # -------------------------------------------------------------- replicas

    def member_up(self, node_id: str, generation: int) -> None:
        self.view.blocks[node_id] = NodeBlocks(generation)

    def member_down(self, node_id: str, generation: int) -> None:
        self.view.blocks[node_id] = NodeBlocks(generation)
        self._lag_since.pop(node_id, None)

    def member_forgotten(self, node_id: str) -> None:
        self.view.blocks.pop(node_id, None)
        self._lag_since.pop(node_id, None)
        self._gap_versions.pop(node_id, None)

    def on_delta(self, delta: BlockDelta, raw: memoryview | None = None) -> ApplyResult | None:
        """Applies a member's delta to its replica; ``raw`` (its frame's payload) is passed on."""
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
            self._counters.block_deltas_applied += 1
            self._counters.block_entries_applied += delta.num_entries
        else:
            self._counters.block_gaps += 1
            self._gap_versions[node_id] = (delta.generation, delta.to_version)
        if raw is not None and not delta.is_snapshot:
            # Pass it on: others may still miss it, gap or not here.
            self._queue.put(
                ("b", node_id, delta.from_version), wire.reframe(wire.FRAME_BLOCKS, raw)
            )
        self.check_lag(m)
        return result

    @staticmethod
    def join_pulled(node_id: str, pieces: Sequence[BlockDelta]) -> BlockDelta | None:
        """The one delta the chunks of a pull reply from ``node_id`` make up.

        Raises WireError when they do not belong together or are not its.
        """
        if not pieces:
            return None
        try:
            delta = join_chunks(pieces)
        except ValueError as exc:
            raise wire.WireError(f"pull reply chunks: {exc}") from None
        if delta.node_id != node_id:
            raise wire.WireError("pull reply carries another node's blocks")
        return delta

    # ---------------------------------------------------------------- pulls

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

    def check_lag(self, m: Member) -> None:
        """Notes when the replica of ``m`` (or its segments) fell behind what it advertises."""
        if self._is_lagging(m):
            self._lag_since.setdefault(m.node_id, self._clock())
        else:
            self._lag_since.pop(m.node_id, None)

    def schedule_pulls(self, now: float) -> None:
        # Gossip gets two rounds to deliver before a pull is worth a connection.
        delay = 2 * self.config.gossip_interval_s
        for node_id, since in list(self._lag_since.items()):
            if len(self._pulls_inflight) >= _MAX_INFLIGHT_PULLS:
                return
            if node_id in self._pulls_inflight or now - since < delay:
                continue
            m = self.view.members.get(node_id)
            if m is None or not self._is_lagging(m):
                del self._lag_since[node_id]
                continue
            self._pulls_inflight.add(node_id)
            self.pull_requests.append(node_id)

    def pull_frame(self, node_id: str) -> bytes:
        """The request for what this replica of ``node_id`` lacks."""
        index = self.view.blocks.get(node_id)
        gen, version = (0, 0) if index is None else (index.generation, index.version)
        return wire.msg_frame({"t": "pull", "gen": gen, "since": version})

    def pull_done(self, node_id: str, ok: bool) -> None:
        self._pulls_inflight.discard(node_id)
        if ok:
            self._counters.pulls_ok += 1
        else:
            self._counters.pulls_failed += 1
        m = self.view.members.get(node_id)
        if m is not None and self._is_lagging(m):
            # Still behind (or failed): wait a full delay before trying again.
            self._lag_since[node_id] = self._clock()
        else:
            self._lag_since.pop(node_id, None)
