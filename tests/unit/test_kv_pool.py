from __future__ import annotations

import pytest

from mooncaked.cache.hashing import block_hashes, hash_block, root_hash
from mooncaked.engine.kv_pool import BlockPool, CachedRun


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def cached(pool: BlockPool, *hashes: bytes) -> list[int]:
    """Fresh blocks, one per hash, each cached under its hash."""
    ids = pool.allocate(len(hashes))
    assert ids is not None
    for block_id, block_hash in zip(ids, hashes, strict=True):
        pool.cache_block(block_id, block_hash)
    return ids


def test_allocate_hands_out_fresh_blocks_in_order_and_refuses_when_short() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    pool.check_integrity([[0, 1, 2]])


def test_free_keeps_cached_blocks_longest_and_evicts_lru_first() -> None:
    pool = BlockPool(4)
    a = cached(pool, h(1), h(2))
    b = pool.allocate(1)
    assert b == [2]
    pool.free(a)  # tail first: block 1 (h2) then block 0 (h1)
    pool.free(b)  # unhashed: goes to the head
    pool.check_integrity([])
    # Fresh/unhashed blocks first: 2, then 3, then the cached ones in LRU order.
    assert pool.allocate(2) == [2, 3]
    assert pool.cached_blocks == {h(1): 0, h(2): 1}
    assert pool.allocate(1) == [1]  # h2 freed first: evicted first
    assert pool.cached_blocks == {h(1): 0}
    assert pool.num_evictions == 1


def test_prefix_hit_revives_a_free_cached_block() -> None:
    pool = BlockPool(3)
    ids = cached(pool, h(7), h(8))
    pool.free(ids)
    assert pool.longest_cached_prefix([h(7), h(8), h(9)]) == [0, 1]
    assert pool.longest_cached_prefix([h(8)]) == [1]
    pool.touch([0, 1])
    assert pool.num_free_blocks == 1
    pool.check_integrity([[0, 1]])
    pool.touch([0])  # shared by a second request
    pool.free([0, 1])
    pool.check_integrity([[0]])
    pool.free([0])
    pool.check_integrity([])


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(2)
    ids = pool.allocate(2)
    assert ids is not None
    assert pool.cache_block(ids[0], h(1))
    assert not pool.cache_block(ids[1], h(1))
    assert pool.cached_blocks == {h(1): ids[0]}
    pool.free(ids)
    pool.check_integrity([])


def test_double_free_is_an_invariant_violation() -> None:
    pool = BlockPool(2)
    ids = pool.allocate(1)
    assert ids is not None
    pool.free(ids)
    with pytest.raises(RuntimeError):
        pool.free(ids)


def test_check_integrity_catches_a_wrong_ref_count() -> None:
    pool = BlockPool(2)
    ids = pool.allocate(1)
    assert ids is not None
    with pytest.raises(RuntimeError, match="ref_cnt 1, held by 0"):
        pool.check_integrity([])


def test_reset_prefix_cache_drops_only_free_cached_blocks_and_reports_events() -> None:
    pool = BlockPool(3)
    events: list[tuple[bytes, bool]] = []
    pool.listeners.append(lambda bh, stored: events.append((bh, stored)))
    ids = cached(pool, h(1), h(2))
    pool.free([ids[1]])
    assert pool.reset_prefix_cache() == 1
    assert pool.cached_blocks == {h(1): ids[0]}
    assert events == [(h(1), True), (h(2), True), (h(2), False)]
    pool.check_integrity([[ids[0]]])


def test_cache_blocks_tells_one_run_after_each_block() -> None:
    pool = BlockPool(4)
    events: list[object] = []
    pool.listeners.append(lambda bh, stored: events.append((bh, stored)))
    pool.run_listeners.append(events.append)
    ids = pool.allocate(3)
    assert ids is not None
    pool.cache_blocks(ids[:2], [h(1), h(2)], parent=None, token_ids=[1, 2, 3, 4])
    # A twin of h(2) computed concurrently stays private; the run still names
    # h(2), which the index holds.
    pool.cache_blocks(ids[2:], [h(2)], parent=h(1), token_ids=[3, 4])
    assert events == [
        (h(1), True),
        (h(2), True),
        CachedRun((h(1), h(2)), None, (1, 2, 3, 4)),
        CachedRun((h(2),), h(1), (3, 4)),
    ]
    assert pool.cached_blocks == {h(1): ids[0], h(2): ids[1]}
    pool.check_integrity([ids])


def test_a_run_without_tokens_is_cached_but_not_told() -> None:
    pool = BlockPool(2)
    runs: list[CachedRun] = []
    pool.run_listeners.append(runs.append)
    ids = pool.allocate(1)
    assert ids is not None
    pool.cache_blocks(ids, [h(1)], parent=None, token_ids=None)
    assert pool.cached_blocks == {h(1): ids[0]}
    assert runs == []


def test_cache_blocks_refuses_mismatched_runs() -> None:
    pool = BlockPool(2)
    ids = pool.allocate(2)
    assert ids is not None
    with pytest.raises(ValueError, match="2 block ids for 1 hashes"):
        pool.cache_blocks(ids, [h(1)], parent=None, token_ids=[1])
    with pytest.raises(ValueError, match="3 token ids do not split into 2 blocks"):
        pool.cache_blocks(ids, [h(1), h(2)], parent=None, token_ids=[1, 2, 3])


def test_disabled_prefix_caching_tells_no_run() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    runs: list[CachedRun] = []
    pool.run_listeners.append(runs.append)
    ids = pool.allocate(1)
    assert ids is not None
    pool.cache_blocks(ids, [h(1)], parent=None, token_ids=[1, 2])
    assert runs == []


def test_disabled_prefix_caching_never_hits() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    ids = pool.allocate(1)
    assert ids is not None
    assert not pool.cache_block(ids[0], h(1))
    assert pool.longest_cached_prefix([h(1)]) == []


def test_block_hashes_chain_and_depend_on_model_and_prefix() -> None:
    tokens = list(range(40))
    hs = block_hashes(tokens, 16, "m")
    assert len(hs) == 2  # the partial tail has no hash
    assert hs[0] == hash_block(root_hash("m", 16), tokens[:16])
    assert hs[1] == hash_block(hs[0], tokens[16:32])
    assert block_hashes(tokens, 16, "other")[0] != hs[0]
    changed = [99, *tokens[1:]]
    assert block_hashes(changed, 16, "m")[1] != hs[1]  # the chain carries the prefix
    assert block_hashes(tokens, 16, "m", parent=hs[0], start_block=1) == hs[1:]
    with pytest.raises(ValueError):
        block_hashes(tokens, 16, "m", start_block=1)


def test_a_timed_hold_keeps_its_blocks_until_the_clock_passes_its_deadline() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(2)
    assert ids == [0, 1]
    pool.hold(ids, until=10.0)
    pool.free(ids)  # the request lets go; the hold's reference stays
    assert pool.num_free_blocks == 2 and pool.allocate(3) is None
    pool.check_integrity([])  # the pool counts its own holds
    assert pool.next_deadline() == 10.0
    assert pool.release_expired(9.99) == 0 and pool.num_holds == 1
    assert pool.release_expired(10.0) == 1
    assert pool.num_holds == 0 and pool.next_deadline() is None
    # Unhashed, so back at the head: the first handed out again.
    assert pool.allocate(2) == [0, 1]
    pool.free([0, 1])
    pool.check_integrity([])


def test_timed_holds_expire_in_deadline_order_and_a_released_one_is_skipped() -> None:
    pool = BlockPool(4)
    late = pool.hold([0], until=30.0)
    soon = pool.hold([1], until=5.0)
    pool.hold([2], until=20.0)
    assert pool.next_deadline() == 5.0
    pool.release(soon)
    pool.release(soon)  # released already: nothing happens
    assert pool.next_deadline() == 20.0
    assert pool.release_expired(25.0) == 1
    assert pool.held_blocks() == [0]
    pool.release(late)
    assert pool.release_expired(100.0) == 0 and pool.num_free_blocks == 4
    pool.check_integrity([])


def test_a_keyed_hold_revives_a_free_cached_block_until_released() -> None:
    pool = BlockPool(3)
    ids = pool.allocate(2)
    assert ids is not None
    pool.cache_block(ids[0], h(1))
    pool.free(ids)  # block 1 (unhashed) to the head, block 0 (cached) to the tail
    key = pool.hold([0])  # an offload copies it out: no deadline
    assert pool.next_deadline() is None and pool.num_free_blocks == 2
    pool.check_integrity([])
    assert pool.release_expired(1e9) == 0  # only a release ends it
    held_twice = pool.hold([0, 0])
    assert pool.blocks[0].ref_cnt == 3 and pool.held_blocks() == [0, 0, 0]
    pool.check_integrity([])
    pool.release(held_twice)
    pool.release(key)
    # Still cached, back at the tail: the last to be evicted.
    assert pool.allocate(2) == [1, 2] and pool.cached_blocks == {h(1): 0}
    pool.check_integrity([[1, 2]])


def test_check_integrity_catches_a_hold_released_behind_the_pools_back() -> None:
    pool = BlockPool(2)
    pool.hold([0], until=1.0)
    pool.free([0])  # someone frees a reference that is the hold's
    with pytest.raises(RuntimeError, match="ref_cnt 0, held by 1"):
        pool.check_integrity([])
