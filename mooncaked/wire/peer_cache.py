"""A node's KV cache wired to its peers: the tiered store with its DRAM pool in
a transfer segment peers read, the lease client it fetches with, and what it
answers peers' lease lookups from; its replica inbox (a segment of its own
that writers write under a grant), what it answers replica calls from, and
the replicator that puts its blocks on other nodes.

The cluster view comes in as a getter: the cache starts before gossip does,
and until then (or when gossip names nobody) the configured ``store.peers``
are the holders asked.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import structlog
import torch

from mooncaked.cache.inbox import ReplicaInbox
from mooncaked.cache.layout import BlockLayout
from mooncaked.cache.peer import ReaderKind
from mooncaked.cache.service import KVCache
from mooncaked.cache.store import TieredStore
from mooncaked.cluster.holders import ClusterHolders
from mooncaked.cluster.state import ClusterView
from mooncaked.config import StoreConfig
from mooncaked.engine.core import EngineCore
from mooncaked.identity import NodeIdentity
from mooncaked.rpc import Target
from mooncaked.transfer import Access, TransferEngine
from mooncaked.wire.kv_io import TransferBlockReader, TransferInboxGrants
from mooncaked.wire.lease import Holding, LeaseClient
from mooncaked.wire.replicas import INBOX_SEGMENT, ReplicaClient, ReplicaDesk
from mooncaked.wire.replicator import Replicator

# The transfer segment the DRAM tier's slots live in; peers read it.
DRAM_SEGMENT = "kv.dram"

ViewGetter = Callable[[], ClusterView | None]


@dataclass(frozen=True, slots=True)
class PeerCache:
    cache: KVCache
    # What lease lookups are answered from; None when the DRAM tier is off.
    holding: Holding | None
    # What replica calls are answered from; None when the DRAM tier is off.
    desk: ReplicaDesk | None
    replicator: Replicator


class _Peers:
    """Who a lease is for and what a call is signed for, by the cluster view."""

    def __init__(self, node_id: str, view: ViewGetter) -> None:
        self._node_id = node_id
        self._view = view

    def classify_reader(self, reader: str) -> ReaderKind:
        """How this node's lease desk counts the reader a signed lookup names.

        Any holder of the secret can sign any name, so a name gets a lease cap
        of its own only when the view knows it as an up member; every other
        name (a node reading through ``store.peers`` without gossip, a member
        gossip has not brought yet, a made-up one) shares the outsiders' cap.
        """
        if reader == self._node_id:
            return ReaderKind.REFUSED
        view = self._view()
        member = view.get(reader) if view is not None else None
        return ReaderKind.MEMBER if member is not None and member.is_up else ReaderKind.OUTSIDER

    def is_member(self, node_id: str) -> bool:
        """An up member of the view (other than this node)."""
        return self.classify_reader(node_id) is ReaderKind.MEMBER

    def target_at(self, url: str) -> Target | None:
        """What a call to the node at ``url`` is signed for, if the view knows it."""
        view = self._view()
        if view is None:
            return None
        member = view.member_at(url.removeprefix("http://").rstrip("/"))
        return None if member is None else Target(member.node_id, member.generation)


@contextlib.asynccontextmanager
async def peer_cache(
    config: StoreConfig,
    identity: NodeIdentity,
    engine: EngineCore,
    transfer: TransferEngine,
    *,
    url: str,
    view: ViewGetter,
    on_failure: Callable[[BaseException], None],
) -> AsyncIterator[PeerCache]:
    """The KV cache while entered. Leaving stops leasing first; the cache's exit
    then lets fetches in flight land (they write into DRAM slots) and closes
    the store."""
    layout = BlockLayout.from_kv_caches(engine.runner.kv_caches)
    num_slots = TieredStore.dram_slots_for(config, layout)
    backing = None
    if num_slots:
        # Shared memory registered with the transfer engine: peers read the
        # slots they lease, over shm when on this host, else tcp or rdma.
        # Read-only to peers: they fetch from it, none may write (a write
        # would be served to clients as cached KV).
        backing = transfer.allocate(DRAM_SEGMENT, num_slots * layout.block_bytes, Access.READ).view
    # A node listed among its own peers would only ever miss.
    peer_urls = tuple(u for u in config.peers if u.rstrip("/") != url)
    peers = _Peers(identity.node_id, view)
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(
            LeaseClient(
                secret=identity.secret,
                node_id=lambda: identity.node_id,
                block_bytes=layout.block_bytes,
                layout=layout.fingerprint(),
                targets=peers.target_at,
            )
        )
        cache = await stack.enter_async_context(
            KVCache(
                config,
                layout,
                client=client,
                reader=TransferBlockReader(transfer, DRAM_SEGMENT),
                # Holders from the cluster's block index once gossip runs;
                # the configured peers when it names nobody (or before).
                locator=ClusterHolders(view, static=peer_urls),
                device_prefix=lambda hashes: len(engine.pool.longest_cached_prefix(hashes)),
                dram_backing=backing,
                on_failure=on_failure,
                classify_reader=peers.classify_reader,
            )
        )
        replicator, desk = await _replicas(stack, identity, engine, transfer, cache, view)
        holding = None
        if num_slots:
            holding = Holding(
                desk=cache.desk,
                block_bytes=layout.block_bytes,
                layout=layout.fingerprint(),
                segment=transfer.descriptor(DRAM_SEGMENT),
                transfer_address=transfer.address,
            )
        structlog.get_logger(__name__).bind(node=identity.node_id).info(
            "store started",
            dram_slots=num_slots,
            ssd=config.ssd_path or None,
            peers=len(peer_urls),
            transfer=transfer.address,
        )
        yield PeerCache(cache, holding, desk, replicator)


async def _replicas(
    stack: contextlib.AsyncExitStack,
    identity: NodeIdentity,
    engine: EngineCore,
    transfer: TransferEngine,
    cache: KVCache,
    view: ViewGetter,
) -> tuple[Replicator, ReplicaDesk | None]:
    """The replicator (its client entered on ``stack``) and, with a DRAM tier,
    what replica calls are answered from; their ends pushed on ``stack``, so
    they run before the cache closes."""
    store = cache.store
    fingerprint = store.layout.fingerprint()
    replicator = Replicator(
        store,
        transfer,
        await stack.enter_async_context(ReplicaClient(secret=identity.secret)),
        node_id=lambda: identity.node_id,
        model_id=lambda: engine.model_id,
        view=view,
        layout=fingerprint,
        dram_segment=DRAM_SEGMENT,
    )
    # Retain jobs in flight read DRAM slots: they end before the store closes.
    stack.push_async_callback(replicator.close)
    if not store.dram.num_slots:
        return replicator, None
    desk = ReplicaDesk(
        store, replica_inbox(cache.config, transfer, cache), fingerprint, transfer.address
    )
    if desk.inbox is not None:
        stack.callback(desk.inbox.close)
    return replicator, desk


def replica_inbox(
    config: StoreConfig, transfer: TransferEngine, cache: KVCache
) -> ReplicaInbox | None:
    """The rows replicas pushed by peers land in: a transfer segment peers
    write only under a grant (``Access.GRANTED``), apart from the read-only
    DRAM segment (``cache/inbox.py`` says why); None when sized 0."""
    block_bytes = cache.store.block_bytes
    if config.replica_inbox_bytes == 0:
        return None
    num_rows = max(1, config.replica_inbox_bytes // block_bytes)
    segment = transfer.allocate(INBOX_SEGMENT, num_rows * block_bytes, Access.GRANTED)
    rows = torch.frombuffer(segment.view.cast("B"), dtype=torch.uint8).view(num_rows, block_bytes)
    return ReplicaInbox(
        cache.store,
        rows,
        TransferInboxGrants(transfer, INBOX_SEGMENT, block_bytes, num_rows),
        ttl_s=config.replica_timeout_s,
        max_rows_outside=config.replica_max_rows_outside,
    )
