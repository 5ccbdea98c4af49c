"""The device pool's block events as KV-event batches: exact events and orders."""

from __future__ import annotations

import asyncio

import pytest

from mooncaked.engine.kv_pool import BlockPool
from mooncaked.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventSource,
)

BLOCK = 2


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


class Sink:
    """The publisher's offer: keeps batches, or refuses them while ``full``."""

    def __init__(self) -> None:
        self.batches: list[EventBatch] = []
        self.full = False

    def __call__(self, batch: EventBatch) -> bool:
        if self.full:
            return False
        self.batches.append(batch)
        return True


def source_on(pool: BlockPool, sink: Sink) -> KVEventSource:
    src = KVEventSource(
        pool, sink, asyncio.get_running_loop(), block_size=BLOCK, wall_clock=lambda: 12.5
    )
    src.attach()
    return src


def cache_run(pool: BlockPool, hashes: list[bytes], parent: bytes | None = None) -> list[int]:
    ids = pool.allocate(len(hashes))
    assert ids is not None
    tokens = [t for i in range(len(hashes)) for t in (10 * i, 10 * i + 1)]
    pool.cache_blocks(ids, hashes, parent=parent, token_ids=tokens)
    return ids


async def test_one_loop_turn_is_one_batch() -> None:
    pool, sink = BlockPool(8), Sink()
    source_on(pool, sink)
    ids = cache_run(pool, [h(1), h(2)])
    cache_run(pool, [h(3)], parent=h(2))
    assert sink.batches == []  # nothing leaves before the turn ends
    await asyncio.sleep(0)
    assert sink.batches == [
        EventBatch(
            0,
            12.5,
            (
                BlockStored((h(1), h(2)), None, (0, 1, 10, 11), BLOCK),
                BlockStored((h(3),), h(2), (0, 1), BLOCK),
            ),
        )
    ]
    pool.free(ids)
    pool.check_integrity()


async def test_evictions_of_one_turn_are_one_removal_in_eviction_order() -> None:
    pool, sink = BlockPool(4), Sink()
    src = source_on(pool, sink)
    pool.free(cache_run(pool, [h(1), h(2), h(3)]))
    src.flush()
    # Two fresh blocks would do: the free queue hands out the one never used,
    # then the least recently used cached ones (the run's tail first).
    assert pool.allocate(3) is not None
    src.flush()
    assert sink.batches[1] == EventBatch(1, 12.5, (BlockRemoved((h(3), h(2))),))
    assert src.announced == {h(1)}


async def test_a_turn_that_leaves_nothing_announced_is_all_blocks_cleared() -> None:
    pool, sink = BlockPool(4), Sink()
    src = source_on(pool, sink)
    pool.free(cache_run(pool, [h(1), h(2)]))
    assert pool.reset_prefix_cache() == 2
    # Stored and removed in one turn: the batch says where it ended.
    src.flush()
    assert sink.batches == [EventBatch(0, 12.5, (AllBlocksCleared(),))]
    assert src.announced == set()


async def test_a_reset_that_keeps_blocks_in_use_removes_the_others() -> None:
    pool, sink = BlockPool(4), Sink()
    src = source_on(pool, sink)
    kept = cache_run(pool, [h(1)])
    pool.free(cache_run(pool, [h(2)], parent=h(1)))
    src.flush()
    pool.reset_prefix_cache()
    src.flush()
    assert sink.batches[1].events == (BlockRemoved((h(2),)),)
    assert src.announced == {h(1)}
    pool.free(kept)


async def test_blocks_never_told_are_never_taken_back() -> None:
    pool, sink = BlockPool(2), Sink()
    src = source_on(pool, sink)
    ids = pool.allocate(1)
    assert ids is not None
    # A pipeline stage's blocks: cached, not told.
    pool.cache_blocks(ids, [h(1)], parent=None, token_ids=None)
    pool.free(ids)
    pool.reset_prefix_cache()
    src.flush()
    assert sink.batches == []


async def test_a_full_queue_drops_the_batch_and_skips_its_number() -> None:
    pool, sink = BlockPool(4), Sink()
    src = source_on(pool, sink)
    sink.full = True
    cache_run(pool, [h(1)])
    src.flush()
    sink.full = False
    cache_run(pool, [h(2)], parent=h(1))
    src.flush()
    assert [b.seq for b in sink.batches] == [1]
    stats = src.stats()
    assert (stats.batches_dropped, stats.events_dropped) == (1, 1)
    assert (stats.batches_offered, stats.events_offered) == (1, 1)


async def test_close_stops_listening_and_clears_what_was_told() -> None:
    pool, sink = BlockPool(4), Sink()
    src = source_on(pool, sink)
    cache_run(pool, [h(1)])
    src.close()
    assert [b.events for b in sink.batches] == [(AllBlocksCleared(),)]
    assert pool.listeners == [] and pool.run_listeners == []
    cache_run(pool, [h(2)])
    await asyncio.sleep(0)
    assert len(sink.batches) == 1
    src.close()  # twice is harmless


async def test_attach_twice_is_a_bug() -> None:
    pool = BlockPool(2)
    src = source_on(pool, Sink())
    with pytest.raises(RuntimeError, match="attached already"):
        src.attach()
