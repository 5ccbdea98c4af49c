"""The tiered KV cache (DRAM, SSD, peers) as the engine's KV connector.

- **Prefetch.** When a request arrives and a peer holds blocks of its prompt
  that no local tier has, ``lookup`` answers None until ``prefetch`` has
  pulled them into the local DRAM tier (bounded by a timeout), so the
  request is admitted once and loads everything from DRAM. A request no peer
  can help (``prefetch_wanted`` says so, cheaply) is not held at all.
- **Load.** At admission, the prefix past the device hits found in DRAM or
  on the SSD is loaded into the request's device blocks (``TieredStore.load``)
  while other requests' steps run; only the tail is computed.
- **Offload.** Every block that becomes full and cached on the device is
  offloaded to the store after the step; the pool holds a reference on it
  until the store has copied it, so it cannot hand it out meanwhile.
- **Retain.** A request whose handoff asks for its prompt's KV to be kept
  (``Handoff.retain``) is handed to the ``retain`` hook once it finished and
  the offloads of its prompt's full blocks have landed (the offloads of the
  step that finished it are queued after it finished: the job waits for
  them). The hook (the layers above: pins, replicas) runs it.

``lookup`` only looks; the store's per-tier hit and miss counters move once
per admission (``request_admitted``), over the prompt's blocks past the
device hits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog

from mooncaked.cache.hashing import BlockHash
from mooncaked.cache.store import DeviceBlocks, TieredStore
from mooncaked.engine.connector import NO_HIT, ConnectorContext, KVConnector, KVHit, LoadResult
from mooncaked.engine.plan import LoadJob
from mooncaked.handoff import Retain
from mooncaked.request import Request
from mooncaked.tasks import TaskSet

log = structlog.get_logger(__name__)

# Pulls what peers hold of these blocks into the local DRAM tier; returns how
# many leading blocks are now local.
Prefetch = Callable[[list[BlockHash]], Awaitable[int]]
# Whether a prefetch of these blocks would ask anyone; cheap, no I/O.
PrefetchWanted = Callable[[list[BlockHash]], bool]


@dataclass(frozen=True, slots=True)
class RetainJob:
    """A finished request's prompt KV to keep, its offloads landed."""

    request_id: str
    # The prompt's full blocks.
    hashes: tuple[BlockHash, ...]
    retain: Retain
    # The node that computed the prompt (None: this one, no handoff).
    prefill_node: str | None
    # The decode node this node sent the prompt's KV to (a prefill node), if any.
    sent_to: str | None


# Takes a job and returns at once (it runs the work on a task of its own).
RetainHook = Callable[[RetainJob], None]


class TieredStoreConnector(KVConnector):
    def __init__(
        self,
        store: TieredStore,
        *,
        prefetch: Prefetch | None = None,
        prefetch_timeout_s: float = 2.0,
        prefetch_wanted: PrefetchWanted | None = None,
        retain: RetainHook | None = None,
    ) -> None:
        self.store = store
        self._retain = retain
        self._prefetch = prefetch
        self._prefetch_timeout_s = prefetch_timeout_s
        self._prefetch_wanted = prefetch_wanted
        # Requests whose prefetch is in flight: lookup answers None for them.
        self._prefetching: dict[str, asyncio.Task[None]] = {}
        self._tasks = TaskSet("store-connector")
        # Blocks cached on the device since the last step: offloaded after it.
        self._to_offload: list[BlockHash] = []
        # Offloads in flight, by block: a retain job waits for its prompt's.
        self._offloading: dict[BlockHash, asyncio.Future[int]] = {}
        # Retain jobs of requests that finished this step, before its offloads went.
        self._retain_next: list[RetainJob] = []
        self.num_offloads_total = 0
        self.num_retained = 0

    def bind(self, ctx: ConnectorContext) -> None:
        super().bind(ctx)
        ctx.pool.listeners.append(self._on_block_event)

    # -- prefetch ------------------------------------------------------------

    def request_added(self, req: Request) -> None:
        if self._prefetch is None:
            return
        try:
            hashes = self._prefetch_hashes(req)
        except Exception:
            log.exception("prefetch check failed", request_id=req.request_id)
            return
        if hashes:
            self._prefetching[req.request_id] = self._tasks.spawn(
                self._prefetch_then_wake(req.request_id, hashes), name=f"prefetch-{req.request_id}"
            )

    def _prefetch_hashes(self, req: Request) -> list[BlockHash]:
        """The blocks worth asking peers for: full prompt blocks past the device hits."""
        if not req.handoff.peer_fetch:
            return []
        # The last block is recomputed anyway (one token must be sampled).
        hashes = req.block_hashes[: (len(req.prompt_token_ids) - 1) // self.ctx.block_size]
        on_device = len(self.ctx.pool.longest_cached_prefix(hashes))
        rest = hashes[on_device:]
        if not rest or (self._prefetch_wanted is not None and not self._prefetch_wanted(rest)):
            return []
        return rest

    async def _prefetch_then_wake(self, request_id: str, hashes: list[BlockHash]) -> None:
        prefetch = self._prefetch
        try:
            if prefetch is not None:
                await asyncio.wait_for(prefetch(hashes), self._prefetch_timeout_s)
        except TimeoutError:
            log.info("prefetch timed out", request_id=request_id)
        except Exception:
            log.exception("prefetch failed", request_id=request_id)
        finally:
            self._prefetching.pop(request_id, None)
            self.ctx.wakeup()

    # -- lookup and load -------------------------------------------------------

    def lookup(self, req: Request, num_computed_tokens: int) -> KVHit | None:
        if req.request_id in self._prefetching:
            return None
        hashes = self._past_device(req, num_computed_tokens)
        if not hashes:
            return NO_HIT
        num_blocks = self.store.lookup(hashes, record_stats=False).num_blocks
        return KVHit(num_blocks * self.ctx.block_size)

    def num_held(self, hashes: Sequence[bytes]) -> int:
        return self.store.lookup(list(hashes), record_stats=False).num_blocks if hashes else 0

    def request_admitted(self, req: Request, hit: KVHit) -> None:
        # Counted here, once per admission, rather than on every pass the
        # request waits: the counters are over prompts' blocks past the
        # device hits, as the store is asked for them.
        hashes = self._past_device(req, req.num_computed_tokens)
        if hashes:
            self.store.lookup(hashes)

    def _past_device(self, req: Request, num_computed_tokens: int) -> list[BlockHash]:
        """The full blocks after the first ``num_computed_tokens`` tokens that a
        load could fill: all but the one holding the last token (at least one
        token must be computed to sample from)."""
        bs = self.ctx.block_size
        max_blocks = (req.num_tokens - 1) // bs
        first = num_computed_tokens // bs
        return req.block_hashes[first:max_blocks] if first < max_blocks else []

    async def load(self, req: Request, job: LoadJob) -> LoadResult:
        hashes = req.block_hashes[job.first_block : job.first_block + len(job.block_ids)]
        n = await self.store.load(hashes, DeviceBlocks(self.ctx.kv_caches, job.block_ids))
        return LoadResult(n * self.ctx.block_size)

    def request_finished(self, req: Request) -> None:
        task = self._prefetching.pop(req.request_id, None)
        if task is not None:
            task.cancel()
        retain = req.handoff.retain
        if retain is None or self._retain is None:
            return
        bs = self.ctx.block_size
        sink = req.handoff.sink
        job = RetainJob(
            req.request_id,
            tuple(req.block_hashes[: req.num_prompt_tokens // bs]),
            retain,
            req.prefill_node,
            sink.node_id if sink is not None else None,
        )
        if not job.hashes:
            return
        # The step that finished it may have cached blocks whose offload
        # after_step queues next: the job starts once they are queued.
        self._retain_next.append(job)
        if not self._to_offload:
            self._start_retains()

    def _start_retains(self) -> None:
        jobs, self._retain_next = self._retain_next, []
        for job in jobs:
            futs = {self._offloading[h] for h in job.hashes if h in self._offloading}
            if not futs:
                self._hand_over(job)
                continue
            self._tasks.spawn(self._retain_after(futs, job), name=f"retain-{job.request_id}")

    async def _retain_after(self, futs: set[asyncio.Future[int]], job: RetainJob) -> None:
        # A failed offload stored nothing: what did land is still kept.
        await asyncio.wait(futs)
        self._hand_over(job)

    def _hand_over(self, job: RetainJob) -> None:
        hook = self._retain
        if hook is None:
            return
        self.num_retained += 1
        try:
            hook(job)
        except Exception:
            # Keeping the KV is a favour: a failure costs the request nothing.
            log.exception("retain hook failed", request_id=job.request_id)

    # -- offload ---------------------------------------------------------------

    def _on_block_event(self, block_hash: BlockHash, stored: bool) -> None:
        if stored:
            self._to_offload.append(block_hash)

    def after_step(self, report: object) -> None:
        self._offload_cached()
        if self._retain_next:
            self._start_retains()

    def _offload_cached(self) -> None:
        if not self._to_offload:
            return
        hashes, self._to_offload = self._to_offload, []
        pool = self.ctx.pool
        cached = pool.cached_blocks
        pairs = [(h, cached[h]) for h in hashes if h in cached]
        if not pairs:
            return
        block_ids = [b for _, b in pairs]
        # The store reads the blocks after this returns: the pool keeps them
        # from anyone else until it has.
        key = pool.hold(block_ids)
        try:
            fut = self.store.offload(
                [h for h, _ in pairs], DeviceBlocks(self.ctx.kv_caches, block_ids)
            )
        except RuntimeError:  # the store is closing
            fut = None
        if fut is None:  # queue full: dropped, the blocks stay device-only
            pool.release(key)
            return
        self.num_offloads_total += 1
        offloaded = [h for h, _ in pairs]
        for h in offloaded:
            self._offloading[h] = fut
        fut.add_done_callback(lambda f, key=key: self._offload_done(key, f, offloaded))

    def _offload_done(self, key: int, fut: asyncio.Future[int], hashes: list[BlockHash]) -> None:
        for h in hashes:
            if self._offloading.get(h) is fut:
                del self._offloading[h]
        self.ctx.pool.release(key)
        self.ctx.wakeup()  # freed blocks may admit a waiting request

    def num_saves(self) -> int:
        return self.num_offloads_total

    async def close(self) -> None:
        self._tasks.cancel()
        await self._tasks.wait()
        if self._on_block_event in self.ctx.pool.listeners:
            self.ctx.pool.listeners.remove(self._on_block_event)
