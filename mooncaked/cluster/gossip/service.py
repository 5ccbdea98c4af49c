"""``ClusterService``: one node's ``GossipCore`` on real sockets.

A UDP socket and a TCP listener on the same port; the protocol loop sleeps
until the core's next deadline (or until a packet moves it), and the syncs
and pulls the core asks for run as tasks of the service's ``TaskSet``. The
service only moves packets: every protocol decision is the core's.

A *packet filter* (``set_packet_filter``) sees every packet in and out and
may drop it; the test hooks stage partitions with ``DropPeers``. Dropped
packets count as ``dropped_blocked``; to the protocol they are simply lost.
"""

from __future__ import annotations

import asyncio
import enum
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import structlog

from mooncaked.cluster import wire
from mooncaked.cluster.block_index import BlockEvent
from mooncaked.cluster.gossip.core import Addr, Clock, GossipCore, SyncTarget
from mooncaked.cluster.gossip.membership import WallClock, wall_clock_ms
from mooncaked.cluster.state import ClusterCounters, ClusterView, LocalState
from mooncaked.config import ClusterConfig
from mooncaked.tasks import TaskSet

log = structlog.get_logger(__name__)

# At most this many syncs run at once per node (pulls are bounded by the core).
_MAX_INFLIGHT_SYNCS = 2


class Direction(enum.StrEnum):
    IN = "in"
    OUT = "out"


# (direction, the peer's node id where known, its address, the packet) -> True to let it pass.
# Inbound, the node id is the one the packet claims (a filter runs before the MAC check).
PacketFilter = Callable[[Direction, str | None, Addr, bytes], bool]


@dataclass(frozen=True, slots=True)
class DropPeers:
    """A packet filter that drops all traffic to and from ``peers``: a staged partition."""

    peers: frozenset[str]

    def __call__(self, direction: Direction, peer: str | None, addr: Addr, packet: bytes) -> bool:
        return peer not in self.peers


class _Dropped(OSError):
    """A TCP exchange the packet filter dropped: to the protocol, a network failure."""


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
    A background task that fails (the protocol loop above all) is logged and
    passed to ``on_failure``: the owner decides what a dead gossip loop means.
    """

    def __init__(
        self,
        config: ClusterConfig,
        node_id: str,
        secret: bytes,
        *,
        local_state: Callable[[], LocalState] = LocalState,
        clock: Clock = time.monotonic,
        wall_clock: WallClock = wall_clock_ms,
        rng: random.Random | None = None,
        generation: int | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.config = config
        self.node_id = node_id
        self._clock = clock
        self.core = GossipCore(
            config,
            node_id,
            secret,
            clock=clock,
            wall_clock=wall_clock,
            rng=rng if rng is not None else random.Random(),
            generation=generation if generation is not None else wall_clock(),
            local_state=local_state,
            addr=(config.gossip_host, config.gossip_port),
        )
        self._tasks = TaskSet(f"gossip[{node_id}]", on_failure=on_failure)
        self._udp: asyncio.DatagramTransport | None = None
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._wake = asyncio.Event()
        self._sleep_until = 0.0
        self._syncs_inflight = 0
        # Open inbound TCP connections (sync and pull requests being served).
        self._conns: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        self._filter: PacketFilter | None = None
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

    @property
    def packet_filter(self) -> PacketFilter | None:
        return self._filter

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

    def set_packet_filter(self, packet_filter: PacketFilter | None) -> None:
        """Sees every packet in and out from now on (None: all pass); for staged partitions."""
        self._filter = packet_filter

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> int:
        """Binds, starts the protocol loop and joins the seeds; returns how many seeds answered."""
        if self._udp is not None or self._closed:
            raise RuntimeError("a ClusterService starts once")
        try:
            await self._bind()
            self.core.bind(self.gossip_addr)
            self._tasks.spawn(self._run(), name=f"gossip[{self.node_id}]:loop")
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
        self._tasks.cancel()
        await self._tasks.wait()
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

    def _passes(self, direction: Direction, peer: str | None, addr: Addr, packet: bytes) -> bool:
        packet_filter = self._filter
        if packet_filter is None or packet_filter(direction, peer, addr, packet):
            return True
        self.counters.dropped_blocked += 1
        return False

    def _peer_at(self, addr: Addr) -> str | None:
        # Only asked while a packet filter is set: a walk of the member list is fine.
        for node_id, m in self.view.members.items():
            if m.addr == addr:
                return node_id
        return None

    def _on_datagram(self, data: bytes, addr: Addr) -> None:
        if self._filter is not None and not self._passes(
            Direction.IN, wire.peek_sender(data), addr, data
        ):
            return
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
        filtered = self._filter is not None
        for addr, packet in out:
            if filtered and not self._passes(Direction.OUT, self._peer_at(addr), addr, packet):
                continue
            udp.sendto(packet, addr)

    def _dispatch(self) -> None:
        core = self.core
        for target in core.take_sync_requests():
            if self._syncs_inflight >= _MAX_INFLIGHT_SYNCS:
                break
            self._syncs_inflight += 1
            self._tasks.spawn(self._sync_task(target), name=f"gossip[{self.node_id}]:sync")
        for node_id in core.take_pull_requests():
            self._tasks.spawn(self._pull(node_id), name=f"gossip[{self.node_id}]:pull:{node_id}")

    # ------------------------------------------------------------------- TCP

    async def _exchange(
        self, addr: Addr, peer: str | None, request: bytes
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connects to ``addr`` and sends ``request`` (unless the packet filter drops it)."""
        if not self._passes(Direction.OUT, peer, addr, request):
            raise _Dropped(f"packet filter dropped the request to {peer or addr}")
        reader, writer = await asyncio.open_connection(*addr)
        try:
            await _write_packets(writer, [request])
        except BaseException:
            writer.close()
            raise
        return reader, writer

    async def _read_filtered(self, reader: asyncio.StreamReader, addr: Addr) -> bytes:
        packet = await _read_packet(reader, self.config.max_sync_bytes)
        if not self._passes(Direction.IN, wire.peek_sender(packet), addr, packet):
            raise _Dropped(f"packet filter dropped a message from {addr}")
        return packet

    async def _sync_task(self, target: SyncTarget) -> None:
        try:
            await self._sync_with(target)
        finally:
            self._syncs_inflight -= 1

    async def _sync_with(self, target: SyncTarget) -> bool:
        peer = target.node_id
        if peer is None and self._filter is not None:
            peer = self._peer_at(target.addr)
        try:
            async with asyncio.timeout(self.config.sync_timeout_s):
                request = self.core.sync_packet("sync", target.join)
                reader, writer = await self._exchange(target.addr, peer, request)
                try:
                    reply = await self._read_filtered(reader, target.addr)
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
        except Exception:
            # A bug a peer's reply triggers must not fail the node: count it.
            self.counters.syncs_failed += 1
            self.counters.handler_errors += 1
            log.exception("gossip sync failed", node=self.node_id, peer=target.node_id)
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
            addr = m.addr
            async with asyncio.timeout(self.config.sync_timeout_s * 4):
                reader, writer = await self._exchange(
                    addr, node_id, self.core.pull_request(node_id)
                )
                try:
                    head = await self._read_filtered(reader, addr)
                    _, msg = self.core.open_control(head, node_id, expect="pulled")
                    num_chunks = wire.get_int(msg, "chunks", wire.MAX_PULL_CHUNKS)
                    packets = [head]
                    for _ in range(num_chunks):
                        packets.append(await self._read_filtered(reader, addr))
                finally:
                    writer.close()
            self.core.handle_pull_reply(node_id, packets)
            ok = True
        except (OSError, TimeoutError, asyncio.IncompleteReadError, wire.WireError) as exc:
            log.debug("pull failed", node=self.node_id, peer=node_id, error=repr(exc))
        except Exception:
            self.counters.handler_errors += 1
            log.exception("gossip pull failed", node=self.node_id, peer=node_id)
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
                peername = writer.get_extra_info("peername")
                addr: Addr = (peername[0], peername[1]) if peername else ("", 0)
                packet = await self._read_filtered(reader, addr)
                replies = self.core.handle_tcp_request(packet)
                if replies and not self._passes(
                    Direction.OUT, wire.peek_sender(packet), addr, replies[0]
                ):
                    return
                await _write_packets(writer, replies)
        except wire.WireError as exc:
            # Forgeries and out-of-bounds values were counted by the core.
            if not isinstance(exc, (wire.AuthError, wire.BoundsError)):
                self.counters.dropped_malformed += 1
            log.debug("rejected TCP request", node=self.node_id, error=str(exc))
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
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
