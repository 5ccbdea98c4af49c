"""TransferEngine: batched READ/WRITE between registered memory on two nodes.

    engine = TransferEngine(config, node_id="a", secret=b"...")
    await engine.start()
    engine.allocate("kv", 1 << 30, Access.READ)   # or engine.register("kv", tensor, ...)
    desc = engine.descriptor("kv")            # gossip this (desc.to_bytes())
    engine.add_peer("b", "10.0.0.2:7000")     # or engine.add_descriptor(desc_of_b)
    batch = await engine.submit([TransferOp.read("kv", 0, "b", "pool", 4096, 65536)])
    ok = await batch.wait()                   # per op: batch.status(i), batch.reason(i)
    await engine.close()

Each segment carries its access rights (``Access``): READ (peers read, the
default), GRANTED (peers write only blocks a live ``grant_write`` gives them)
or READ_WRITE. The serving side refuses any other op, over every transport.

Transport per op, chosen per peer and segment: ``local`` when the remote node
is this one; ``shm`` when the peer proved over its unix endpoint that it
shares this host and the segment is shared memory; ``rdma`` when configured,
available on both ends and the segment has a memory region; else ``tcp``.

A caller's mistake about its own side (unknown local segment, range outside
it) raises ValueError at submit; anything about the remote side fails the op
with a reason, so a batch spanning peers is never all-or-nothing by accident.

Peers and the setup of their transports are ``transfer/peers.py``'s; the
copies that cross no socket (local and shm) are ``transfer/copies.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from mooncaked.config import TransferConfig
from mooncaked.transfer.access import Access, GrantTable, WriteGrant
from mooncaked.transfer.batch import (
    Batch,
    OpKind,
    Slice,
    TransferMetrics,
    TransferOp,
)
from mooncaked.transfer.copies import Copy, CopyPool, copy_item, copy_local
from mooncaked.transfer.peers import Peer, PeerSetup
from mooncaked.transfer.segment import (
    Segment,
    SegmentDescriptor,
    SegmentError,
    SegmentTable,
    SharedBuffer,
)
from mooncaked.transfer.server import TransferServer
from mooncaked.transfer.shm import ShmMapping, ShmRegistry, boot_id
from mooncaked.transfer.tcp import PeerLink, TcpPeer, parse_address

log = structlog.get_logger(__name__)


class TransferEngine:
    def __init__(
        self,
        config: TransferConfig,
        node_id: str,
        secret: bytes,
        *,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``on_failure`` hears of a background loop (accept, RDMA poll) that died."""
        if not node_id:
            raise ValueError("node_id must not be empty")
        if len(secret) < 8:
            raise ValueError("the cluster secret must be at least 8 bytes")
        self.config = config
        self.node_id = node_id
        self._secret = secret
        self._on_failure = on_failure
        self._instance = os.urandom(8).hex()
        self._boot_id = boot_id()
        self._table = SegmentTable()
        self._grants = GrantTable()
        self._metrics = TransferMetrics()
        self._registry: ShmRegistry | None = None
        self._rdma: Any = None
        self._rdma_qps: dict[str, Any] = {}
        self._server: TransferServer | None = None
        self._peers: dict[str, Peer] = {}
        # Set up at start, once this node's transports are known.
        self._setup: PeerSetup | None = None
        self._copies = CopyPool()
        self._batches: set[Batch] = set()
        self._timers: dict[Batch, asyncio.TimerHandle] = {}
        # Segments each live batch holds busy (its local ones, and for ops to
        # this node the target ones), released when it settles.
        self._held: dict[Batch, list[Segment]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._closed = False

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("transfer engine already started")
        self._started = True
        self._loop = asyncio.get_running_loop()
        try:
            if "shm" in self.config.transports:
                self._registry = ShmRegistry()
            if "rdma" in self.config.transports:
                self._start_rdma()
            for name in self._table.names():  # registered before start()
                self._attach(self._table.get(name))  # type: ignore[arg-type]
            self._setup = PeerSetup(self._registry, self._boot_id, self._rdma, self._on_failure)
            self._copies.start()
            self._server = TransferServer(
                self._table,
                self._grants,
                self._secret,
                self._metrics,
                self._handshake_info,
                shm_fds=self._shm_fds if self._registry is not None else None,
                rdma_region=self._rdma_region if self._rdma is not None else None,
                rdma_accept=self._rdma_accept if self._rdma is not None else None,
                on_failure=self._on_failure,
            )
            unix_name = f"mooncaked-xfer-{self._instance}" if self._registry else None
            await self._server.start(self.config.host, self.config.port, unix_name)
        except BaseException:
            await self.close()
            raise
        log.info(
            "transfer engine started",
            node=self.node_id,
            address=self.address,
            transports=self._local_transports(),
        )

    async def close(self) -> None:
        """Fail what is in flight, stop serving, release every segment."""
        if self._closed:
            return
        self._closed = True
        for batch in list(self._batches):
            batch.cancel("transfer engine closed")
        for peer in list(self._peers.values()):
            await peer.close()
        self._peers.clear()
        if self._server is not None:
            await self._server.close()
        await self._copies.close()
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        for qp in self._rdma_qps.values():
            with contextlib.suppress(Exception):
                qp.close()
        if self._rdma is not None:
            self._rdma.close()
        self._table.clear()
        if self._registry is not None:
            self._registry.close()

    async def __aenter__(self) -> TransferEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def address(self) -> str:
        """host:port peers connect to (known after start)."""
        return self._server.address if self._server is not None else ""

    def metrics(self) -> TransferMetrics:
        """A snapshot of the counters, plus the slices now queued for tcp."""
        snap = self._metrics.snapshot()
        snap.queued_slices = sum(peer.tcp.queued for peer in self._peers.values())
        return snap

    # -- segments ----------------------------------------------------------

    def register(self, name: str, buffer: Any, access: Access = Access.READ) -> Segment:
        """Make ``buffer`` reachable by peers as segment ``name``, as ``access`` allows."""
        segment = self._table.register(name, buffer, access)
        self._attach(segment)
        return segment

    def allocate(self, name: str, nbytes: int, access: Access = Access.READ) -> Segment:
        """Register a new zeroed shared-memory buffer (reachable over shm by peers
        on this host, as ``access`` allows); ``segment.view`` is the memory."""
        buffer = SharedBuffer.create(nbytes, tag=name[:32])
        try:
            segment = self._table.register(name, buffer, access)
        except BaseException:
            buffer.close()
            raise
        segment.owned = buffer
        self._attach(segment)
        return segment

    def _attach(self, segment: Segment) -> None:
        if self._registry is not None and segment.is_shared:
            self._registry.claim(segment.seg_id)
        if self._rdma is not None and segment.is_host:
            try:
                self._rdma.register(segment.seg_id, segment.address, segment.length, segment.access)
            except Exception as exc:
                log.warning("rdma registration failed", segment=segment.name, error=str(exc))

    def unregister(self, name: str) -> None:
        """Withdraw a segment: peers' later ops on it fail as unknown segment."""
        segment = self._table.removable(name)
        if self._registry is not None:
            self._registry.release(segment.seg_id)
        if self._rdma is not None:
            self._rdma.deregister(segment.seg_id)
        self._grants.revoke_segment(name)
        self._table.unregister(name)

    def grant_write(
        self,
        segment: str,
        peer: str,
        *,
        block_bytes: int,
        blocks_per_plane: int,
        block_ids: Sequence[int],
        ttl_s: float,
        planes: tuple[int, int] | None = None,
    ) -> WriteGrant:
        """Let ``peer`` write blocks ``block_ids`` of a GRANTED segment (in every
        plane of ``blocks_per_plane`` blocks of ``block_bytes``, or the planes
        [lo, hi) of ``planes``) for ``ttl_s`` seconds, or until ``revoke``."""
        seg = self._table.get(segment)
        if seg is None:
            raise SegmentError(f"segment {segment!r} is not registered")
        if seg.access is not Access.GRANTED:
            raise SegmentError(
                f"segment {segment!r} is {seg.access.value}, not granted: grants open only "
                "segments registered with Access.GRANTED"
            )
        return self._grants.grant(
            segment,
            peer,
            block_bytes=block_bytes,
            blocks_per_plane=blocks_per_plane,
            block_ids=block_ids,
            ttl_s=ttl_s,
            planes=planes,
        )

    def revoke(self, grant: WriteGrant) -> None:
        """End a write grant now: the peer's later writes are refused."""
        self._grants.revoke(grant)

    @property
    def num_grants(self) -> int:
        return len(self._grants)

    def segment(self, name: str) -> Segment | None:
        return self._table.get(name)

    def segments(self) -> list[str]:
        return self._table.names()

    def descriptor(self, name: str) -> SegmentDescriptor:
        segment = self._table.get(name)
        if segment is None:
            raise SegmentError(f"segment {name!r} is not registered")
        if not self.address:
            raise RuntimeError("the transfer engine has no address before start()")
        transports = ["tcp"]
        if self._registry is not None and segment.is_shared:
            transports.insert(0, "shm")
        if self._rdma is not None and segment.is_host:
            transports.insert(0, "rdma")
        return SegmentDescriptor(
            node_id=self.node_id,
            name=segment.name,
            length=segment.length,
            location=segment.location,
            transports=tuple(transports),
            address=self.address,
            access=segment.access,
        )

    # -- peers -------------------------------------------------------------

    def add_peer(self, node_id: str, address: str) -> None:
        """Learn (or update) where a peer's transfer endpoint is."""
        if node_id == self.node_id:
            return
        parse_address(address)
        peer = self._peers.get(node_id)
        if peer is not None:
            if address != peer.link.address:
                peer.move(address)
            return
        link = PeerLink(node_id, address, self.node_id, self._secret, self._metrics)
        self._peers[node_id] = Peer(link=link, tcp=TcpPeer(link, self.config, self._metrics))

    def add_descriptor(self, descriptor: SegmentDescriptor) -> None:
        self.add_peer(descriptor.node_id, descriptor.address)

    async def remove_peer(self, node_id: str) -> None:
        peer = self._peers.pop(node_id, None)
        if peer is not None:
            await peer.close()

    def peers(self) -> list[str]:
        return list(self._peers)

    def disconnect(self, node_id: str | None = None) -> None:
        """Cut live connections to one peer (or all, and those served): in-flight
        slices are retried on fresh connections. For operators and fault tests."""
        for nid, peer in self._peers.items():
            if node_id is None or nid == node_id:
                peer.tcp.disconnect()
        if node_id is None and self._server is not None:
            self._server.drop_connections()

    # -- transfers ---------------------------------------------------------

    async def submit(self, ops: Sequence[TransferOp], op_timeout_s: float | None = None) -> Batch:
        """Start a batch; returns once it is handed to the transports.

        ``op_timeout_s`` (default ``config.op_timeout_s``) bounds every op of
        the batch from now; an op still unfinished then fails as timed out.
        """
        if not self._started or self._closed or self._loop is None:
            raise RuntimeError("the transfer engine is not running")
        local_segs = self._check_local(ops)
        batch = Batch(ops, self._loop, self._metrics, on_settled=self._settled)
        self._batches.add(batch)
        self._metrics.add("batches", 1)
        for seg in local_segs:
            seg.acquire()
        self._held[batch] = local_segs
        # The deadline covers connecting and looking up too.
        wait = self.config.op_timeout_s if op_timeout_s is None else op_timeout_s
        self._timers[batch] = self._loop.call_later(wait, self._expire, batch, wait)
        try:
            by_node: dict[str, list[int]] = defaultdict(list)
            for i, op in enumerate(ops):
                if op.length == 0:
                    batch._add_slices(i, 0, "none")
                    batch._complete_empty(i)
                else:
                    by_node[op.remote_node].append(i)
            for node, indices in by_node.items():
                if node == self.node_id:
                    self._dispatch_local(batch, indices)
                else:
                    await self._dispatch_remote(batch, node, indices)
        except BaseException as exc:
            # Whatever did not reach a transport must not wait for the deadline.
            batch.fail_pending(f"submit failed: {exc!r}")
            raise
        finally:
            batch._seal()
        return batch

    def _check_local(self, ops: Sequence[TransferOp]) -> list[Segment]:
        # Per op, and batches run to thousands of ops: segments are looked up
        # once per name, and the common case costs a few comparisons.
        used: dict[str, Segment] = {}
        read, write = OpKind.READ, OpKind.WRITE
        for i, op in enumerate(ops):
            if type(op) is not TransferOp and not isinstance(op, TransferOp):
                raise TypeError(f"op {i} is a {type(op).__name__}, not a TransferOp")
            if op.kind is not read and op.kind is not write:
                raise ValueError(f"op {i}: kind must be READ or WRITE")
            seg = used.get(op.local_segment)
            if seg is None:
                seg = self._table.get(op.local_segment)
                if seg is None:
                    raise SegmentError(
                        f"op {i}: local segment {op.local_segment!r} is not registered "
                        f"(registered: {self._table.names()[:10]})"
                    )
                used[seg.name] = seg
            if op.local_offset < 0 or op.length < 0 or op.local_offset + op.length > seg.length:
                raise SegmentError(f"op {i}: {seg.check_range(op.local_offset, op.length)}")
            if op.kind is read and seg.read_only:
                # A READ lands in the local segment: in read-only memory (a
                # file mapped read-only) that write would fault the process.
                raise SegmentError(
                    f"op {i}: local segment {seg.name!r} is read-only memory; "
                    "nothing can be read into it"
                )
            if op.remote_offset < 0:
                raise ValueError(f"op {i}: negative remote offset {op.remote_offset}")
        return list(used.values())

    def _slices(self, batch: Batch, i: int, transport: str, local: Segment) -> list[Slice]:
        op = batch.ops[i]
        step = self.config.slice_bytes
        if op.length <= step:
            batch._add_slices(i, 1, transport)
            return [
                Slice(
                    batch,
                    i,
                    op.kind,
                    local,
                    op.local_offset,
                    op.remote_segment,
                    op.remote_offset,
                    op.length,
                    transport,
                )
            ]
        slices = [
            Slice(
                batch=batch,
                op_index=i,
                kind=op.kind,
                local=local,
                local_offset=op.local_offset + off,
                remote_name=op.remote_segment,
                remote_offset=op.remote_offset + off,
                length=min(step, op.length - off),
                transport=transport,
            )
            for off in range(0, op.length, step)
        ]
        batch._add_slices(i, len(slices), transport)
        return slices

    def _dispatch_local(self, batch: Batch, indices: list[int]) -> None:
        slices: list[Slice] = []
        copies: list[Copy] = []
        for i in indices:
            op = batch.ops[i]
            remote = self._table.get(op.remote_segment)
            if remote is None:
                batch.fail_op(
                    i, f"segment {op.remote_segment!r} is not registered on node {self.node_id}"
                )
                continue
            reason = remote.check_range(op.remote_offset, op.length)
            if reason is not None:
                batch.fail_op(i, reason)
                continue
            held = self._held[batch]
            if remote not in held:
                remote.acquire()
                held.append(remote)
            local = self._table.get(op.local_segment)
            if remote.is_host and local.is_host and op.length <= self.config.slice_bytes:  # type: ignore[union-attr]
                there = remote.address + op.remote_offset
                here = local.address + op.local_offset  # type: ignore[union-attr]
                copies.append(copy_item(i, op.kind, here, there, op.length))
            else:
                slices.extend(self._slices(batch, i, "local", local))  # type: ignore[arg-type]
        if copies:
            self._copies.run_ops(batch, copies, "local", None, None)
        if slices:
            self._copies.run_slices(slices, functools.partial(copy_local, self._table))

    async def _dispatch_remote(self, batch: Batch, node: str, indices: list[int]) -> None:
        setup, table = self._setup, self._table
        if setup is None:
            raise RuntimeError("the transfer engine is not running")
        peer = self._peers.get(node)
        if peer is None:
            for i in indices:
                batch.fail_op(
                    i, f"no address known for node {node!r}; add_peer() or add_descriptor() first"
                )
            return
        names = {batch.ops[i].remote_segment for i in indices}
        reason = await setup.prepare(peer, names)
        if reason is not None:
            for i in indices:
                batch.fail_op(i, reason)
            return
        by_transport: dict[str, list[Slice]] = defaultdict(list)
        copies: dict[ShmMapping, list[Copy]] = {}
        step = self.config.slice_bytes
        # (remote name, local name) -> remote, local, transport, shm mapping:
        # resolved once per pair, not once per op.
        routes: dict[tuple[str, str], tuple[Any, ...]] = {}
        ops = batch.ops
        for i in indices:
            op = ops[i]
            key = (op.remote_segment, op.local_segment)
            route = routes.get(key)
            if route is None:
                route = routes[key] = setup.route(peer, op, table.get(op.local_segment))
            remote, local, transport, mapping = route
            if remote is None:
                batch.fail_op(i, f"segment {op.remote_segment!r} is not registered on node {node}")
                continue
            if not remote.allows(op.kind):
                # Refused here too: a WRITE into a read-only shm mapping would
                # fault this process, and the peer would refuse it anyway.
                batch.fail_op(
                    i,
                    f"segment {op.remote_segment!r} on node {node} is {remote.access.describe}: "
                    f"this node may not {op.kind.name.lower()} it",
                )
                continue
            if op.remote_offset + op.length > remote.length:
                batch.fail_op(
                    i,
                    f"range [{op.remote_offset}, {op.remote_offset + op.length}) is outside "
                    f"segment {op.remote_segment!r} of {remote.length} bytes on node {node}",
                )
                continue
            if mapping is not None and op.length <= step:
                # Small host ops over shm skip slicing: one memcpy each.
                here = local.address + op.local_offset
                there = mapping.buffer.address + op.remote_offset
                items = copies.get(mapping)
                if items is None:
                    items = copies[mapping] = []
                items.append(copy_item(i, op.kind, here, there, op.length))
                continue
            by_transport[transport].extend(self._slices(batch, i, transport, local))
        for mapping, items in copies.items():
            self._copies.run_ops(batch, items, "shm", peer.shm, mapping)
        for transport, slices in by_transport.items():
            if transport == "shm":
                self._copies.run_slices(slices, peer.shm.copy)  # type: ignore[union-attr]
            elif transport == "rdma":
                peer.rdma.post(slices)
            else:
                peer.tcp.submit(slices)

    def _expire(self, batch: Batch, wait: float) -> None:
        self._timers.pop(batch, None)
        if batch.fail_pending(f"timed out after {wait:g} s") == 0:
            return
        for peer in self._peers.values():
            peer.tcp.abort(batch)

    def _settled(self, batch: Batch) -> None:
        self._batches.discard(batch)
        handle = self._timers.pop(batch, None)
        if handle is not None:
            handle.cancel()
        for seg in self._held.pop(batch, ()):
            seg.release()

    # -- serving-side hooks ------------------------------------------------

    def _local_transports(self) -> list[str]:
        out = ["tcp"]
        if self._registry is not None:
            out.append("shm")
        if self._rdma is not None:
            out.append("rdma")
        return out

    def _handshake_info(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "instance": self._instance,
            "boot_id": self._boot_id,
            "shm": self._server.unix_address if self._server is not None else "",
            "rdma": self._rdma is not None,
        }

    def _shm_fds(self, segment: Segment) -> tuple[int, int, int] | None:
        registry = self._registry
        if registry is None or not segment.is_shared:
            return None
        slot = registry.slot_of(segment.seg_id)
        if slot is None:
            return None
        fd = segment.peer_fd()
        if fd < 0:
            return None
        return fd, registry.peer_fd, slot

    def _start_rdma(self) -> None:
        from mooncaked.transfer.rdma import RdmaContext, RdmaUnavailable

        try:
            self._rdma = RdmaContext(self.config.rdma_device)
        except RdmaUnavailable as exc:
            log.warning("rdma configured but unavailable; using tcp/shm", reason=str(exc))
            self._rdma = None

    def _rdma_region(self, segment: Segment) -> tuple[int, int] | None:
        keys = self._rdma.keys(segment.seg_id) if self._rdma is not None else None
        return None if keys is None else (segment.address, keys[1])

    def _rdma_accept(self, peer_node: str, body: Any) -> Any:
        from mooncaked.transfer.rdma import QpInfo

        remote = QpInfo.from_dict(body.get("qp") if isinstance(body, dict) else None)
        qp, local = self._rdma.create_qp()
        self._rdma.connect_qp(qp, local, remote)
        old = self._rdma_qps.pop(peer_node, None)
        if old is not None:
            with contextlib.suppress(Exception):
                old.close()
        self._rdma_qps[peer_node] = qp
        return {"qp": local.to_dict()}
