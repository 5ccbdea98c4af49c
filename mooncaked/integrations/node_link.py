"""A program outside the cluster using one mooncaked node as its KV store:
lease, read, write, commit, each under the node's access rules.

- ``lease(hashes)``: the node's lease call (``wire.lease``), as a peer reader
  makes it: the longest prefix of the hashes the node holds, its DRAM slots
  leased for a while.
- ``read(offer, rows)``: those slots read into local staging rows through the
  transfer engine (shared memory when the node is on this host, TCP
  otherwise: the engine's handshake picks), then the lease released; a lease
  that had lapsed means the bytes may be another block's, and none count.
- ``put(hashes, rows)``: staging rows written into the node's replica inbox
  rows (``wire.replicas``: reserve, write, commit with each block's CRC), as
  a writer outside the cluster view (the node's
  ``store.replica_max_rows_outside`` caps such writers).

Every call is signed with the cluster secret. Staging rows are a transfer
segment no peer may touch (``Access.GRANTED``, nothing granted). Failures
are ``LinkError``s or short counts: the caller recomputes.

``LoopThread`` runs the link's event loop on a thread of its own, so that a
caller on another thread (vLLM's scheduler and worker) never waits on I/O
beyond what it asks for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import structlog
import torch

from mooncaked.cache.hashing import BlockHash
from mooncaked.cache.inbox import Outcome
from mooncaked.cache.layout import BlockLayout
from mooncaked.cache.peer import Offer, PeerError
from mooncaked.cache.ssd import data_crc
from mooncaked.config import TransferConfig
from mooncaked.transfer import OpStatus, TransferEngine, TransferOp
from mooncaked.transfer.access import Access
from mooncaked.wire.kv_io import TransferBlockReader
from mooncaked.wire.lease import LeaseClient
from mooncaked.wire.replicas import CommitBody, ReplicaClient, ReplicaError, ReserveBody

log = structlog.get_logger(__name__)

T = TypeVar("T")

STAGING_SEGMENT = "vllm.staging"


class LinkError(Exception):
    """The node could not be asked, or answered nonsense."""


class LoopThread:
    """An event loop on a daemon thread, owned: ``close`` stops and joins it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """``coro``'s result, waited for at most ``timeout_s`` (TimeoutError)."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no answer within {timeout_s:.3g} s") from None

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10.0)
        if not self._thread.is_alive():
            self.loop.close()


class NodeLink:
    """The calls to one node, on one event loop. ``staging_rows`` 0: leases
    only (vLLM's scheduler side moves no bytes)."""

    def __init__(
        self,
        *,
        node_url: str,
        name: str,
        secret: bytes,
        layout: BlockLayout,
        staging_rows: int = 0,
        timeout_s: float = 10.0,
        transports: tuple[str, ...] = ("shm", "tcp"),
    ) -> None:
        self.node_url = node_url
        self.name = name
        self.layout = layout
        self.timeout_s = timeout_s
        self._secret = secret
        self._staging_rows = staging_rows
        self._transports = transports
        self._leases = LeaseClient(
            secret=secret,
            node_id=lambda: name,
            block_bytes=layout.block_bytes,
            layout=layout.fingerprint(),
        )
        self._replicas: ReplicaClient | None = None
        self._transfer: TransferEngine | None = None
        self._reader: TransferBlockReader | None = None
        # uint8 [staging_rows, block_bytes], the staging segment's memory.
        self.rows: torch.Tensor | None = None

    async def start(self) -> None:
        await self._leases.start()
        if self._staging_rows == 0:
            return
        bb = self.layout.block_bytes
        transfer = TransferEngine(
            TransferConfig(transports=self._transports), self.name, self._secret
        )
        await transfer.start()
        self._transfer = transfer
        # Peers write only rows granted to them, and this link grants none:
        # nothing of the staging memory is reachable from outside.
        segment = transfer.allocate(STAGING_SEGMENT, self._staging_rows * bb, Access.GRANTED)
        self.rows = torch.frombuffer(segment.view, dtype=torch.uint8).view(self._staging_rows, bb)
        self._reader = TransferBlockReader(transfer, STAGING_SEGMENT)
        self._replicas = ReplicaClient(secret=self._secret)
        await self._replicas.__aenter__()

    async def close(self) -> None:
        """Each part started is closed, the last first."""
        if self._replicas is not None:
            await self._replicas.__aexit__(None, None, None)
        if self._transfer is not None:
            self.rows = None
            await self._transfer.close()
        await self._leases.close()

    async def lease(self, hashes: Sequence[BlockHash], ttl_s: float) -> Offer | None:
        """The longest prefix of ``hashes`` the node holds, leased (None: none)."""
        if not hashes:
            return None
        try:
            return await self._leases.lookup(self.node_url, hashes, ttl_s, self.timeout_s)
        except PeerError as exc:
            raise LinkError(str(exc)) from None

    async def release(self, offer: Offer) -> bool:
        """False: the lease had lapsed (or the node cannot say)."""
        try:
            return await self._leases.release(offer, self.timeout_s)
        except PeerError as exc:
            log.warning("vllm_connector.release_failed", error=str(exc))
            return False

    async def read(self, offer: Offer, rows: Sequence[int]) -> int:
        """The offer's blocks into staging ``rows``; how many leading blocks
        are good (0 when the lease lapsed meanwhile). Releases the lease."""
        reader = self._require(self._reader)
        bb = self.layout.block_bytes
        try:
            n = await reader.read(offer, [r * bb for r in rows], self.timeout_s)
        except (PeerError, OSError, ValueError, RuntimeError) as exc:
            log.warning("vllm_connector.read_failed", node=offer.node_id, error=repr(exc))
            n = 0
        if not await self.release(offer):
            return 0
        return n

    async def put(self, hashes: Sequence[BlockHash], rows: Sequence[int]) -> int:
        """Staging ``rows`` (block i holds ``hashes[i]``) onto the node; how
        many it holds now (stored, or held already)."""
        client, transfer = self._require(self._replicas), self._require(self._transfer)
        staged = self._require(self.rows)
        body = ReserveBody(
            self.name, tuple(hashes), self.layout.block_bytes, self.layout.fingerprint()
        )
        try:
            answer = await client.reserve(self.node_url, None, body, self.timeout_s)
            if answer.reservation_id == 0:
                return len(answer.held)
            bb = self.layout.block_bytes
            picked = [rows[k] for k in answer.reserved]
            ops = [
                TransferOp.write(STAGING_SEGMENT, r * bb, answer.node_id, answer.segment, off, bb)
                for r, off in zip(picked, answer.offsets, strict=True)
            ]
            transfer.add_peer(answer.node_id, answer.transfer_address)
            batch = await transfer.submit(ops, op_timeout_s=self.timeout_s)
            await batch.wait()
            crcs = tuple(
                data_crc(hashes[k], staged[r].numpy()) if st is OpStatus.DONE else None
                for k, r, st in zip(answer.reserved, picked, batch.statuses, strict=True)
            )
            commit = CommitBody(self.name, answer.reservation_id, crcs)
            outcomes = (await client.commit(self.node_url, None, commit, self.timeout_s)).outcomes
        except (ReplicaError, OSError, ValueError, RuntimeError) as exc:
            raise LinkError(str(exc)) from None
        kept = sum(o in (Outcome.STORED, Outcome.HELD) for o in outcomes)
        return len(answer.held) + kept

    @staticmethod
    def _require(part: T | None) -> T:
        if part is None:
            raise RuntimeError("this link moves no bytes (staging_rows 0) or is not started")
        return part
