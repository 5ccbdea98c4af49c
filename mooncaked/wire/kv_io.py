"""The engine's and the cache's byte movers over the transfer engine.

The engine layer (``KVWriter``, ``WriteGrants`` of ``engine.handoff``) and the
cache layer (``BlockReader`` of ``cache.peer``) sit above the transfer layer
and never import it; these adapters give each what it asks for in terms of
``TransferEngine`` batches and grants. ``TransferKVSegment`` puts the device
KV cache in a transfer segment; ``handoff_ports`` gives the engine's handoff
sides everything they move bytes and call prefill nodes with.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Sequence

import structlog
import torch

from mooncaked.cache.peer import Offer, PeerError
from mooncaked.cluster.watch import MemberLost, MemberWatch
from mooncaked.config import PipelineConfig
from mooncaked.engine.core import EngineCore
from mooncaked.engine.handoff import HandoffPorts, KVWrite
from mooncaked.engine.pipeline import ACT_IN_SEGMENT, ACT_OUT_SEGMENT, ChunkNotice, StagePipe
from mooncaked.engine.serving import KV_SEGMENT
from mooncaked.handoff import KVGrant, KVLayout
from mooncaked.rpc import Target
from mooncaked.transfer import Access, OpStatus, TransferEngine, TransferOp, WriteGrant
from mooncaked.wire.prefill import PrefillClient

log = structlog.get_logger(__name__)


class TransferKVWriter:
    """The KV sender's ``KVWriter`` over the transfer engine."""

    def __init__(self, transfer: TransferEngine, watch: MemberWatch | None = None) -> None:
        self._transfer = transfer
        # A frozen decode node would hold the step thread (which waits for
        # the sampling step's writes) for the grant's whole time: gossip
        # declaring it dead ends the wait instead.
        self._watch = watch

    def add_peer(self, node_id: str, address: str) -> None:
        self._transfer.add_peer(node_id, address)

    async def write(
        self, segment: str, writes: list[KVWrite], timeout_s: float
    ) -> tuple[bool, str]:
        ops = [TransferOp.write(segment, lo, node, seg, ro, n) for lo, node, seg, ro, n in writes]
        nodes = {op.remote_node for op in ops}
        try:
            batch = await self._transfer.submit(ops, op_timeout_s=timeout_s)
            if self._watch is not None and len(nodes) == 1:
                try:
                    ok = await self._watch.race(nodes.pop(), batch.wait())
                except MemberLost as exc:
                    batch.fail_pending(f"cut over: {exc}")
                    return False, f"cut over: {exc}"
            else:
                ok = await batch.wait()
            if ok:
                return True, ""
            failures = batch.failures()
            return False, failures[0][1] if failures else "transfer failed"
        except Exception as exc:  # the transfer engine refused the batch
            return False, repr(exc)


class TransferWriteGrants:
    """The KV receiver's ``WriteGrants`` over the transfer engine: a grant's
    blocks, in every layer's K and V plane of the KV segment (or a stage's
    layers' planes), open to one peer; and a stage's ``RowGrants``."""

    def __init__(self, transfer: TransferEngine) -> None:
        self._transfer = transfer

    def open(
        self, grant: KVGrant, peer: str, ttl_s: float, layers: tuple[int, int] | None = None
    ) -> WriteGrant:
        lay = grant.layout
        return self._transfer.grant_write(
            grant.segment,
            peer,
            block_bytes=lay.block_bytes,
            blocks_per_plane=lay.num_blocks,
            block_ids=grant.block_ids,
            ttl_s=ttl_s,
            # Planes are (layer, K|V): layers [lo, hi) are planes [2 lo, 2 hi).
            planes=None if layers is None else (2 * layers[0], 2 * layers[1]),
        )

    def open_blocks(
        self,
        segment: str,
        peer: str,
        *,
        block_bytes: int,
        num_blocks: int,
        block_ids: Sequence[int],
        ttl_s: float,
    ) -> WriteGrant:
        return self._transfer.grant_write(
            segment,
            peer,
            block_bytes=block_bytes,
            blocks_per_plane=num_blocks,
            block_ids=block_ids,
            ttl_s=ttl_s,
        )

    def close(self, handle: object) -> None:
        if isinstance(handle, WriteGrant):
            self._transfer.revoke(handle)


class TransferInboxGrants:
    """A replica inbox's ``InboxGrants``: rows of its segment (one plane of
    ``num_rows`` blocks) open to one writer."""

    def __init__(self, transfer: TransferEngine, segment: str, block_bytes: int, num_rows: int):
        self._transfer = transfer
        self._segment = segment
        self._block_bytes = block_bytes
        self._num_rows = num_rows

    def open(self, peer: str, rows: Sequence[int], ttl_s: float) -> WriteGrant:
        return self._transfer.grant_write(
            self._segment,
            peer,
            block_bytes=self._block_bytes,
            blocks_per_plane=self._num_rows,
            block_ids=rows,
            ttl_s=ttl_s,
        )

    def close(self, handle: object) -> None:
        if isinstance(handle, WriteGrant):
            self._transfer.revoke(handle)


class TransferKVSegment:
    """The device KV cache as the transfer segment ``KV_SEGMENT``: peers write
    into it only blocks granted to them (``Access.GRANTED``)."""

    def __init__(self, transfer: TransferEngine) -> None:
        self._transfer = transfer

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The engine's ``KVAllocator``."""
        if device.type != "cpu":
            # Device memory: registered after the build, reached through a
            # pinned bounce buffer (or RDMA).
            return torch.zeros(nbytes, dtype=torch.uint8, device=device)
        # Shared memory the transfer engine exposes: prefill nodes write a
        # prompt's KV straight into its blocks (over shm on this host, tcp or
        # rdma elsewhere).
        segment = self._transfer.allocate(KV_SEGMENT, nbytes, Access.GRANTED)
        return torch.frombuffer(segment.view.cast("B"), dtype=torch.uint8)

    def register(self, kv_buffer: torch.Tensor) -> None:
        """Registers the built engine's KV buffer unless ``allocate`` made it:
        device memory, or an engine built by a custom factory, is reachable over
        tcp (through a bounce buffer for device memory)."""
        if self._transfer.segment(KV_SEGMENT) is None:
            self._transfer.register(
                KV_SEGMENT, kv_buffer.view(-1).view(torch.uint8), Access.GRANTED
            )


# A memory node's KV pool, as prefill nodes write prompts into it.
OFFLOAD_KV_SEGMENT = "offload-kv"


class TransferOffloadSegments:
    """A memory node's ``KVSegments``: its pool in a GRANTED transfer segment,
    opened block by block to the prefill node a compute node names."""

    segment = OFFLOAD_KV_SEGMENT

    def __init__(self, transfer: TransferEngine) -> None:
        self._transfer = transfer
        self.node_id = transfer.node_id

    @property
    def address(self) -> str:
        return self._transfer.address

    def allocate(self, nbytes: int) -> torch.Tensor:
        segment = self._transfer.allocate(OFFLOAD_KV_SEGMENT, nbytes, Access.GRANTED)
        return torch.frombuffer(segment.view.cast("B"), dtype=torch.uint8)

    def grant(self, peer: str, layout: KVLayout, block_ids: list[int], ttl_s: float) -> WriteGrant:
        return self._transfer.grant_write(
            OFFLOAD_KV_SEGMENT,
            peer,
            block_bytes=layout.block_bytes,
            blocks_per_plane=layout.num_blocks,
            block_ids=block_ids,
            ttl_s=ttl_s,
        )

    def revoke(self, handle: object) -> None:
        if isinstance(handle, WriteGrant):
            self._transfer.revoke(handle)


@contextlib.asynccontextmanager
async def handoff_ports(
    transfer: TransferEngine,
    *,
    secret: bytes,
    targets: Callable[[str], Target | None],
    watch: MemberWatch,
    pipeline: PipelineConfig | None = None,
    notice: ChunkNotice | None = None,
) -> AsyncIterator[HandoffPorts]:
    """The handoff's ports while entered: the prefill client is open. A
    pipeline stage (``pipeline`` enabled) gets its activations' segments,
    announcing each chunk to the next stage with ``notice``."""
    writer = TransferKVWriter(transfer, watch)
    grants = TransferWriteGrants(transfer)
    make_pipe = None
    if pipeline is not None and pipeline.enabled:
        make_pipe = functools.partial(
            stage_pipe, transfer, pipeline, writer=writer, grants=grants, notice=notice
        )
    async with PrefillClient(secret=secret, targets=targets, watch=watch) as client:
        yield HandoffPorts(
            transfer_address=transfer.address,
            write_grants=grants,
            prefill=client.prefill,
            writer=writer,
            stage_pipe=make_pipe,
        )


def stage_pipe(
    transfer: TransferEngine,
    config: PipelineConfig,
    engine: EngineCore,
    *,
    writer: TransferKVWriter,
    grants: TransferWriteGrants,
    notice: ChunkNotice | None,
) -> StagePipe:
    """A stage's activations over the transfer engine: its input rows in a
    segment the stage before writes only under a grant, its output staged in
    one of its own (each ``pipeline.activation_bytes``)."""
    span, arch, dtype = engine.span, engine.loaded.arch, engine.loaded.dtype
    row_bytes = arch.hidden_size * torch.empty((), dtype=dtype).element_size()
    block_rows = engine.block_size
    rows = max(1, config.activation_bytes // (row_bytes * block_rows)) * block_rows

    def rows_of(name: str, access: Access) -> torch.Tensor:
        segment = transfer.allocate(name, rows * row_bytes, access)
        raw = torch.frombuffer(segment.view.cast("B"), dtype=torch.uint8)
        return raw.view(dtype).view(rows, arch.hidden_size)

    return StagePipe(
        node_id=transfer.node_id,
        span=span,
        hidden_size=arch.hidden_size,
        dtype=dtype,
        block_rows=block_rows,
        # The stage before writes here only under a grant (and reads nothing).
        act_in=None if span.first else rows_of(ACT_IN_SEGMENT, Access.GRANTED),
        act_out=None if span.last else rows_of(ACT_OUT_SEGMENT, Access.READ),
        transfer_address=transfer.address,
        writer=writer,
        grants=grants,
        notice=notice,
    )


class TransferBlockReader:
    """Reads leased slots of a peer's DRAM segment into the local one (a ``BlockReader``)."""

    def __init__(self, transfer: TransferEngine, local_segment: str) -> None:
        self._transfer = transfer
        self._local_segment = local_segment

    async def read(self, offer: Offer, local_offsets: Sequence[int], timeout_s: float) -> int:
        if len(local_offsets) != offer.num_blocks:
            raise ValueError(
                f"{len(local_offsets)} local offsets for an offer of {offer.num_blocks} blocks"
            )
        if not local_offsets:
            return 0
        if offer.node_id == self._transfer.node_id:
            # Ops naming this node are local copies: they would read our own
            # slots, not the peer's. Two nodes must never share an id.
            raise PeerError(f"{offer.peer} answered with this node's own id {offer.node_id!r}")
        self._transfer.add_peer(offer.node_id, offer.transfer_address)
        ops, firsts = _coalesce(self._local_segment, offer, list(local_offsets), offer.block_bytes)
        batch = await self._transfer.submit(ops, op_timeout_s=timeout_s)
        try:
            await batch.wait()
        except asyncio.CancelledError:
            batch.cancel("the fetch was cancelled")
            # The slots are handed back by the caller once this returns: no
            # slice may still be writing into them then.
            while not batch.done:
                try:
                    await asyncio.shield(batch.wait())
                except asyncio.CancelledError:
                    continue
            raise
        n = 0
        for i, status in enumerate(batch.statuses):
            if status is not OpStatus.DONE:
                log.warning("peer.transfer_op_failed", peer=offer.node_id, reason=batch.reason(i))
                break
            n = firsts[i + 1] if i + 1 < len(firsts) else len(local_offsets)
        return n


def _coalesce(
    local_segment: str, offer: Offer, local_offsets: list[int], block_bytes: int
) -> tuple[list[TransferOp], list[int]]:
    """One READ per run of blocks contiguous on both sides; and the index of
    the first block of each op."""
    ops: list[TransferOp] = []
    firsts: list[int] = []
    i = 0
    n = len(local_offsets)
    while i < n:
        j = i + 1
        while (
            j < n
            and offer.offsets[j] == offer.offsets[j - 1] + block_bytes
            and local_offsets[j] == local_offsets[j - 1] + block_bytes
        ):
            j += 1
        ops.append(
            TransferOp.read(
                local_segment,
                local_offsets[i],
                offer.node_id,
                offer.segment,
                offer.offsets[i],
                (j - i) * block_bytes,
            )
        )
        firsts.append(i)
        i = j
    return ops, firsts
