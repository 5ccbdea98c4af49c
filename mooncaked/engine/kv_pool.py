"""The device KV block pool: ref counts, the prefix index and the free queue.

The pool knows block ids and hashes, never tensors. Invariants:

- ``ref_cnt == 0`` means the block is on the free queue; a block with
  ``ref_cnt > 0`` is held by that many requests.
- The free queue is in eviction order: blocks without a hash (never filled,
  or a partial tail) sit at the head and are handed out first; blocks that
  still hold a cached prefix are appended at the tail as they are freed, so
  the least recently used cached block is evicted first. Eviction is lazy: a
  cached block keeps its hash on the free queue and can be revived by a prefix
  hit until ``allocate`` hands it out again.
- ``cached_blocks`` maps a block hash to the one block that holds it.
- A *hold* is a reference the pool keeps on blocks for someone outside the
  block tables: a copy out of them in flight (released by key when it ends),
  or a writer outside the node that may still write them (released once the
  engine's clock passes its deadline, ``release_expired``). The pool owns
  every hold, so its self-check counts them without being told.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from mooncaked.cache.hashing import BlockHash

# (hash, stored: True | removed: False); the tiered store and gossip listen.
BlockEventListener = Callable[[BlockHash, bool], None]


@dataclass(frozen=True, slots=True)
class CachedRun:
    """Consecutive full blocks of one sequence, just published to the prefix index.

    ``parent_hash`` is the hash of the block before the first (None when the
    run starts the sequence); ``token_ids`` are the blocks' tokens, the same
    number for each block. Routers outside the node rebuild their own keys
    from them (KV events), which the hashes alone would not let them do.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]


RunListener = Callable[[CachedRun], None]


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Bumped each time a block is handed out by ``allocate``: new contents
        # (written by this node's steps, a peer, a cache tier) can only come
        # into a block that way, so a copy of a block made at one generation
        # holds its contents as long as the generation stands (an attention
        # kernel's own layout of the cache, engine/vllm_cpu.py). A prefix hit
        # that revives a cached block does not bump it: its contents stay.
        self.generations = np.zeros(num_blocks, dtype=np.int64)
        # An OrderedDict used as a linked list: O(1) removal from the middle when
        # a prefix hit revives a free cached block.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[BlockHash, int] = {}
        self.listeners: list[BlockEventListener] = []
        # Told of each run ``cache_blocks`` publishes (after ``listeners`` heard
        # of its blocks one by one).
        self.run_listeners: list[RunListener] = []
        self.num_evictions = 0
        # Holds by key: the blocks each keeps a reference on.
        self._holds: dict[int, tuple[int, ...]] = {}
        # (deadline, key) of the timed holds, soonest first; a released
        # hold's entry stays until it comes up (lazy deletion).
        self._deadlines: list[tuple[float, int]] = []
        self._hold_keys = itertools.count()

    # -- queries ---------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def longest_cached_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids holding the longest prefix of ``hashes``; takes no reference."""
        if not self.enable_prefix_caching:
            return []
        out: list[int] = []
        for h in hashes:
            block_id = self.cached_blocks.get(h)
            if block_id is None:
                break
            out.append(block_id)
        return out

    # -- paired verbs ----------------------------------------------------

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks with ref_cnt 1, or None when the pool is short."""
        if n > len(self._free):
            return None
        out: list[int] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block_id)
        self.generations[out] += 1
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on blocks found by a prefix hit (maybe on the free queue)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; a request frees its whole table."""
        # Reversed: a request's tail blocks are the least likely to be shared, so
        # they reach the free queue first and are evicted first.
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    # Nothing worth keeping: hand it out before any cached block.
                    self._free.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Publish a full block under its hash; False if that hash is already held."""
        if not self.enable_prefix_caching:
            return False
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise RuntimeError(f"block {block_id} re-hashed with different content")
            return False
        if block_hash in self.cached_blocks:
            # Computed twice concurrently: keep the first, this one stays private.
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block_id
        for listener in self.listeners:
            listener(block_hash, True)
        return True

    def cache_blocks(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        *,
        parent: BlockHash | None,
        token_ids: Sequence[int] | None,
    ) -> None:
        """``cache_block`` each block of a sequence's next full blocks, then tell
        the run listeners: afterwards every hash of the run is in the prefix
        index (held by its block, or by a twin computed concurrently).

        ``parent``: the hash of the block before the first. ``token_ids``: the
        blocks' tokens; None for blocks that are not the whole model's KV (a
        pipeline stage's layers), which are cached but never told as a run.
        """
        if len(block_ids) != len(hashes):
            raise ValueError(f"{len(block_ids)} block ids for {len(hashes)} hashes")
        if token_ids is not None and hashes and len(token_ids) % len(hashes):
            raise ValueError(f"{len(token_ids)} token ids do not split into {len(hashes)} blocks")
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            self.cache_block(block_id, block_hash)
        if not (self.enable_prefix_caching and hashes and token_ids is not None):
            return
        run = CachedRun(tuple(hashes), parent, tuple(token_ids))
        for listener in self.run_listeners:
            listener(run)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block not in use; returns how many were dropped."""
        dropped = 0
        for block_id in list(self._free):
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
                self._free.move_to_end(block_id, last=False)
                dropped += 1
        return dropped

    def _evict(self, block: KVBlock) -> None:
        h = block.block_hash
        if h is None:
            return
        block.block_hash = None
        if self.cached_blocks.get(h) == block.block_id:
            del self.cached_blocks[h]
        self.num_evictions += 1
        for listener in self.listeners:
            listener(h, False)

    # -- holds -----------------------------------------------------------

    def hold(self, block_ids: Sequence[int], until: float | None = None) -> int:
        """Keep a reference on each block; the key ``release`` takes.

        ``until``: a deadline on the engine's clock, after which
        ``release_expired`` lets the hold go; None holds until released.
        Blocks on the free queue (a cached block nobody uses) leave it.
        """
        key = next(self._hold_keys)
        ids = tuple(block_ids)
        self.touch(ids)
        self._holds[key] = ids
        if until is not None:
            heapq.heappush(self._deadlines, (until, key))
        return key

    def release(self, key: int) -> None:
        """Drop a hold's references now; a key released already is ignored."""
        ids = self._holds.pop(key, None)
        if ids:
            self.free(ids)

    def release_expired(self, now: float) -> int:
        """Release every timed hold whose deadline is ``now`` or earlier; how many."""
        n = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, key = heapq.heappop(self._deadlines)
            if key in self._holds:
                self.release(key)
                n += 1
        return n

    def next_deadline(self) -> float | None:
        """When the soonest timed hold expires; None while there is none."""
        while self._deadlines and self._deadlines[0][1] not in self._holds:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    @property
    def num_holds(self) -> int:
        return len(self._holds)

    def held_blocks(self) -> list[int]:
        """Every block a hold keeps, once per hold (a block held twice twice)."""
        return [b for ids in self._holds.values() for b in ids]

    # -- self-check ------------------------------------------------------

    def check_integrity(self, holders: Iterable[Sequence[int]] | None = None) -> None:
        """Raise RuntimeError unless free + used == total and the index is coherent.

        ``holders``: every live block table; when given, each block's ref count
        must equal the number of tables that hold it plus the pool's own holds.
        """
        free_ids = set(self._free)
        if len(free_ids) != len(self._free):
            raise RuntimeError("free queue holds a block twice")
        used = [b for b in self.blocks if b.ref_cnt > 0]
        if len(free_ids) + len(used) != self.num_blocks:
            raise RuntimeError(
                f"free {len(free_ids)} + used {len(used)} != total {self.num_blocks}"
            )
        for b in self.blocks:
            if b.ref_cnt < 0:
                raise RuntimeError(f"block {b.block_id} has ref_cnt {b.ref_cnt}")
            if (b.ref_cnt == 0) != (b.block_id in free_ids):
                raise RuntimeError(f"block {b.block_id} ref_cnt {b.ref_cnt} vs free queue")
        for h, block_id in self.cached_blocks.items():
            if self.blocks[block_id].block_hash != h:
                raise RuntimeError(f"prefix index points at block {block_id} of another hash")
        num_hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        if num_hashed != len(self.cached_blocks):
            raise RuntimeError("a block carries a hash missing from the prefix index")
        if holders is not None:
            expected = [0] * self.num_blocks
            for table in (*holders, *self._holds.values()):
                for block_id in table:
                    expected[block_id] += 1
            for b in self.blocks:
                if b.ref_cnt != expected[b.block_id]:
                    raise RuntimeError(
                        f"block {b.block_id} ref_cnt {b.ref_cnt}, held by {expected[b.block_id]}"
                    )
