"""The KV cache subsystem of a node, as one async context manager.

``KVCache`` owns the tiered store (DRAM pool, SSD tier), the lease desk that
lends DRAM slots to peers, and the peer fetcher that pulls blocks from them.
The wire (control calls, the transfer engine) and who holds what come in as
the protocols of ``mooncaked.cache.peer``, so this package never imports the
layers above it.

Enter: open the SSD tier (replaying its log) and start the store's workers.
Exit, in order: wait for peer fetches in flight (they write into DRAM slots),
end the leases granted to peers, then close the store (queued offloads and
SSD writes finish, the SSD log is appended and synced).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from mooncaked.cache.hashing import BlockHash
from mooncaked.cache.layout import BlockLayout
from mooncaked.cache.peer import (
    BlockReader,
    HolderLocator,
    LeaseDesk,
    PeerClient,
    PeerFetcher,
    ReaderKind,
)
from mooncaked.cache.store import TieredStore
from mooncaked.config import StoreConfig

log = structlog.get_logger(__name__)


class KVCache:
    def __init__(
        self,
        config: StoreConfig,
        layout: BlockLayout,
        *,
        client: PeerClient,
        reader: BlockReader,
        locator: HolderLocator,
        device_prefix: Callable[[list[BlockHash]], int],
        dram_backing: Any = None,
        on_failure: Callable[[BaseException], None] | None = None,
        classify_reader: Callable[[str], ReaderKind] | None = None,
    ) -> None:
        """``classify_reader`` tells cluster members from other readers of this
        node's DRAM leases (see ``LeaseDesk``)."""
        self.config = config
        self.store = TieredStore(layout, config, dram_backing=dram_backing, on_failure=on_failure)
        self.desk = LeaseDesk(
            self.store,
            max_leases=config.peer_max_leases,
            max_leases_per_reader=config.peer_max_leases_per_reader,
            max_leases_outside=config.peer_max_leases_outside,
            classify=classify_reader,
        )
        self.fetcher = PeerFetcher(
            self.store,
            locator,
            client,
            reader,
            timeout_s=config.peer_fetch_timeout_s,
            max_fetches=config.peer_max_fetches,
            device_prefix=device_prefix,
        )

    async def __aenter__(self) -> KVCache:
        await self.store.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.fetcher.close()
            self.desk.close()
        finally:
            await self.store.close()
