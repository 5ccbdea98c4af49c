"""KV events out of one node, as an async context manager.

Enter: import the "events" extra (pyzmq, msgpack), open the PUB socket and
attach the source to the device pool, before the engine runs, so every block
it caches is told. Exit: detach (a last batch says the node holds nothing),
send what is queued, close the socket. With ``cluster.kv_events_endpoint``
empty nothing is imported and nothing runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import structlog

from mooncaked.config import ClusterConfig, ConfigError
from mooncaked.engine.kv_pool import BlockPool
from mooncaked.kv_events.events import KVEventSource

if TYPE_CHECKING:
    from mooncaked.kv_events.publisher import ZmqPublisher

log = structlog.get_logger(__name__)

_KEY = "cluster.kv_events_endpoint"


@dataclass(frozen=True, slots=True)
class KVEventsStats:
    """Both halves' counters, for /metrics and /admin/status."""

    endpoint: str
    topic: str
    format: str
    batches_sent: int
    events_sent: int
    bytes_sent: int
    send_errors: int
    # Waiting for the thread now.
    queued: int
    batches_dropped: int
    events_dropped: int
    # What a subscriber that saw every batch believes the node holds.
    announced_blocks: int
    failure: str | None


class KVEvents:
    """A node's KV events while they run: the source and its publisher."""

    __slots__ = ("publisher", "source")

    def __init__(self, source: KVEventSource, publisher: ZmqPublisher) -> None:
        self.source = source
        self.publisher = publisher

    def stats(self) -> KVEventsStats:
        src, pub = self.source.stats(), self.publisher.stats()
        return KVEventsStats(
            endpoint=self.publisher.bound_endpoint,
            topic=self.publisher.topic,
            format=self.publisher.fmt,
            batches_sent=pub.batches_sent,
            events_sent=pub.events_sent,
            bytes_sent=pub.bytes_sent,
            send_errors=pub.send_errors,
            queued=pub.queued,
            batches_dropped=src.batches_dropped,
            events_dropped=src.events_dropped,
            announced_blocks=src.announced_blocks,
            failure=pub.failure,
        )

    def status_section(self) -> dict[str, Any]:
        return asdict(self.stats())


def _publisher_module(endpoint: str) -> ModuleType:
    """``kv_events.publisher``, whose imports (pyzmq, msgpack) are the "events" extra's."""
    try:
        return importlib.import_module("mooncaked.kv_events.publisher")
    except ImportError as exc:
        raise ConfigError(
            f"'{_KEY}' = {endpoint!r} needs the 'events' extra ({exc.name or exc} is not "
            "installed): pip install 'mooncaked[events]', or leave the key empty"
        ) from None


@contextlib.asynccontextmanager
async def publishing(
    config: ClusterConfig, pool: BlockPool, *, block_size: int
) -> AsyncIterator[KVEvents | None]:
    """``pool``'s block events on ``config.kv_events_endpoint`` while entered;
    None when the key is empty. ConfigError when the extra is missing or the
    endpoint cannot be bound or connected."""
    endpoint = config.kv_events_endpoint
    if not endpoint:
        yield None
        return
    module = _publisher_module(endpoint)
    try:
        publisher: ZmqPublisher = module.ZmqPublisher(
            endpoint, topic=config.kv_events_topic, fmt=config.kv_events_format
        )
    except OSError as exc:
        raise ConfigError(f"'{_KEY}' = {endpoint!r}: {exc}") from None
    try:
        source = KVEventSource(
            pool, publisher.offer, asyncio.get_running_loop(), block_size=block_size
        )
        source.attach()
        log.info(
            "kv events publishing",
            endpoint=publisher.bound_endpoint,
            binds=module.binds(endpoint),
            topic=config.kv_events_topic,
            format=config.kv_events_format,
        )
        try:
            yield KVEvents(source, publisher)
        finally:
            source.close()
            log.info("kv events stopped", **asdict(source.stats()))
    finally:
        await asyncio.to_thread(publisher.close)
