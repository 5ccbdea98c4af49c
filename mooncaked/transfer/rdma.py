"""RDMA transport through pyverbs: RC queue pairs, one memory region per
segment, one-sided RDMA READ/WRITE.

Imported only when ``rdma`` is among the configured transports; pyverbs comes
with rdma-core (Debian: python3-pyverbs). Without a NIC or pyverbs the engine
logs why and carries on over tcp/shm.

- Every host segment is registered as an MR (local write, remote read,
  remote write); lookups over the authenticated tcp control channel hand
  peers its address and rkey, so a peer can touch registered memory only,
  and the NIC enforces the bounds of the MR.
- Each pair of nodes connects one RC QP per direction of initiation: the
  initiator sends its QP info (lid, gid, qpn, psn, mtu) in an RDMA_CONNECT
  control frame, the target creates and connects its QP and answers with
  its own; both move INIT -> RTR -> RTS.
- Completions are polled from the event loop only while work requests are
  outstanding, with a yield between polls: pyverbs blocks in
  ``ibv_get_cq_event`` without releasing the GIL, so a completion channel in
  a thread would stall the whole process. Idle, the poller awaits an event.

The pure parts (QP info, work-request planning) are tested without hardware.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from mooncaked.tasks import TaskSet
from mooncaked.transfer.access import Access
from mooncaked.transfer.batch import OpKind, Slice

log = structlog.get_logger(__name__)

# A single RDMA message moves at most this much (ports report up to 1-2 GiB;
# smaller messages interleave better across QPs).
MAX_MESSAGE_BYTES = 1 << 24
MAX_OUTSTANDING_WR = 512
_MTU_ENUM = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}


class RdmaUnavailable(RuntimeError):
    """RDMA was asked for but cannot run here; the message says why."""


def load_pyverbs() -> Any:
    """Import pyverbs, or raise RdmaUnavailable saying what to install."""
    try:
        import pyverbs.device
        import pyverbs.enums
    except ImportError as exc:
        raise RdmaUnavailable(
            f"the rdma transport needs pyverbs (rdma-core's Python binding; Debian: "
            f"python3-pyverbs): {exc}"
        ) from None
    return pyverbs


def list_devices() -> list[str]:
    """Names of the RDMA devices on this host; empty without pyverbs or NICs."""
    try:
        pv = load_pyverbs()
    except RdmaUnavailable:
        return []
    try:
        return [
            d.name.decode() if isinstance(d.name, bytes) else d.name
            for d in pv.device.get_device_list()
        ]
    except Exception:
        return []


@dataclass(frozen=True, slots=True)
class QpInfo:
    """What the other end needs to connect an RC QP to ours."""

    lid: int
    gid: str  # 32 hex digits, or "" on InfiniBand without a GRH
    qpn: int
    psn: int
    mtu: int

    def to_dict(self) -> dict[str, Any]:
        return {"lid": self.lid, "gid": self.gid, "qpn": self.qpn, "psn": self.psn, "mtu": self.mtu}

    @classmethod
    def from_dict(cls, data: Any) -> QpInfo:
        if not isinstance(data, dict):
            raise ValueError("QP info must be an object")
        try:
            lid, gid, qpn, psn, mtu = (data[k] for k in ("lid", "gid", "qpn", "psn", "mtu"))
        except KeyError as exc:
            raise ValueError(f"QP info lacks {exc}") from None
        for key, value, bits in (("lid", lid, 16), ("qpn", qpn, 24), ("psn", psn, 24)):
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value < (1 << bits)
            ):
                raise ValueError(f"QP info {key} must be an int of {bits} bits, got {value!r}")
        if mtu not in _MTU_ENUM:
            raise ValueError(f"QP info mtu must be one of {sorted(_MTU_ENUM)}, got {mtu!r}")
        if not isinstance(gid, str) or (
            gid and (len(gid) != 32 or any(c not in "0123456789abcdef" for c in gid))
        ):
            raise ValueError(f"QP info gid must be 32 lowercase hex digits or empty, got {gid!r}")
        return cls(lid, gid, qpn, psn, mtu)

    @property
    def gid_text(self) -> str:
        """The gid as pyverbs prints and parses it (8 groups of 4 hex digits)."""
        return ":".join(self.gid[i : i + 4] for i in range(0, 32, 4))


def new_psn(rng: random.Random | None = None) -> int:
    return (rng or random.SystemRandom()).randrange(1 << 24)


@dataclass(frozen=True, slots=True)
class RemoteRegion:
    """A peer segment's memory region: where it lives and the key to touch it."""

    addr: int
    rkey: int
    length: int


@dataclass(frozen=True, slots=True)
class WorkRequest:
    """One RDMA READ/WRITE work request (single SGE)."""

    wr_id: int
    kind: OpKind
    local_addr: int
    lkey: int
    remote_addr: int
    rkey: int
    length: int


def plan_work_requests(
    slices: list[tuple[int, OpKind, int, int, int, RemoteRegion, int]],
    max_message: int = MAX_MESSAGE_BYTES,
) -> list[WorkRequest]:
    """Cut (tag, kind, local addr, lkey, remote offset, region, length) into work
    requests of at most ``max_message`` bytes, each bounds-checked against its
    region. The wr_id of a piece is its tag; the caller counts pieces per tag.

    Raises ValueError for a range outside its region (the NIC would fail it
    with a remote access error; we refuse before posting).
    """
    if max_message <= 0:
        raise ValueError("max_message must be > 0")
    plan: list[WorkRequest] = []
    for tag, kind, local_addr, lkey, remote_offset, region, length in slices:
        if remote_offset < 0 or length < 0 or remote_offset + length > region.length:
            raise ValueError(
                f"range [{remote_offset}, {remote_offset + length}) is outside a region "
                f"of {region.length} bytes"
            )
        done = 0
        while done < length:
            n = min(max_message, length - done)
            plan.append(
                WorkRequest(
                    wr_id=tag,
                    kind=kind,
                    local_addr=local_addr + done,
                    lkey=lkey,
                    remote_addr=region.addr + remote_offset + done,
                    rkey=region.rkey,
                    length=n,
                )
            )
            done += n
    return plan


def mr_access_flags(enums: Any, access: Access) -> int:
    """ibv_access_flags of a memory region for a segment of ``access``.

    The NIC enforces these, whatever a peer holding the rkey posts: a READ
    segment's region has no REMOTE_WRITE, so an RDMA WRITE into it fails with
    a remote access error; a GRANTED one has no REMOTE_READ. LOCAL_WRITE is
    always there: local READs land in our segments, and the verbs require it
    with REMOTE_WRITE.
    """
    flags = enums.IBV_ACCESS_LOCAL_WRITE
    if access.peers_read:
        flags |= enums.IBV_ACCESS_REMOTE_READ
    if access.peers_write:
        flags |= enums.IBV_ACCESS_REMOTE_WRITE
    return int(flags)


class RdmaContext:
    """A device, its protection domain, one CQ, and the MRs of our segments."""

    def __init__(self, device: str, port: int = 1, gid_index: int = 0) -> None:
        pv = load_pyverbs()
        from pyverbs.cq import CQ
        from pyverbs.pd import PD

        names = list_devices()
        if not names:
            raise RdmaUnavailable("no RDMA device on this host")
        if device and device not in names:
            raise RdmaUnavailable(f"RDMA device {device!r} not found (have {names})")
        self.device = device or names[0]
        self._e = pv.enums
        self.ctx = pv.device.Context(name=self.device)
        self.port = port
        self.gid_index = gid_index
        port_attr = self.ctx.query_port(port)
        self.lid = int(port_attr.lid)
        self.mtu = 1024
        try:
            gid = self.ctx.query_gid(port, gid_index)
            self.gid = str(gid).replace(":", "").lower()
        except Exception:
            self.gid = ""
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 4 * MAX_OUTSTANDING_WR, None, None, 0)
        self._mrs: dict[int, Any] = {}

    def register(
        self, seg_id: int, address: int, length: int, access: Access = Access.READ
    ) -> tuple[int, int]:
        """Register a host segment with the remote rights ``access`` gives; returns
        (lkey, rkey)."""
        from pyverbs.mr import MR

        mr = MR(self.pd, length, mr_access_flags(self._e, access), address=address)
        self._mrs[seg_id] = mr
        return int(mr.lkey), int(mr.rkey)

    def deregister(self, seg_id: int) -> None:
        mr = self._mrs.pop(seg_id, None)
        if mr is not None:
            mr.close()

    def keys(self, seg_id: int) -> tuple[int, int] | None:
        mr = self._mrs.get(seg_id)
        return None if mr is None else (int(mr.lkey), int(mr.rkey))

    def create_qp(self) -> tuple[Any, QpInfo]:
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        e = self._e
        cap = QPCap(max_send_wr=MAX_OUTSTANDING_WR, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
        qp = QP(self.pd, init)
        attr = QPAttr()
        attr.port_num = self.port
        attr.qp_access_flags = (
            e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        )
        qp.to_init(attr)
        return qp, QpInfo(self.lid, self.gid, int(qp.qp_num), new_psn(), self.mtu)

    def connect_qp(self, qp: Any, local: QpInfo, remote: QpInfo) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        mtu = _MTU_ENUM[min(local.mtu, remote.mtu)]
        attr = QPAttr()
        attr.path_mtu = mtu
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.max_dest_rd_atomic = 16
        attr.min_rnr_timer = 12
        if remote.gid:
            gr = GlobalRoute(dgid=GID(remote.gid_text), sgid_index=self.gid_index)
            attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=self.port)
        else:
            attr.ah_attr = AHAttr(dlid=remote.lid, port_num=self.port)
        qp.to_rtr(attr)
        attr = QPAttr()
        attr.sq_psn = local.psn
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.max_rd_atomic = 16
        qp.to_rts(attr)

    def close(self) -> None:
        for seg_id in list(self._mrs):
            self.deregister(seg_id)
        for obj in (self.cq, self.pd, self.ctx):
            with contextlib.suppress(Exception):
                obj.close()


class RdmaPeer:
    """The RC QP to one peer, the regions of its segments, and completion polling."""

    def __init__(
        self,
        rdma: RdmaContext,
        qp: Any,
        region_of: Callable[[str], RemoteRegion | None],
        node_id: str,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``region_of`` maps a peer segment name to its region (from lookups);
        ``on_failure`` hears of a completion poller that died."""
        self._rdma = rdma
        self._qp = qp
        self._region_of = region_of
        self.node_id = node_id
        self._pending: dict[int, tuple[Slice, int]] = {}
        self._next_tag = 1
        self._wakeup = asyncio.Event()
        self._poller = TaskSet(f"rdma-poll-{node_id}", on_failure=on_failure)

    def start(self) -> None:
        self._poller.spawn(self._poll(), name=f"rdma-poll-{self.node_id}")

    def post(self, slices: list[Slice]) -> None:
        from pyverbs.wr import SGE, SendWR

        e = self._rdma._e
        entries = []
        for s in slices:
            region = self._region_of(s.remote_name)
            keys = self._rdma.keys(s.local.seg_id)
            if region is None or keys is None or not s.local.is_host:
                s.batch.slice_failed(s, f"segment {s.remote_name!r} is not reachable over rdma")
                continue
            tag = self._next_tag
            self._next_tag += 1
            entries.append(
                (
                    tag,
                    s.kind,
                    s.local.address + s.local_offset,
                    keys[0],
                    s.remote_offset,
                    region,
                    s.length,
                )
            )
            self._pending[tag] = (s, 0)
        try:
            plan = plan_work_requests(entries)
        except ValueError as exc:
            for tag, *_ in entries:
                s, _ = self._pending.pop(tag)
                s.batch.slice_failed(s, str(exc))
            return
        for wr in plan:
            s, n = self._pending[wr.wr_id]
            self._pending[wr.wr_id] = (s, n + 1)
        for wr in plan:
            opcode = e.IBV_WR_RDMA_READ if wr.kind is OpKind.READ else e.IBV_WR_RDMA_WRITE
            send = SendWR(
                wr_id=wr.wr_id,
                opcode=opcode,
                num_sge=1,
                sg=[SGE(wr.local_addr, wr.length, wr.lkey)],
                send_flags=e.IBV_SEND_SIGNALED,
            )
            send.set_wr_rdma(wr.rkey, wr.remote_addr)
            try:
                self._qp.post_send(send)
            except Exception as exc:
                s, _ = self._pending.pop(wr.wr_id, (None, 0))
                if s is not None:
                    s.batch.slice_failed(s, f"posting an rdma work request failed: {exc}")
        self._wakeup.set()

    async def _poll(self) -> None:
        e = self._rdma._e
        cq = self._rdma.cq
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            _npolled, wcs = cq.poll(64)
            for wc in wcs:
                entry = self._pending.get(wc.wr_id)
                if entry is None:
                    continue
                s, left = entry
                if wc.status != e.IBV_WC_SUCCESS:
                    del self._pending[wc.wr_id]
                    s.batch.slice_failed(s, f"rdma work request failed with status {wc.status}")
                elif left <= 1:
                    del self._pending[wc.wr_id]
                    s.batch.slice_done(s)
                else:
                    self._pending[wc.wr_id] = (s, left - 1)
            # Yield to the loop between polls; see the module docstring.
            await asyncio.sleep(0)

    async def close(self) -> None:
        self._poller.cancel()
        await self._poller.wait()
        for s, _ in self._pending.values():
            s.batch.slice_failed(s, "rdma transport closed")
        self._pending.clear()
        with contextlib.suppress(Exception):
            self._qp.close()


def rdma_configured_reason(device: str) -> str | None:
    """Why RDMA cannot run here (None if it can): used to skip and to log."""
    try:
        load_pyverbs()
    except RdmaUnavailable as exc:
        return str(exc)
    names = list_devices()
    if not names:
        return "no RDMA NIC on this host (no ibverbs devices)"
    if device and device not in names:
        return f"RDMA device {device!r} not found (have {names})"
    if os.environ.get("MOONCAKED_DISABLE_RDMA"):
        return "disabled by MOONCAKED_DISABLE_RDMA"
    return None
