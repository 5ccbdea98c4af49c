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
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import structlog

from mooncaked.config import TransferConfig
from mooncaked.transfer import protocol as p
from mooncaked.transfer.access import Access, GrantTable, WriteGrant
from mooncaked.transfer.batch import (
    Batch,
    OpKind,
    Slice,
    TransferMetrics,
    TransferOp,
)
from mooncaked.transfer.segment import (
    Segment,
    SegmentDescriptor,
    SegmentError,
    SegmentTable,
    SharedBuffer,
    memmove,
)
from mooncaked.transfer.server import TransferServer
from mooncaked.transfer.shm import ShmMapping, ShmPeer, ShmRegistry, boot_id, copy_slice
from mooncaked.transfer.tcp import PeerLink, RemoteSegment, TcpPeer, parse_address

log = structlog.get_logger(__name__)

# Copies (shm, local) run in this many worker threads.
COPY_WORKERS = 2
# One copy job moves at most this much, so a big batch spreads over workers.
COPY_JOB_BYTES = 16 * 1024 * 1024


# A whole op moved by one memcpy: (op index, destination, source, length),
# with raw addresses into memory the job keeps referenced.
_Copy = tuple[int, int, int, int]


def _copy_item(index: int, kind: OpKind, here: int, there: int, length: int) -> _Copy:
    """A READ copies there -> here, a WRITE here -> there."""
    return (index, here, there, length) if kind is OpKind.READ else (index, there, here, length)


def _copy_ops(
    batch: Batch, items: list[_Copy], shm: ShmPeer | None, mapping: ShmMapping | None
) -> None:
    """Worker thread: memcpy whole ops of one batch, report them at once.

    ``mapping`` (a peer's segment, held here so its addresses stay mapped) is
    checked for revocation once per job; ops cancelled meanwhile are skipped.
    """
    indices = [item[0] for item in items]
    if shm is not None and mapping is not None:
        reason = shm.check_live(mapping)
        if reason is not None:
            batch.ops_failed(indices, reason)
            return
    pending = batch.is_pending
    for i, dst, src, length in items:
        if pending(i):
            memmove(dst, src, length)
    batch.ops_done(indices)


@dataclass(slots=True, eq=False)
class _Peer:
    link: PeerLink
    tcp: TcpPeer
    shm: ShmPeer | None = None
    # Why shared memory is off for this peer (logged once), "" if untried.
    shm_off: str = ""
    rdma: Any = None
    rdma_off: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


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
        self._peers: dict[str, _Peer] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: set[Future[None]] = set()
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
            self._pool = ThreadPoolExecutor(COPY_WORKERS, thread_name_prefix="xfer-copy")
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
            await self._close_peer(peer)
        self._peers.clear()
        if self._server is not None:
            await self._server.close()
        if self._jobs:
            await asyncio.gather(
                *(asyncio.wrap_future(j) for j in list(self._jobs)), return_exceptions=True
            )
        if self._pool is not None:
            self._pool.shutdown(wait=True)
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
        segment = self._table.get(name)
        if segment is None:
            raise SegmentError(f"segment {name!r} is not registered")
        if segment.busy:
            raise SegmentError(
                f"segment {name!r} has {segment.busy} local batch(es) in flight; "
                "await or cancel them before unregistering"
            )
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
    ) -> WriteGrant:
        """Let ``peer`` write blocks ``block_ids`` of a GRANTED segment (in every
        plane of ``blocks_per_plane`` blocks of ``block_bytes``) for ``ttl_s``
        seconds, or until ``revoke``."""
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
                # Moved (or restarted elsewhere): nothing open to the old
                # address is any use.
                peer.link.set_address(address)
                peer.link.invalidate()
                peer.tcp.disconnect()
                if peer.shm is not None:
                    peer.shm.close()
                    peer.shm = None
                peer.shm_off = ""
            return
        link = PeerLink(node_id, address, self.node_id, self._secret, self._metrics)
        self._peers[node_id] = _Peer(link=link, tcp=TcpPeer(link, self.config, self._metrics))

    def add_descriptor(self, descriptor: SegmentDescriptor) -> None:
        self.add_peer(descriptor.node_id, descriptor.address)

    async def remove_peer(self, node_id: str) -> None:
        peer = self._peers.pop(node_id, None)
        if peer is not None:
            await self._close_peer(peer)

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

    async def _close_peer(self, peer: _Peer) -> None:
        await peer.tcp.close()
        if peer.shm is not None:
            peer.shm.close()
        if peer.rdma is not None:
            await peer.rdma.close()
        peer.link.close()

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
        copies: list[_Copy] = []
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
                copies.append(_copy_item(i, op.kind, here, there, op.length))
            else:
                slices.extend(self._slices(batch, i, "local", local))  # type: ignore[arg-type]
        if copies:
            self._run_op_copies(batch, copies, "local", None, None)
        if slices:
            self._run_copies(slices, self._copy_local)

    def _copy_local(self, slices: list[Slice]) -> None:
        for s in slices:
            if not s.live:
                s.batch.slice_dropped(s)
                continue
            remote = self._table.get(s.remote_name)
            if remote is None:
                s.batch.slice_failed(s, f"segment {s.remote_name!r} was unregistered")
                continue
            try:
                if remote.is_host:
                    copy_slice(s, remote.address + s.remote_offset)
                elif s.kind is OpKind.READ:
                    view, commit = s.local.destination(s.local_offset, s.length)
                    view[:] = remote.source(s.remote_offset, s.length)
                    if commit is not None:
                        commit()
                else:
                    view, commit = remote.destination(s.remote_offset, s.length)
                    view[:] = s.local.source(s.local_offset, s.length)
                    if commit is not None:
                        commit()
            except Exception as exc:
                s.batch.slice_failed(s, f"local copy failed: {exc!r}")
                continue
            s.batch.slice_done(s)

    def _run_copies(self, slices: list[Slice], fn: Any) -> None:
        """Split slices into jobs of about COPY_JOB_BYTES and run them in the pool."""
        if self._pool is None:
            raise RuntimeError("the transfer engine is not running")
        job: list[Slice] = []
        size = 0
        for s in slices:
            job.append(s)
            size += s.length
            if size >= COPY_JOB_BYTES:
                self._submit_job(fn, job)
                job, size = [], 0
        if job:
            self._submit_job(fn, job)

    def _run_op_copies(
        self,
        batch: Batch,
        items: list[_Copy],
        transport: str,
        shm: ShmPeer | None,
        mapping: ShmMapping | None,
    ) -> None:
        """Whole-op memcpys in jobs of about COPY_JOB_BYTES (see ``_copy_ops``)."""
        if self._pool is None:
            raise RuntimeError("the transfer engine is not running")
        batch._add_ops([item[0] for item in items], transport)
        job: list[_Copy] = []
        size = 0
        for item in items:
            job.append(item)
            size += item[3]
            if size >= COPY_JOB_BYTES:
                self._submit_job(_copy_ops, batch, job, shm, mapping)
                job, size = [], 0
        if job:
            self._submit_job(_copy_ops, batch, job, shm, mapping)

    def _submit_job(self, fn: Any, *args: Any) -> None:
        future = self._pool.submit(fn, *args)  # type: ignore[union-attr]
        self._jobs.add(future)
        future.add_done_callback(self._job_done)

    def _job_done(self, future: Future[None]) -> None:
        self._jobs.discard(future)
        exc = future.exception()
        if exc is not None:
            log.error("transfer copy job failed", error=repr(exc))

    async def _dispatch_remote(self, batch: Batch, node: str, indices: list[int]) -> None:
        peer = self._peers.get(node)
        if peer is None:
            for i in indices:
                batch.fail_op(
                    i, f"no address known for node {node!r}; add_peer() or add_descriptor() first"
                )
            return
        names = {batch.ops[i].remote_segment for i in indices}
        reason = await self._prepare(peer, names)
        if reason is not None:
            for i in indices:
                batch.fail_op(i, reason)
            return
        by_transport: dict[str, list[Slice]] = defaultdict(list)
        copies: dict[ShmMapping, list[_Copy]] = {}
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
                route = routes[key] = self._route(peer, op)
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
                items.append(_copy_item(i, op.kind, here, there, op.length))
                continue
            by_transport[transport].extend(self._slices(batch, i, transport, local))
        for mapping, items in copies.items():
            self._run_op_copies(batch, items, "shm", peer.shm, mapping)
        for transport, slices in by_transport.items():
            if transport == "shm":
                self._run_copies(slices, peer.shm.copy)  # type: ignore[union-attr]
            elif transport == "rdma":
                peer.rdma.post(slices)
            else:
                peer.tcp.submit(slices)

    def _route(self, peer: _Peer, op: TransferOp) -> tuple[Any, ...]:
        """(remote segment or None, local segment, transport, shm mapping for the
        whole-op memcpy path or None)."""
        remote = peer.link.cached(op.remote_segment)
        local = self._table.get(op.local_segment)
        if remote is None or local is None:
            return (None, local, "", None)
        transport = self._choose(peer, remote, local)
        mapping = None
        if transport == "shm" and local.is_host and peer.shm is not None:
            mapping = peer.shm.mapping(remote)
        return (remote, local, transport, mapping)

    def _choose(self, peer: _Peer, remote: RemoteSegment, local: Segment) -> str:
        if peer.shm is not None and remote.shm and peer.shm.mapping(remote) is not None:
            return "shm"
        if peer.rdma is not None and remote.rdma is not None and local.is_host:
            return "rdma"
        return "tcp"

    async def _prepare(self, peer: _Peer, names: set[str]) -> str | None:
        """Resolve segment names and set up shm/rdma for the peer; the reason
        it cannot be reached, or None."""
        async with peer.lock:
            if peer.shm is not None and not peer.shm.alive():
                # The peer hung up its unix endpoint: it exited or restarted.
                peer.shm.close()
                peer.shm = None
                peer.shm_off = ""
                peer.link.invalidate()
                peer.link.drop_control()
            if peer.shm is not None:
                # A mapped segment the peer has since unregistered (maybe to
                # register another under the name): look the name up afresh.
                for n in names:
                    r = peer.link.cached(n)
                    m = peer.shm.mapping(r) if r is not None and r.shm else None
                    if m is not None and not peer.shm.is_live(m):
                        peer.shm.forget(m)
                        peer.link.invalidate(n)
            missing = [n for n in names if peer.link.cached(n) is None]
            if missing or not peer.link.info:
                try:
                    await asyncio.to_thread(peer.link.lookup, missing)
                except p.AuthError as exc:
                    return f"cannot authenticate to node {peer.link.node_id}: {exc}"
                except (OSError, p.ProtocolError) as exc:
                    return f"cannot reach node {peer.link.node_id} at {peer.link.address}: {exc}"
            if peer.shm is not None and peer.shm.instance != peer.link.instance:
                peer.shm.close()
                peer.shm = None
                peer.shm_off = ""
            if peer.shm is None and not peer.shm_off:
                await self._try_shm(peer)
            if peer.shm is not None:
                want = [
                    r
                    for n in names
                    if (r := peer.link.cached(n)) is not None
                    and r.shm
                    and peer.shm.mapping(r) is None
                ]
                if want:
                    await self._open_shm(peer, want)
            if self._rdma is not None and peer.rdma is None and not peer.rdma_off:
                await self._try_rdma(peer)
        return None

    async def _open_shm(self, peer: _Peer, remotes: list[RemoteSegment]) -> None:
        shm = peer.shm
        if shm is None:
            return
        shm.unwatch()  # the replies make the socket readable
        try:
            for remote in remotes:
                await asyncio.to_thread(shm.open, remote)
        except (OSError, p.ProtocolError, SegmentError) as exc:
            log.warning(
                "shared-memory open failed; using tcp", peer=peer.link.node_id, error=str(exc)
            )
            shm.close()
            peer.shm = None
            return
        shm.watch(asyncio.get_running_loop())

    async def _try_shm(self, peer: _Peer) -> None:
        info = peer.link.info
        if self._registry is None:
            peer.shm_off = "shm is not among this node's transports"
        elif not info.get("shm"):
            peer.shm_off = "the peer offers no shared memory"
        elif not self._boot_id or info.get("boot_id") != self._boot_id:
            peer.shm_off = "the peer runs on another host"
        else:
            try:
                peer.shm = await asyncio.to_thread(ShmPeer.connect, peer.link)
                peer.shm.watch(asyncio.get_running_loop())
                log.info("shared memory with peer", peer=peer.link.node_id)
                return
            except (OSError, p.AuthError) as exc:
                # Same boot id but unreachable socket: another network or IPC
                # namespace (a container) on the same kernel.
                peer.shm_off = f"unix endpoint unreachable: {exc}"
        log.info("no shared memory with peer", peer=peer.link.node_id, reason=peer.shm_off)

    async def _try_rdma(self, peer: _Peer) -> None:
        from mooncaked.transfer.rdma import QpInfo, RdmaPeer, RemoteRegion

        if not peer.link.info.get("rdma"):
            peer.rdma_off = "the peer offers no rdma"
            return

        def connect() -> Any:
            qp, local = self._rdma.create_qp()
            sock = peer.link.connect()
            try:
                p.send_control(sock, p.FrameKind.RDMA_CONNECT, {"qp": local.to_dict()})
                reply = p.recv_control(sock, p.FrameKind.RDMA_CONNECT)
            finally:
                sock.close()
            remote = QpInfo.from_dict(reply.get("qp") if isinstance(reply, dict) else None)
            self._rdma.connect_qp(qp, local, remote)
            return qp

        def region_of(name: str) -> RemoteRegion | None:
            seg = peer.link.cached(name)
            if seg is None or seg.rdma is None:
                return None
            return RemoteRegion(seg.rdma[0], seg.rdma[1], seg.length)

        try:
            qp = await asyncio.to_thread(connect)
        except Exception as exc:
            peer.rdma_off = f"rdma connect failed: {exc}"
            log.warning(
                "rdma unavailable with peer; using tcp", peer=peer.link.node_id, error=str(exc)
            )
            return
        peer.rdma = RdmaPeer(
            self._rdma, qp, region_of, peer.link.node_id, on_failure=self._on_failure
        )
        peer.rdma.start()

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
