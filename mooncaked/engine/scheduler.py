"""Local continuous batching: token budget, chunked prefill, preemption by recompute.

Each step the scheduler spends a token budget: first on the running requests
(one token per decode, or the next chunk of a prefill that did not fit in one
step), then on waiting requests in arrival order. A waiting request first takes
the longest cached prefix of its blocks from the pool, then as much of its
remaining prompt as the budget allows. When blocks run out, the most recently
admitted running request is preempted: its blocks are freed and it rejoins the
front of the waiting queue, to be recomputed (its cached blocks usually still
hit, so recompute is cheap).

With a KV connector (``mooncaked.engine.connector``), the tokens after the
device prefix hit are looked up outside the device too; a request with hits
there gets its blocks and moves to LOADING (a LoadJob in the plan) instead of
computing them, then joins the running set when the load is done, and
computes only its tail. A connector that does not know yet (a prefetch is in
flight) keeps the request waiting; others are admitted past it. What a load
says must become of its blocks (held for a writer outside, swapped for
fresh ones) the scheduler does through the pool.

With attention offloading, a request whose KV a memory node took over
(``kv_moved``) holds no blocks here: its decodes need none, it is never a
preemption victim (freeing nothing), and its blocks' worth of pool serves
other requests. If the memory node loses its KV (``kv_lost``), the request
is preempted by recompute like any other; one whose context no longer fits
this node's pool fails explicitly instead of waiting for ever.

The scheduler emits a StepPlan and takes sampled tokens back; it never touches
tensors. It does not decide when a request is finished (the output processor
does: it needs the text for stop strings); ``finish`` takes a request out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import structlog

from mooncaked.cache.hashing import BlockHash, block_hashes
from mooncaked.config import SchedulerConfig
from mooncaked.engine.connector import BlockHold, KVConnector, LoadResult
from mooncaked.engine.kv_pool import BlockPool
from mooncaked.engine.plan import LoadJob, SampledToken, ScheduledChunk, StepPlan, chunk_of
from mooncaked.request import FinishReason, Request, RequestState

log = structlog.get_logger(__name__)

# A request's prefill work: (tokens left to compute, tokens computed).
PrefillEntry = tuple[int, int]
# A request that decodes, or will once its KV is in: (context tokens, output
# tokens, most output tokens still allowed, when its placement expected the
# KV in on the engine's monotonic clock: 0 once decoding or when unknown).
DecodeEntry = tuple[int, int, int, float]


class QueueFullError(Exception):
    """The waiting queue is at its bound: the caller should retry later (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        *,
        block_size: int,
        max_model_len: int,
        model_id: str,
        connector: KVConnector | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.model_id = model_id
        self.connector = connector if connector is not None else KVConnector()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        # Leading blocks of each request already in the prefix index (hits, or
        # published by us).
        self._num_published: dict[str, int] = {}
        # Requests that cannot go on (``take_failed``).
        self._failed: list[tuple[Request, str]] = []
        # Requests whose KV lives on a memory node only (attention offloading).
        self.remote: set[str] = set()
        # Told the id of each request whose KV the memory node may forget
        # (finished, preempted): set by the engine when it offloads.
        self.on_remote_dropped: Callable[[str], None] | None = None
        # Counters for /metrics.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_preemptions = 0

    # -- admission -------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add_request(self, req: Request) -> None:
        """Queue a request; raises QueueFullError when the waiting queue is full."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"the waiting queue is full ({len(self.waiting)} requests); retry later",
                retry_after_s=self._retry_after_s(),
            )
        req.state = RequestState.WAITING
        self.requests[req.request_id] = req
        self._num_published[req.request_id] = 0
        self._hashes(req, req.num_tokens // self.block_size)
        self.waiting.append(req)
        self.connector.request_added(req)

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
        self.pool.free(req.block_ids)
        req.block_ids = []
        self._drop_remote(req)
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        del self._num_published[req.request_id]
        self.connector.request_finished(req)

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
            num_new = self._num_new(req, budget)
            if num_new <= 0:
                if req.handoff.stage is None:
                    raise RuntimeError(f"running request {req.request_id} has nothing to compute")
                # A pipeline stage whose next input has not arrived yet.
                i += 1
                continue
            if req.request_id not in self.remote and not self._grow(req, num_new, plan, scheduled):
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
            load = self._admit(req, budget)
            if load is None:
                continue  # the connector does not know yet: admit others past it
            if load is False:
                break  # first come, first served among the ready ones
            admitted.append(req)
            if isinstance(load, LoadJob):
                req.state = RequestState.LOADING
                self.loading[req.request_id] = req
                plan.loads.append(load)
                continue
            req.state = RequestState.RUNNING
            self.running.append(req)
            num_new = self._num_new(req, budget)
            if num_new <= 0:
                continue  # a pipeline stage admitted before its input arrives
            plan.chunks.append(self._chunk(req, num_new))
            scheduled.add(req.request_id)
            budget -= num_new
        for req in admitted:
            self.waiting.remove(req)
        return plan

    def _num_new(self, req: Request, budget: int) -> int:
        """Tokens of ``req`` to compute this step, within ``budget``.

        A stage of a pipelined prefill group computes no further than its
        input has arrived (``ready_tokens``), and the head no further than
        its planned chunk; a stage that could not start exactly where the
        group agreed (its cached prefix went meanwhile) fails (``take_failed``).
        """
        computed = req.num_computed_tokens
        num_new = min(req.num_tokens - computed, budget)
        stage = req.handoff.stage
        if stage is None:
            return num_new
        if computed < stage.start:
            self._fail(
                req,
                f"this stage holds {computed} of the {stage.start} prompt tokens its "
                "group agreed to start from (evicted meanwhile)",
            )
            return 0
        if req.ready_tokens is not None:
            num_new = min(num_new, req.ready_tokens - computed)
        end = stage.chunk_end(computed)
        if end is not None:
            num_new = min(num_new, end - computed)
        return num_new

    def _fail(self, req: Request, why: str) -> None:
        if all(r is not req for r, _ in self._failed):
            self._failed.append((req, why))

    def take_failed(self) -> list[tuple[Request, str]]:
        """Requests that cannot go on, and why; the caller finishes them."""
        failed, self._failed = self._failed, []
        return failed

    def _chunk(self, req: Request, num_new: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        end = start + num_new
        chunk = chunk_of(
            req, req.token_slice(start, end), start, req.block_ids, end == req.num_tokens
        )
        chunk.kv_remote = req.request_id in self.remote
        return chunk

    def _blocks_needed(self, req: Request, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) - len(req.block_ids)

    def _grow(self, req: Request, num_new: int, plan: StepPlan, scheduled: set[str]) -> bool:
        """Give a running request blocks for ``num_new`` more tokens, preempting if short."""
        need = self._blocks_needed(req, req.num_computed_tokens + num_new)
        while need > 0 and not self.pool.can_allocate(need):
            # The latest admitted that holds blocks (one whose KV is on a
            # memory node would free none); ``req`` itself at worst.
            victim = next(
                r for r in reversed(self.running) if r is req or r.request_id not in self.remote
            )
            if victim.request_id in scheduled:
                raise RuntimeError("preemption victim was already scheduled this step")
            self._preempt(victim)
            plan.preempted.append(victim.request_id)
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
        self._drop_remote(req)
        req.num_computed_tokens = 0
        req.state = RequestState.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._num_published[req.request_id] = 0
        self.waiting.appendleft(req)

    def _admit(self, req: Request, budget: int) -> LoadJob | bool | None:
        """Reuse cached blocks and allocate the first chunk's blocks.

        False: the pool is short, the request waits. None: the connector does
        not know yet what it can bring; the request waits. True: admitted, its
        first chunk runs this step. A LoadJob: admitted, its tokens from
        outside the device are to be loaded first.
        """
        tokens_len = req.num_tokens
        hashes = self._hashes(req, tokens_len // self.block_size)
        hit_ids = self.pool.longest_cached_prefix(hashes)
        # At least one token must be computed to sample from: when the whole
        # sequence is cached, recompute its last block rather than write into
        # a shared one.
        hit_ids = hit_ids[: (tokens_len - 1) // self.block_size]
        stage = req.handoff.stage
        if stage is not None:
            # Every stage of a pipelined group computes from the prefix they
            # all hold, even where this one holds more.
            hit_ids = hit_ids[: stage.start // self.block_size]
        num_hit_tokens = len(hit_ids) * self.block_size
        hit = self.connector.lookup(req, num_hit_tokens)
        if hit is None:
            return None
        limit = tokens_len if stage is None else stage.start
        num_ext = max(0, min(hit.num_tokens, limit - num_hit_tokens))
        if num_ext:
            # Blocks for the loaded tokens only; the tail is allocated when
            # the request runs, like a later prefill chunk.
            need = -(-(num_hit_tokens + num_ext) // self.block_size) - len(hit_ids)
        else:
            num_new = min(tokens_len - num_hit_tokens, budget)
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
        self._num_published[req.request_id] = len(hit_ids)
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_hit_tokens
            self.prefix_queried_tokens += tokens_len
            self.prefix_hit_tokens += num_hit_tokens
        self.connector.request_admitted(req, hit)
        if not num_ext:
            return True
        return LoadJob(
            request_id=req.request_id,
            first_block=len(hit_ids),
            block_ids=list(new_ids),
            num_tokens=num_ext,
            source=hit.source,
            cancellable=hit.cancellable,
        )

    def finish_load(self, req: Request, result: LoadResult) -> bool:
        """A load ended with ``result.num_tokens`` tokens in place; run the rest.

        True when the load also sampled the request's next token (a remote
        prefill): it is appended, and the caller processes it like a step's.
        """
        if req.state is not RequestState.LOADING:
            raise RuntimeError(f"request {req.request_id} is not loading")
        del self.loading[req.request_id]
        if result.hold is not None:
            self._hold(req, result.hold)
        room = req.num_tokens - req.num_computed_tokens
        if result.kv_remote and (result.num_tokens != room or result.sampled is None):
            raise RuntimeError(
                f"request {req.request_id}: KV on a memory node must be the whole "
                f"prompt and a sampled token ({result.num_tokens} of {room} tokens)"
            )
        num_tokens = max(0, min(result.num_tokens, room))
        sampled = result.sampled if num_tokens == room else None
        if sampled is None and num_tokens == room:
            # One token must be left to compute, to sample from.
            num_tokens = room - 1
        req.num_computed_tokens += num_tokens
        if result.prefill_node is not None:
            req.prefill_node = result.prefill_node
        if req.num_preemptions == 0:
            if result.num_cached_tokens is not None:
                # Computed elsewhere: what counts is what that node reused.
                req.num_cached_tokens = max(0, min(result.num_cached_tokens, req.num_prompt_tokens))
            else:
                req.num_cached_tokens += num_tokens
                self.prefix_hit_tokens += num_tokens
        # Blocks past the loaded ones stay allocated: the tail is computed
        # into them like any prefill chunk, so the request simply runs.
        req.state = RequestState.RUNNING
        if result.kv_remote and sampled is not None:
            # Its KV is on its memory node only: it decodes from there.
            self.pool.free(req.block_ids)
            req.block_ids = []
            self.remote.add(req.request_id)
        self.running.append(req)
        if sampled is None:
            return False
        self._append(req, sampled)
        return True

    def _hold(self, req: Request, hold: BlockHold) -> None:
        """Keep ``hold``'s blocks from anyone else until its deadline; with
        ``swap``, give the request fresh blocks in their place."""
        held = list(hold.block_ids)
        self.pool.hold(held, until=hold.until)
        if not hold.swap:
            return
        fresh = self.pool.allocate(len(held))
        if fresh is None:
            # Short of blocks: the request computes into the held ones.
            log.warning("no blocks to swap a failed load's for", request_id=req.request_id)
            return
        swap = dict(zip(held, fresh, strict=True))
        req.block_ids = [swap.get(b, b) for b in req.block_ids]
        # The request's references end; the hold's stay until the deadline.
        self.pool.free(held)

    def _hashes(self, req: Request, num_full: int) -> list[BlockHash]:
        """The request's first ``num_full`` block hashes, extending ``req.block_hashes``."""
        have = len(req.block_hashes)
        if num_full > have and req.handoff.stage is not None:
            # A stage's blocks are keyed by its layers' hashes, derived from the
            # prompt's whole at entry; its requests never grow past the prompt.
            raise RuntimeError(f"stage request {req.request_id} grew past its prompt's hashes")
        if num_full > have:
            req.block_hashes.extend(
                block_hashes(
                    req.token_slice(0, num_full * self.block_size),
                    self.block_size,
                    self.model_id,
                    parent=req.block_hashes[-1] if have else None,
                    start_block=have,
                )
            )
        return req.block_hashes[:num_full]

    # -- results ---------------------------------------------------------

    def update(
        self,
        plan: StepPlan,
        results: Sequence[SampledToken | None],
        *,
        kv_moved: Sequence[str] = (),
        kv_lost: Sequence[str] = (),
    ) -> list[Request]:
        """Apply a step's sampled tokens; returns the requests that got a token.

        A request aborted while the step ran is skipped, and so is one whose
        KV the step lost (``kv_lost``: preempted first). Whether a token ends
        its request is for the caller (the output processor) to say.
        """
        if len(results) != len(plan.chunks):
            raise RuntimeError(f"{len(results)} results for {len(plan.chunks)} chunks")
        self._kv_lost(kv_lost)
        # Before publishing: the step wrote a moved request's new KV on the
        # memory node only, so no block of it here may enter the prefix index.
        self._kv_moved(kv_moved)
        out: list[Request] = []
        for chunk, result in zip(plan.chunks, results, strict=True):
            req = self.requests.get(chunk.request_id)
            if req is None or req.state is not RequestState.RUNNING:
                continue
            req.num_computed_tokens += chunk.num_tokens
            self._publish_full_blocks(req)
            if result is None:
                continue
            self._append(req, result)
            out.append(req)
        return out

    def _append(self, req: Request, token: SampledToken) -> None:
        req.output_token_ids.append(token.token_id)
        if token.logprob is not None:
            req.output_logprobs.append(token.logprob)

    # -- attention offloading -------------------------------------------

    def _kv_moved(self, request_ids: Sequence[str]) -> None:
        """A memory node holds these requests' KV now: their blocks go back
        to the pool (what they published stays cached for prefix hits)."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if rid in self.remote:
                continue
            if req is None or req.state is not RequestState.RUNNING:
                # Gone while the step ran (aborted): the memory node forgets it.
                if self.on_remote_dropped is not None:
                    self.on_remote_dropped(rid)
                continue
            self.pool.free(req.block_ids)
            req.block_ids = []
            self.remote.add(rid)

    def _kv_lost(self, request_ids: Sequence[str]) -> None:
        """The memory node lost these requests' KV: recompute them here (or on
        it again, once it is back); a context this pool cannot hold fails."""
        lost = set(request_ids)
        # From the newest: each goes to the queue's front, so they keep their order.
        for req in [r for r in reversed(self.running) if r.request_id in lost]:
            self._preempt(req)
            if -(-(req.num_tokens + 1) // self.block_size) > self.pool.num_blocks:
                self._fail(
                    req,
                    f"the memory node holding its KV failed, and its {req.num_tokens} tokens "
                    f"need more KV blocks than this node has ({self.pool.num_blocks})",
                )

    def _drop_remote(self, req: Request) -> None:
        if req.request_id in self.remote:
            self.remote.discard(req.request_id)
            if self.on_remote_dropped is not None:
                self.on_remote_dropped(req.request_id)

    def _publish_full_blocks(self, req: Request) -> None:
        if req.request_id in self.remote:
            return
        num_published = self._num_published[req.request_id]
        num_full = req.num_computed_tokens // self.block_size
        if num_full <= num_published:
            return
        hashes = self._hashes(req, num_full)
        size = self.block_size
        # A stage's blocks hold its own layers only: cached for its group,
        # never told outside as whole blocks.
        whole = req.handoff.stage is None
        self.pool.cache_blocks(
            req.block_ids[num_published:num_full],
            hashes[num_published:num_full],
            parent=hashes[num_published - 1] if num_published else None,
            token_ids=req.token_slice(num_published * size, num_full * size) if whole else None,
        )
        self._num_published[req.request_id] = num_full

    def load(self) -> tuple[int, int]:
        """(prompt tokens still to compute, requests decoding).

        Waiting requests count every token not yet computed (a preempted one
        recomputes its output too); a running request counts as decoding once
        it has sampled a token and has only that token left to compute, else
        as prefilling with what it has left. Requests loading KV from outside
        are not counted: their tail is unknown until the load ends.
        """
        queued = 0
        decode = 0
        for req in self.waiting:
            queued += req.num_tokens - req.num_computed_tokens
        for req in self.running:
            left = req.num_tokens - req.num_computed_tokens
            if left <= 1 and req.output_token_ids:
                decode += 1
            else:
                queued += left
        return queued, decode

    def work(self) -> tuple[list[PrefillEntry], list[DecodeEntry]]:
        """Plain data a cost forecast needs, split as ``load`` splits it.

        Prompts still to compute, in queue order; and requests that decode,
        or will once the KV they wait for is in (a decode node's handoffs).
        A waiting handoff's entry carries when its placement expected the KV
        in (``Handoff.kv_ready_at``); every other entry 0.
        """
        prefill: list[PrefillEntry] = []
        decode: list[DecodeEntry] = []

        def decoding(req: Request, ready_at: float = 0.0) -> DecodeEntry:
            out = req.handoff.output_offset + len(req.output_token_ids)
            more = max(1, req.sampling.max_tokens - len(req.output_token_ids))
            return (req.num_tokens, out, more, ready_at)

        for req in self.running:
            left = req.num_tokens - req.num_computed_tokens
            if left <= 1 and req.output_token_ids:
                decode.append(decoding(req))
            else:
                prefill.append((left, req.num_computed_tokens))
        for req in self.loading.values():
            decode.append(decoding(req))
        for req in self.waiting:
            if req.handoff.source is not None and not req.num_computed_tokens:
                decode.append(decoding(req, req.handoff.kv_ready_at))
            else:
                prefill.append((req.num_tokens - req.num_computed_tokens, req.num_computed_tokens))
        return prefill, decode

    def block_tables(self) -> list[list[int]]:
        """Every live block table, for ``BlockPool.check_integrity``."""
        return [r.block_ids for r in self.requests.values() if r.block_ids]
