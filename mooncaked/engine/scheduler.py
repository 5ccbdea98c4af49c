"""Local continuous batching: token budget, chunked prefill, preemption by recompute.

Each step the scheduler spends a token budget: first on the running requests
(one token per decode, or the next chunk of a prefill that did not fit in one
step), then on waiting requests in arrival order. A waiting request first takes
the longest cached prefix of its blocks from the pool, then as much of its
remaining prompt as the budget allows. When blocks run out, the most recently
admitted running request is preempted: its blocks are freed and it rejoins the
front of the waiting queue, to be recomputed (its cached blocks usually still
hit, so recompute is cheap).

With a host cache attached (``external``), the blocks after the device
prefix hit are looked up there too; a request with host hits gets its blocks
and moves to LOADING (a LoadJob in the plan) instead of computing them, then
joins the running set when the load is done, and computes only its tail.

The scheduler emits a StepPlan and takes sampled tokens back; it never touches
tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mooncaked.cache.hashing import BlockHash, block_hashes
from mooncaked.config import SchedulerConfig
from mooncaked.engine.kv_pool import BlockPool
from mooncaked.engine.plan import LoadJob, SampledToken, ScheduledChunk, StepPlan
from mooncaked.request import FinishReason, Request, RequestState

# How many leading blocks of these hashes the host tiers hold.
ExternalLookup = Callable[[Sequence[BlockHash]], int]


class QueueFullError(Exception):
    """The waiting queue is at its bound: the caller should retry later (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class _Tracking:
    """Scheduler-private bookkeeping per request."""

    # Hashes of the request's full blocks so far (prompt and output tokens).
    hashes: list[BlockHash]
    # Leading blocks already in the prefix index (hits, or published by us).
    num_published: int = 0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        *,
        block_size: int,
        max_model_len: int,
        model_id: str,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.config = config
        self.pool = pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.model_id = model_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        # Waiting requests not to be admitted yet (their prefix is being fetched).
        self._held: set[str] = set()
        self.external: ExternalLookup | None = None
        self._tracking: dict[str, _Tracking] = {}
        # Counters for /metrics.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_preemptions = 0

    # -- admission -------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add_request(self, req: Request, *, ready: bool = True) -> None:
        """Queue a request; ``ready=False`` holds it back until ``release``."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"the waiting queue is full ({len(self.waiting)} requests); retry later",
                retry_after_s=self._retry_after_s(),
            )
        req.state = RequestState.WAITING
        self.requests[req.request_id] = req
        self._tracking[req.request_id] = _Tracking(hashes=[])
        self.waiting.append(req)
        if not ready:
            self._held.add(req.request_id)

    def release(self, req: Request) -> None:
        """A held request may now be admitted."""
        self._held.discard(req.request_id)

    def block_hashes(self, req: Request) -> list[BlockHash]:
        """Hashes of every full block of the request's tokens so far."""
        track = self._tracking[req.request_id]
        return list(self._hashes(req, track, req.num_tokens // self.block_size))

    def _retry_after_s(self) -> float:
        # Crude but monotone in the backlog: about one second per full batch queued.
        return max(1.0, len(self.waiting) / max(1, self.config.max_num_seqs))

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Take a request out of the engine and free its blocks; idempotent."""
        if req.state is RequestState.FINISHED:
            return
        if req.state is RequestState.LOADING:
            # The blocks are being written by the load; the caller waits for it.
            raise RuntimeError(f"request {req.request_id} finished while its load runs")
        if req.state is RequestState.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._held.discard(req.request_id)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        del self._tracking[req.request_id]

    # -- one step --------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()

        # Running requests first, oldest first: a decode token each, or the
        # next chunk of a prefill.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                raise RuntimeError(f"running request {req.request_id} has nothing to compute")
            if not self._grow(req, num_new, plan, scheduled):
                # The request itself was preempted; nothing after it remains
                # either (preemption takes from the end).
                break
            plan.chunks.append(self._chunk(req, num_new))
            scheduled.add(req.request_id)
            budget -= num_new
            i += 1

        # Waiting requests only when nobody was preempted: a preempted request
        # goes first next step, ahead of new arrivals.
        if plan.preempted:
            return plan
        admitted: list[Request] = []
        for req in self.waiting:
            if budget <= 0 or len(self.running) + len(self.loading) >= self.config.max_num_seqs:
                break
            if req.request_id in self._held:
                continue
            load = self._admit(req, budget)
            if load is False:
                break  # first come, first served among the ready ones
            admitted.append(req)
            if load is not None:
                req.state = RequestState.LOADING
                self.loading[req.request_id] = req
                plan.loads.append(load)
                continue
            req.state = RequestState.RUNNING
            self.running.append(req)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            plan.chunks.append(self._chunk(req, num_new))
            scheduled.add(req.request_id)
            budget -= num_new
        for req in admitted:
            self.waiting.remove(req)
        return plan

    def _chunk(self, req: Request, num_new: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        end = start + num_new
        return ScheduledChunk(
            request=req,
            token_ids=req.token_slice(start, end),
            start_pos=start,
            block_ids=list(req.block_ids),
            sample=end == req.num_tokens,
        )

    def _blocks_needed(self, req: Request, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) - len(req.block_ids)

    def _grow(self, req: Request, num_new: int, plan: StepPlan, scheduled: set[str]) -> bool:
        """Give a running request blocks for ``num_new`` more tokens, preempting if short."""
        need = self._blocks_needed(req, req.num_computed_tokens + num_new)
        while need > 0 and not self.pool.can_allocate(need):
            victim = self.running[-1]
            if victim.request_id in scheduled:
                raise RuntimeError("preemption victim was already scheduled this step")
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is req:
                return False
        if need > 0:
            new_ids = self.pool.allocate(need)
            if new_ids is None:
                raise RuntimeError("pool refused an allocation it said it could serve")
            req.block_ids.extend(new_ids)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.state = RequestState.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._tracking[req.request_id].num_published = 0
        self.waiting.appendleft(req)

    def _admit(self, req: Request, budget: int) -> LoadJob | bool | None:
        """Reuse cached blocks and allocate the first chunk's blocks.

        False: the pool is short, the request waits. None: admitted, its
        first chunk runs this step. A LoadJob: admitted, its host-cached
        blocks are to be loaded first.
        """
        track = self._tracking[req.request_id]
        tokens = req.all_token_ids
        hashes = self._hashes(req, track, len(tokens) // self.block_size)
        hit_ids = self.pool.longest_cached_prefix(hashes)
        # At least one token must be computed to sample from: when the whole
        # sequence is cached, recompute its last block rather than write into
        # a shared one.
        max_hits = (len(tokens) - 1) // self.block_size
        hit_ids = hit_ids[:max_hits]
        num_ext = 0
        if self.external is not None and len(hit_ids) < max_hits:
            num_ext = min(self.external(hashes[len(hit_ids) : max_hits]), max_hits - len(hit_ids))
        num_hit_tokens = len(hit_ids) * self.block_size
        if num_ext:
            # Blocks for the loaded prefix only; the tail is allocated when
            # the request runs, like a later prefill chunk.
            need = num_ext
        else:
            num_new = min(len(tokens) - num_hit_tokens, budget)
            need = -(-(num_hit_tokens + num_new) // self.block_size) - len(hit_ids)
        # Hits that sit on the free queue stop being free once touched.
        num_free_hits = sum(1 for b in hit_ids if self.pool.blocks[b].ref_cnt == 0)
        if need > self.pool.num_free_blocks - num_free_hits:
            return False
        self.pool.touch(hit_ids)
        new_ids = self.pool.allocate(need)
        if new_ids is None:
            raise RuntimeError("pool refused an allocation it said it could serve")
        req.block_ids = hit_ids + new_ids
        req.num_computed_tokens = num_hit_tokens
        track.num_published = len(hit_ids)
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_hit_tokens
            self.prefix_queried_tokens += len(tokens)
            self.prefix_hit_tokens += num_hit_tokens
        if not num_ext:
            return None
        first = len(hit_ids)
        return LoadJob(req, list(hashes[first : first + num_ext]), list(new_ids))

    def finish_load(self, req: Request, num_loaded: int) -> None:
        """A load ended with its first ``num_loaded`` blocks in place; run the rest."""
        if req.state is not RequestState.LOADING:
            raise RuntimeError(f"request {req.request_id} is not loading")
        del self.loading[req.request_id]
        req.num_computed_tokens += num_loaded * self.block_size
        if req.num_preemptions == 0:
            req.num_cached_tokens += num_loaded * self.block_size
            self.prefix_hit_tokens += num_loaded * self.block_size
        # Blocks past the loaded ones stay allocated: the tail is computed
        # into them like any prefill chunk, so the request simply runs.
        req.state = RequestState.RUNNING
        self.running.append(req)

    def _hashes(self, req: Request, track: _Tracking, num_full: int) -> list[BlockHash]:
        """The request's first ``num_full`` block hashes, extending the memo as needed."""
        have = len(track.hashes)
        if num_full > have:
            tokens = req.token_slice(0, num_full * self.block_size)
            track.hashes.extend(
                block_hashes(
                    tokens,
                    self.block_size,
                    self.model_id,
                    parent=track.hashes[-1] if have else None,
                    start_block=have,
                )
            )
        return track.hashes[:num_full]

    # -- results ---------------------------------------------------------

    def update(self, plan: StepPlan, results: Sequence[SampledToken | None]) -> list[Request]:
        """Apply a step's sampled tokens; returns the requests that got a token.

        Requests finished by EOS, a stop token or a length limit are finished
        here (their state is FINISHED on return). A request aborted while the
        step ran is skipped.
        """
        if len(results) != len(plan.chunks):
            raise RuntimeError(f"{len(results)} results for {len(plan.chunks)} chunks")
        out: list[Request] = []
        for chunk, result in zip(plan.chunks, results, strict=True):
            req = chunk.request
            if req.state is not RequestState.RUNNING:
                continue
            req.num_computed_tokens += chunk.num_tokens
            self._publish_full_blocks(req)
            if result is None:
                continue
            req.output_token_ids.append(result.token_id)
            if result.logprob is not None:
                req.output_logprobs.append(result.logprob)
            out.append(req)
            reason = self._stop_reason(req, result.token_id)
            if reason is not None:
                self.finish(req, reason)
        return out

    def _publish_full_blocks(self, req: Request) -> None:
        track = self._tracking[req.request_id]
        num_full = req.num_computed_tokens // self.block_size
        if num_full <= track.num_published:
            return
        hashes = self._hashes(req, track, num_full)
        for i in range(track.num_published, num_full):
            self.pool.cache_block(req.block_ids[i], hashes[i])
        track.num_published = num_full

    def _stop_reason(self, req: Request, token_id: int) -> FinishReason | None:
        sp = req.sampling
        if not sp.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if token_id in sp.stop_token_ids:
            return FinishReason.STOP
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def block_tables(self) -> list[list[int]]:
        """Every live block table, for ``BlockPool.check_integrity``."""
        return [r.block_ids for r in self.requests.values() if r.block_ids]
