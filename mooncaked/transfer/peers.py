"""A peer as the transfer engine sees it, and how its transports come up.

Every peer has a ``PeerLink`` (identity, segment lookups, the control
channel) and tcp streams. A peer that proves over its unix endpoint that it
shares this host gets shared memory (``ShmPeer``), and one with RDMA on both
ends a queue pair. ``PeerSetup.prepare`` brings them up (or notes once why
not) before a batch is dispatched to the peer, and ``route`` picks the
transport per remote and local segment: shm, then rdma, then tcp.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from mooncaked.transfer import protocol as p
from mooncaked.transfer.batch import TransferOp
from mooncaked.transfer.segment import Segment, SegmentError
from mooncaked.transfer.shm import ShmMapping, ShmPeer, ShmRegistry
from mooncaked.transfer.tcp import PeerLink, RemoteSegment, TcpPeer

log = structlog.get_logger(__name__)

# (remote segment or None, local segment, transport, shm mapping for the
# whole-op memcpy path or None).
Route = tuple[RemoteSegment | None, Segment | None, str, ShmMapping | None]


@dataclass(slots=True, eq=False)
class Peer:
    link: PeerLink
    tcp: TcpPeer
    shm: ShmPeer | None = None
    # Why shared memory is off for this peer (logged once), "" if untried.
    shm_off: str = ""
    rdma: Any = None
    rdma_off: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def drop_shm(self) -> None:
        """Close the shared-memory channel; the next batch may try it again."""
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        self.shm_off = ""

    def move(self, address: str) -> None:
        """The peer moved (or restarted elsewhere): nothing open to the old
        address is any use."""
        self.link.set_address(address)
        self.link.invalidate()
        self.tcp.disconnect()
        self.drop_shm()

    async def close(self) -> None:
        await self.tcp.close()
        if self.shm is not None:
            self.shm.close()
        if self.rdma is not None:
            await self.rdma.close()
        self.link.close()


class PeerSetup:
    """What this node brings to a peer's transports: its shm registry and boot
    id, and its RDMA context (each None or empty where it has none)."""

    def __init__(
        self,
        registry: ShmRegistry | None,
        boot_id: str,
        rdma: Any,
        on_failure: Callable[[BaseException], None] | None,
    ) -> None:
        self._registry = registry
        self._boot_id = boot_id
        self._rdma = rdma
        self._on_failure = on_failure

    def route(self, peer: Peer, op: TransferOp, local: Segment | None) -> Route:
        """How ``op`` reaches ``peer`` (see ``Route``)."""
        remote = peer.link.cached(op.remote_segment)
        if remote is None or local is None:
            return (None, local, "", None)
        transport = self._choose(peer, remote, local)
        mapping = None
        if transport == "shm" and local.is_host and peer.shm is not None:
            mapping = peer.shm.mapping(remote)
        return (remote, local, transport, mapping)

    def _choose(self, peer: Peer, remote: RemoteSegment, local: Segment) -> str:
        if peer.shm is not None and remote.shm and peer.shm.mapping(remote) is not None:
            return "shm"
        if peer.rdma is not None and remote.rdma is not None and local.is_host:
            return "rdma"
        return "tcp"

    async def prepare(self, peer: Peer, names: set[str]) -> str | None:
        """Resolve segment names and set up shm/rdma for the peer; the reason
        it cannot be reached, or None."""
        async with peer.lock:
            if peer.shm is not None and not peer.shm.alive():
                # The peer hung up its unix endpoint: it exited or restarted.
                peer.drop_shm()
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
                peer.drop_shm()
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

    async def _open_shm(self, peer: Peer, remotes: list[RemoteSegment]) -> None:
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

    async def _try_shm(self, peer: Peer) -> None:
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

    async def _try_rdma(self, peer: Peer) -> None:
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
