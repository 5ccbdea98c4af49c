"""EngineCore: the step loop. schedule -> run (worker thread) -> postprocess.

The event loop owns every piece of scheduler state; only ``ModelRunner.execute``
runs in the worker thread, on a plan that is plain data. Aborts that arrive
while a step runs are queued and applied between steps, so a block is never
freed (and handed to another request) while the forward pass still writes it.

Three collaborators do the rest: the ``Scheduler`` (what runs this step), the
``OutputProcessor`` (text, stop strings, when a request is finished, the
per-request streams) and the ``KVConnector`` (KV from and to outside the
device: host tiers, peers, a remote prefill). The connector is given when
the engine starts, because what it serves from (the host tiers) is built
over the engine's own KV cache; the scheduler is built with it then.

Once per scheduling pass the engine publishes an ``EngineSnapshot`` (its
load, the scheduler's work, its model's facts): what gossip and the cost
model read, instead of the scheduler or the runner. Timed holds on blocks
(a writer outside may still write them) are the pool's; the loop releases
them as its clock passes their deadlines.

The step loop is owned: if it dies (a broken invariant, a detokenizer error),
every request in flight ends with an explicit error, new requests are refused
with ``EngineFailedError`` and ``on_fatal`` tells the daemon, which turns
/ready to 503 and exits non-zero so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import structlog
import torch

from mooncaked.cache.hashing import BlockHash, block_hashes, layer_hashes
from mooncaked.config import Config
from mooncaked.engine.connector import ConnectorContext, KVConnector, LoadResult
from mooncaked.engine.introspect import EngineStats, engine_stats, requests_in_flight
from mooncaked.engine.kv_pool import BlockPool
from mooncaked.engine.loader import LoadedModel, load_model
from mooncaked.engine.offload import attach_offload
from mooncaked.engine.output import OutputProcessor, RequestStream
from mooncaked.engine.pipeline import ChunkRefused, StagePipe
from mooncaked.engine.plan import LoadJob, StepOutput, StepPlan
from mooncaked.engine.runner import KVAllocator, ModelRunner, num_blocks_for_bytes
from mooncaked.engine.scheduler import QueueFullError, Scheduler
from mooncaked.engine.snapshot import EngineLoad, EngineSnapshot, model_facts
from mooncaked.handoff import NO_HANDOFF, Handoff, StageJob
from mooncaked.process import (
    compute_threads,
    enter_compute_thread,
)
from mooncaked.request import FinishReason, KVSent, Request, RequestState, SamplingParams
from mooncaked.tasks import TaskSet

__all__ = [
    "EngineClosedError",
    "EngineCore",
    "EngineFailedError",
    "EngineLoad",
    "EngineSnapshot",
    "EngineStats",
    "PromptTooLongError",
    "QueueFullError",
    "RequestStream",
]

log = structlog.get_logger(__name__)

FatalHandler = Callable[[BaseException], None]


class PromptTooLongError(ValueError):
    """The prompt plus the tokens asked for do not fit the model's context."""


class EngineClosedError(RuntimeError):
    """A request reached an engine that is not running."""


class EngineFailedError(EngineClosedError):
    """A request reached an engine whose step loop died."""


class EngineCore:
    def __init__(
        self,
        config: Config,
        loaded: LoadedModel | None = None,
        *,
        kv_allocator: KVAllocator | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``kv_allocator``: where the KV cache lives (see ``ModelRunner``).
        ``clock``: monotonic seconds, what the pool's timed holds are on."""
        self.config = config
        self.loaded = (
            loaded
            if loaded is not None
            else load_model(
                config.model, decodes=config.node.role != "prefill", pipeline=config.pipeline
            )
        )
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.served_name
        self.model_id = self.loaded.model_id
        self.max_model_len = self.loaded.max_model_len
        self.block_size = config.kv.block_size
        # The model's layers this node holds: all, or a pipeline stage's.
        self.span = self.loaded.model.span
        self._clock = clock
        self.pool, self.runner = self._build_kv(kv_allocator)
        # Attention offloading (None: attention here); the runner calls it.
        self.offload = attach_offload(config, self.runner)
        # Both built by start(): the connector is given then.
        self.connector: KVConnector = KVConnector()
        # A stage of a pipelined prefill group: its activations in and out.
        self.pipe: StagePipe | None = None
        self._scheduler: Scheduler | None = None
        self.outputs = OutputProcessor(
            self.tokenizer,
            eos_token_ids=self.tokenizer.eos_token_ids,
            max_model_len=self.max_model_len,
            kv_sent=self._kv_sent,
        )
        self.model_facts = model_facts(config, self.runner, self.pool.num_blocks)
        self.snapshot = EngineSnapshot(self.model_facts)
        # Called with every step's plan and its seconds (cost models learn
        # from them), and with every finished request. A step's seconds are
        # the time from its start to the next step's start while the engine
        # stays busy (what a request waiting on steps sees: the forward pass
        # plus scheduling, outputs and the event loop's other work), or to
        # its own end before an idle wait.
        self.step_listeners: list[Callable[[StepPlan, float], None]] = []
        self.finish_listeners: list[Callable[[Request], None]] = []
        # The last step run: (its plan, its start, its end), until reported.
        self._last_step: tuple[StepPlan, float, float] | None = None
        self._pending_aborts: set[str] = set()
        self._wakeup = asyncio.Event()
        # One thread: forward passes are serialized, and it alone owns an
        # OpenMP team of intra-op threads (mooncaked/process.py says why).
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="mooncaked-step", initializer=enter_compute_thread
        )
        self._tasks = TaskSet("engine", on_failure=self._loop_failed)
        self._loop_task: asyncio.Task[None] | None = None
        self._load_tasks = TaskSet("engine-loads")
        # Loads in flight, by request: an abort cancels one its job says may be.
        self._loads: dict[str, tuple[LoadJob, asyncio.Task[None]]] = {}
        self._on_fatal: FatalHandler | None = None
        # The step thread's team, as tune_process set it (None: untuned).
        self.cpu_threads: int | None = compute_threads()
        self.failure: BaseException | None = None
        self._closing = False
        self._closed = False
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_loads_total = 0
        self._checked_at_step = 0
        self.num_checks = 0
        self.num_integrity_failures = 0

    def _build_kv(self, kv_allocator: KVAllocator | None) -> tuple[BlockPool, ModelRunner]:
        """The block pool and the runner over a KV cache of as many blocks."""
        config, kv, loaded = self.config, self.config.kv, self.loaded
        model = config.model
        backend = ModelRunner.select_backend(
            model.attention_backend, loaded, kv.block_size, model.vllm_cpu_library
        )
        # A backend with a copy of the cache in its own layout gets its share.
        budget = self._kv_budget_bytes() // backend.kv_copies
        num_blocks = kv.num_blocks or num_blocks_for_bytes(
            loaded.arch, kv.block_size, loaded.dtype, budget, loaded.model.span.count
        )
        if num_blocks <= 0:
            raise ValueError("the KV memory budget is too small for one KV block (see [kv])")
        pool = BlockPool(num_blocks, enable_prefix_caching=kv.enable_prefix_caching)
        runner = ModelRunner(
            self.loaded,
            num_blocks,
            kv.block_size,
            backend=backend,
            kv_allocator=kv_allocator,
            cuda_graphs=config.model.cuda_graphs,
            max_graph_batch=config.scheduler.max_num_seqs,
            decodes=config.node.role != "prefill",
        )
        runner.backend.track(pool.generations)
        return pool, runner

    def _kv_budget_bytes(self) -> int:
        kv = self.config.kv
        device = self.loaded.device
        if device.type != "cuda":
            return kv.memory_bytes
        # Weights are loaded already: what the fraction of the card leaves
        # beyond what is in use now goes to KV blocks.
        free, total = torch.cuda.mem_get_info(device)
        return int(total * kv.gpu_memory_fraction) - (total - free)

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler; built by ``start()``."""
        if self._scheduler is None:
            raise EngineClosedError("the engine has not started")
        return self._scheduler

    def reset_prefix_cache(self) -> int:
        """Forget every device block not in use; how many were dropped."""
        return self.pool.reset_prefix_cache()

    # -- lifecycle -----------------------------------------------------------

    async def start(
        self,
        on_fatal: FatalHandler | None = None,
        *,
        connector: KVConnector | None = None,
        pipe: StagePipe | None = None,
    ) -> None:
        """Start the step loop; ``on_fatal`` hears of its death (the daemon
        exits). ``connector``: the KV from and to outside the device (none
        by default); the engine binds it to its pool and KV cache. ``pipe``:
        a pipeline stage's activations (its input rows bound to the runner)."""
        if self._loop_task is not None or self._scheduler is not None:
            raise RuntimeError("engine already started")
        if (pipe is None) != self.span.whole:
            raise ValueError(
                f"layers {self.span.lo}..{self.span.hi} of {self.span.num_layers}: "
                + ("a pipeline stage needs its activations" if pipe is None else "not a stage")
            )
        if pipe is not None:
            self.pipe = pipe
            self.runner.act_in = pipe.act_in
        self._on_fatal = on_fatal
        if connector is not None:
            connector.bind(
                ConnectorContext(
                    pool=self.pool,
                    kv_caches=self.runner.kv_caches,
                    block_size=self.block_size,
                    wakeup=self._wakeup.set,
                    clock=self._clock,
                )
            )
            self.connector = connector
        self._scheduler = Scheduler(
            self.config.scheduler,
            self.pool,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            model_id=self.model_id,
            connector=self.connector,
        )
        if self.offload is not None:
            self._scheduler.on_remote_dropped = self.offload.dropped
        self._loop_task = self._tasks.spawn(self._run_loop(), name="engine-step-loop")
        log.info(
            "engine started",
            model=self.model_name,
            num_blocks=self.pool.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            device=str(self.loaded.device),
            attention=self.runner.backend.name,
            cuda_graphs=self.runner.graphs.sizes
            if self.runner.graphs is not None
            else self.runner.graphs_off_reason,
        )

    @contextlib.asynccontextmanager
    async def serving(
        self,
        on_fatal: FatalHandler | None = None,
        *,
        connector: KVConnector | None = None,
        pipe: StagePipe | None = None,
    ) -> AsyncIterator[EngineCore]:
        """The engine as a node's subsystem: started on entry, closed on exit."""
        await self.start(on_fatal, connector=connector, pipe=pipe)
        try:
            yield self
        finally:
            await self.close()

    async def close(self) -> None:
        """Abort everything in flight and stop the step loop; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closing = True
        self._pending_aborts.update(self.outputs.request_ids())
        self._wakeup.set()
        await self._tasks.wait()
        self._loop_task = None
        # Loads write device blocks: let them end before their requests go.
        await self._load_tasks.wait()
        await self.connector.close()
        if self.pipe is not None:
            await self.pipe.close()
        # Requests never scheduled by a loop that is gone still get their end.
        if self.failure is None and self._scheduler is not None:
            self._apply_aborts()
        # Nothing reuses the blocks any more: no writer outside can matter.
        self.pool.release_expired(math.inf)
        self._executor.shutdown(wait=True)
        if self.offload is not None:
            self.offload.close()

    def _loop_failed(self, exc: BaseException) -> None:
        """The step loop died (its traceback is logged by the task owner)."""
        self.failure = exc
        n = self.outputs.finish_all(FinishReason.ABORT, error=f"the engine failed: {exc!r}")
        log.error("engine step loop died; requests in flight failed", num_requests=n)
        if self._on_fatal is not None:
            self._on_fatal(exc)

    def _kv_sent(self, req: Request) -> KVSent | None:
        return self.connector.kv_sent(req)

    # -- requests --------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self.outputs)

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        *,
        prompt_hashes: Sequence[BlockHash] | None = None,
        handoff: Handoff = NO_HANDOFF,
    ) -> RequestStream:
        """Queue a request; ``prompt_hashes`` are its full blocks' hashes if the
        caller computed them already (the entry node does, to place it).

        ``handoff``: where its prompt's KV comes from or goes to
        (disaggregation; read by the KV connectors), whether its prefix may
        come from peers, and where a resumed stream's output continues from.
        Its ``kv_ready_at`` is on ``time.monotonic()``."""
        if self.failure is not None:
            raise EngineFailedError(f"the engine failed: {self.failure!r}")
        if self._closing or self._loop_task is None:
            raise EngineClosedError("the engine is not running")
        self._check_prompt(prompt_token_ids, sampling, handoff.memory_node)
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}-{next(self._ids)}"
        stage = handoff.stage
        if (stage is None) != self.span.whole:
            raise ValueError(
                "a pipeline stage runs only its part of a pipelined request"
                if stage is None
                else "this node is not a stage of a pipelined group"
            )
        req = Request(
            rid,
            list(prompt_token_ids),
            sampling,
            handoff=handoff,
        )
        num_full = len(prompt_token_ids) // self.block_size
        if stage is not None:
            # Its layers' own keys, and no input until the stage before sends it.
            req.block_hashes = self.hash_prompt(prompt_token_ids)
            req.ready_tokens = stage.start if stage.act_in is not None else None
        elif prompt_hashes is not None and len(prompt_hashes) >= num_full:
            req.block_hashes = list(prompt_hashes[:num_full])
        else:
            req.block_hashes = block_hashes(prompt_token_ids, self.block_size, self.model_id)
        if rid in self.outputs:
            raise ValueError(f"request id {rid!r} is already in use")
        self.scheduler.add_request(req)
        stream = self.outputs.add(req, self.abort)
        self.num_prompt_tokens_total += len(req.prompt_token_ids)
        self._wakeup.set()
        return stream

    def hash_prompt(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The keys this node caches a prompt's full blocks under: the blocks'
        hashes, or (a pipeline stage) its layers' keys derived from them."""
        hashes = block_hashes(token_ids, self.block_size, self.model_id)
        if self.span.whole:
            return hashes
        return layer_hashes(hashes, self.span.lo, self.span.hi)

    def cached_prefix(self, token_ids: Sequence[int]) -> int:
        """Prompt tokens this node holds the KV of, on the device or in its own
        host tiers (what a request would start from here); at most all but the
        last token, which is always computed."""
        hashes = self.hash_prompt(token_ids)
        usable = (len(token_ids) - 1) // self.block_size
        hashes = hashes[:usable]
        n = len(self.pool.longest_cached_prefix(hashes))
        n += self.connector.num_held(hashes[n:])
        return n * self.block_size

    async def run_probe(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> None:
        """Run a prompt here alone, to time this node's steps (its cost profile).
        On a pipeline stage it runs through this stage's layers only: a stage
        after the head takes its input from rows it sets aside (what they hold
        is as good as anything for timing), and its output goes nowhere."""
        stage: StageJob | None = None
        pipe = self.pipe
        if pipe is not None:
            span = self.span
            index, count = (0, 3) if span.first else ((2, 3) if span.last else (1, 3))
            act_in = None
            if not span.first:
                act_in = pipe.reserve(
                    request_id, 0, len(prompt_token_ids), upstream=None, url="", ttl_s=60.0
                )
                if act_in is None:
                    raise QueueFullError("no activation rows free for a probe", 1.0)
            stage = StageJob(index, count, 0, act_in=act_in, probe=True)
            # A stage's requests end with their prompt (the last samples one token).
            sampling = dataclasses.replace(sampling, max_tokens=1)
        try:
            handoff = Handoff(peer_fetch=False, stage=stage)
            stream = self.add_request(prompt_token_ids, sampling, request_id, handoff=handoff)
            if stage is not None and stage.act_in is not None and pipe is not None:
                self.stage_arrived(request_id, 0, 0, len(prompt_token_ids))
            async for _ in stream:
                pass
        finally:
            if pipe is not None:
                pipe.release(request_id)

    def stage_arrived(self, request_id: str, seq: int, start: int, end: int) -> None:
        """A pipeline stage's input for positions [start, end) of ``request_id``
        is in its rows (the ``seq``-th chunk): the request may compute them.
        ChunkRefused when the chunk does not follow the last one."""
        if self.pipe is None:
            raise ChunkRefused("this node is not a pipeline stage taking activations in")
        req = self.outputs.request(request_id)
        if req is None or req.handoff.stage is None:
            raise ChunkRefused(f"this stage runs no request {request_id!r}")
        frontier = self.pipe.arrived(request_id, seq, start, end)
        req.ready_tokens = frontier
        self._wakeup.set()

    def _check_prompt(
        self, prompt_token_ids: list[int], sampling: SamplingParams, memory_node: str
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        vocab = self.loaded.arch.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (size {vocab})")
        total = len(prompt_token_ids) + sampling.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens, "
                f"but {total} were requested ({len(prompt_token_ids)} in the prompt, "
                f"{sampling.max_tokens} for the completion)"
            )
        # Offloaded, a request holds blocks here for its prompt only.
        offloaded = self.offload is not None and self.offload.address_for(memory_node)
        local = len(prompt_token_ids) + 1 if offloaded else total
        if -(-local // self.block_size) > self.pool.num_blocks:
            raise PromptTooLongError(
                f"{local} tokens need more KV blocks than this node has "
                f"({self.pool.num_blocks} blocks of {self.block_size} tokens)"
            )

    async def wait_idle(self) -> None:
        """Return once no request is unfinished."""
        await self.outputs.idle.wait()

    def abort(self, request_id: str) -> None:
        if request_id in self.outputs:
            self._pending_aborts.add(request_id)
            self._wakeup.set()

    # -- the loop --------------------------------------------------------

    async def _run_loop(self) -> None:
        while True:
            plan = self._schedule()
            if plan is None:
                return
            if plan.is_empty:
                await self._idle()
                continue
            out = await self._run(plan)
            if out is not None:
                self._postprocess(plan, out)

    def _schedule(self) -> StepPlan | None:
        """The next step's plan, loads started; None once the engine closes."""
        self._apply_aborts()
        if self._closing:
            return None
        # Blocks whose writers outside can no longer write them: free again.
        self.pool.release_expired(self._clock())
        plan = self.scheduler.schedule()
        for req, why in self.scheduler.take_failed():
            self.scheduler.finish(req, FinishReason.ABORT)
            self.outputs.finish(req.request_id, FinishReason.ABORT, error=why)
        for job in plan.loads:
            task = self._load_tasks.spawn(self._load(job), name=f"load-{job.request_id}")
            self._loads[job.request_id] = (job, task)
        if not plan.is_empty:
            plan.connector_meta = self.connector.build_meta(plan)
        self.publish_snapshot()
        return plan

    async def _idle(self) -> None:
        self._report_step(None)
        if not len(self.outputs) and self._checked_at_step != self.num_steps:
            # Idle: a cheap moment for the pool's self-check.
            self._checked_at_step = self.num_steps
            self._self_check()
        if self.offload is not None and self.offload.clients.num_drops:
            # What finished requests held on the memory node goes now; then
            # schedule again (a request may have come meanwhile).
            await asyncio.get_running_loop().run_in_executor(self._executor, self.offload.flush)
            return
        self._wakeup.clear()
        deadline = self.pool.next_deadline()
        if deadline is None:
            await self._wakeup.wait()
            return
        # A timed hold ends meanwhile: its blocks may admit a waiting request.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), max(0.0, deadline - self._clock()))

    async def _run(self, plan: StepPlan) -> StepOutput | None:
        loop = asyncio.get_running_loop()
        self._report_step(time.perf_counter())
        started = time.perf_counter()
        self._last_step = (plan, started, started)
        try:
            return await loop.run_in_executor(self._executor, self.runner.run, plan, self.connector)
        except Exception as exc:
            # A failed forward pass fails the requests in it, not the daemon.
            log.exception("forward pass failed", num_chunks=len(plan.chunks))
            self._fail([c.request_id for c in plan.chunks], f"engine error: {exc}")
            return None

    def _postprocess(self, plan: StepPlan, out: StepOutput) -> None:
        self.num_steps += 1
        last = self._last_step
        if last is not None and last[0] is plan:
            self._last_step = (plan, last[1], time.perf_counter())
        reqs = self.scheduler.update(plan, out.tokens, kv_moved=out.kv_moved, kv_lost=out.kv_lost)
        # Before the outputs go: a request's last one carries what its
        # connector report says became of the KV it sent.
        self.connector.after_step(out.kv_report)
        if out.hidden is not None and self.pipe is not None:
            self.pipe.after_step(plan, out.hidden)
        self._emit(reqs)
        if not self.span.last:
            self._finish_stage_parts(plan)

    def _finish_stage_parts(self, plan: StepPlan) -> None:
        """A stage before the last is done with a request once its whole prompt
        is computed here (it samples nothing): the request ends, its output
        on its way to the next stage."""
        for chunk in plan.chunks:
            req = self.scheduler.requests.get(chunk.request_id)
            if req is None or req.num_computed_tokens < req.num_prompt_tokens:
                continue
            # The output first: its last one carries what the KV sent came to.
            self.outputs.finish(req.request_id, FinishReason.LENGTH)
            self.scheduler.finish(req, FinishReason.LENGTH)

    def _report_step(self, next_start: float | None) -> None:
        """Tell the step listeners of the last step: its period up to
        ``next_start``, or (before an idle wait) its own duration."""
        last, self._last_step = self._last_step, None
        if last is None or not self.step_listeners:
            return
        plan, started, ended = last
        seconds = (next_start if next_start is not None else ended) - started
        for listener in self.step_listeners:
            try:
                listener(plan, seconds)
            except Exception:
                log.exception("step listener failed")

    def _emit(self, reqs: list[Request]) -> None:
        """Send what new tokens add; take out the requests they finished."""
        now = time.monotonic()
        for req in reqs:
            self.num_generation_tokens_total += 1
            if req.first_token_time is None:
                req.first_token_time = now
        for req, reason in self.outputs.process(reqs):
            self.scheduler.finish(req, reason)
            for listener in self.finish_listeners:
                try:
                    listener(req)
                except Exception:
                    log.exception("finish listener failed")

    async def _load(self, job: LoadJob) -> None:
        req = self.scheduler.requests.get(job.request_id)
        if req is None:
            return
        result = LoadResult(0)
        try:
            result = await self.connector.load(req, job)
        except Exception:
            # A failed load costs a recompute, nothing more.
            log.exception("KV load failed", request_id=job.request_id)
        finally:
            self._loads.pop(job.request_id, None)
            self.num_loads_total += 1
            if self.scheduler.finish_load(req, result):
                self._emit([req])
            self._wakeup.set()

    @property
    def load(self) -> EngineLoad:
        """The load of the last snapshot."""
        return self.snapshot.load

    def publish_snapshot(self) -> None:
        """Refresh ``self.snapshot`` (once per scheduling pass; gossip reads it)."""
        s = self.scheduler
        queued, decode = s.load()
        prefill_work, decode_work = s.work()
        self.snapshot = EngineSnapshot(
            model=self.model_facts,
            load=EngineLoad(
                queued_prefill_tokens=queued,
                running_decode_batch=decode,
                kv_usage=self.pool.usage,
                num_steps=self.num_steps,
                num_waiting=len(s.waiting),
                num_running=len(s.running),
            ),
            prefill=tuple(prefill_work),
            decode=tuple(decode_work),
        )

    def _apply_aborts(self) -> None:
        pending, self._pending_aborts = self._pending_aborts, set()
        for rid in pending:
            req = self.outputs.request(rid)
            if req is None:
                continue
            if req.state is RequestState.LOADING:
                # Its blocks are being written: abort once the load ends,
                # cutting the load short where its job says that is safe.
                self._pending_aborts.add(rid)
                job, task = self._loads.get(rid, (None, None))
                if job is not None and task is not None and job.cancellable:
                    if not task.cancelling():
                        task.cancel()
                continue
            self.scheduler.finish(req, FinishReason.ABORT)
            self.outputs.finish(rid, FinishReason.ABORT)

    def _fail(self, request_ids: list[str], message: str) -> None:
        for rid in request_ids:
            req = self.outputs.request(rid)
            if req is None:
                continue
            self.scheduler.finish(req, FinishReason.ABORT)
            self.outputs.finish(rid, FinishReason.ABORT, error=message)

    # -- introspection ---------------------------------------------------

    def requests_in_flight(self, now: float | None = None) -> list[dict[str, object]]:
        """Every unfinished request with its phase (``introspect.requests_in_flight``)."""
        return requests_in_flight(self, time.monotonic() if now is None else now)

    def stats(self) -> EngineStats:
        """Counters for /metrics; EngineClosedError before ``start()``."""
        return engine_stats(self)

    def _self_check(self) -> None:
        self.num_checks += 1
        try:
            self.check_integrity()
        except RuntimeError:
            self.num_integrity_failures += 1
            log.exception("KV block pool failed its self-check")

    def check_integrity(self) -> None:
        """The pool's self-check against every live block table (its own holds
        it counts itself); RuntimeError when it fails."""
        tables = self._scheduler.block_tables() if self._scheduler is not None else []
        self.pool.check_integrity(tables)
