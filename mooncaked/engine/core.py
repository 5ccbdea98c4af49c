"""EngineCore: the step loop. schedule -> run (worker thread) -> postprocess.

The event loop owns every piece of scheduler state; only ``ModelRunner.execute``
runs in the worker thread, on a plan that is plain data. Aborts that arrive
while a step runs are queued and applied between steps, so a block is never
freed (and handed to another request) while the forward pass still writes it.

With a tiered store attached (``attach_store``), the engine trades storage for
computation:

- a new request may first wait for ``prefetch`` (blocks held by peers are
  pulled into the local DRAM tier), bounded by a timeout;
- at admission, the prefix past the device hits is looked up in DRAM and SSD;
  hits are loaded into the request's device blocks by a task of their own,
  overlapped with the steps of other requests, and only the tail is computed;
- every block that becomes full and cached on the device is offloaded to the
  store in the background; the engine holds a reference on it until the store
  has copied it, so it cannot be reused meanwhile.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import itertools
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from mooncaked.cache.hashing import BlockHash
from mooncaked.cache.store import DeviceBlocks, TieredStore
from mooncaked.config import Config
from mooncaked.engine.kv_pool import BlockPool
from mooncaked.engine.loader import LoadedModel, load_model
from mooncaked.engine.plan import LoadJob, SampledToken, StepPlan
from mooncaked.engine.runner import ModelRunner, num_blocks_for_bytes
from mooncaked.engine.scheduler import QueueFullError, Scheduler
from mooncaked.engine.tokenizer import IncrementalDetokenizer
from mooncaked.request import (
    FinishReason,
    Request,
    RequestOutput,
    RequestState,
    SamplingParams,
    TokenLogprob,
)
from mooncaked.tasks import TaskSet

__all__ = ["EngineCore", "EngineStats", "PromptTooLongError", "QueueFullError", "RequestStream"]

log = structlog.get_logger(__name__)

# Pulls what peers hold of these blocks into the local DRAM tier; returns how
# many leading blocks are now local.
Prefetch = Callable[[list[BlockHash]], Awaitable[int]]
# Whether a prefetch of these blocks would ask anyone; cheap, no I/O.
PrefetchWanted = Callable[[list[BlockHash]], bool]


class PromptTooLongError(ValueError):
    """The prompt plus the tokens asked for do not fit the model's context."""


class EngineClosedError(RuntimeError):
    """A request reached an engine that is not running."""


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_num_blocks: int
    kv_num_used_blocks: int
    kv_usage: float
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_preemptions_total: int
    num_steps: int
    num_loading: int = 0
    num_loads_total: int = 0
    num_offloads_total: int = 0
    num_integrity_failures: int = 0


class _Tracker:
    """Per-request output state: detokenizer, stop strings, the caller's queue."""

    __slots__ = ("detok", "held", "num_sent_logprobs", "queue", "request", "stop_window")

    def __init__(self, request: Request, detok: IncrementalDetokenizer) -> None:
        self.request = request
        self.detok = detok
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        # Text not yet sent because it may be the start of a stop string.
        self.held = ""
        self.num_sent_logprobs = 0
        self.stop_window = max((len(s) for s in request.sampling.stop), default=0)


class RequestStream:
    """Async iterator of one request's outputs; the last one has ``finished`` set."""

    def __init__(self, engine: EngineCore, tracker: _Tracker) -> None:
        self._engine = engine
        self._tracker = tracker
        self.request_id = tracker.request.request_id
        self._done = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        out = await self._tracker.queue.get()
        if out.finished:
            self._done = True
        return out

    async def aclose(self) -> None:
        """Stop listening; aborts the request if it has not finished."""
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)


class EngineCore:
    def __init__(self, config: Config, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded if loaded is not None else load_model(config.model)
        if self.loaded.device.type == "cpu":
            torch.set_num_threads(cpu_threads(config.model.cpu_threads))
            keep_large_allocations_mapped()
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.served_name
        self.model_id = self.loaded.model_id
        self.max_model_len = self.loaded.max_model_len
        kv = config.kv
        self.block_size = kv.block_size
        num_blocks = kv.num_blocks or num_blocks_for_bytes(
            self.loaded.arch, kv.block_size, self.loaded.dtype, self._kv_budget_bytes()
        )
        if num_blocks <= 0:
            raise ValueError("the KV memory budget is too small for one KV block (see [kv])")
        self.pool = BlockPool(num_blocks, enable_prefix_caching=kv.enable_prefix_caching)
        self.runner = ModelRunner(
            self.loaded, num_blocks, kv.block_size, backend=config.model.attention_backend
        )
        self.scheduler = Scheduler(
            config.scheduler,
            self.pool,
            block_size=kv.block_size,
            max_model_len=self.max_model_len,
            model_id=self.model_id,
            eos_token_ids=self.tokenizer.eos_token_ids,
        )
        self._trackers: dict[str, _Tracker] = {}
        self._pending_aborts: set[str] = set()
        self._wakeup = asyncio.Event()
        # Set while no request is unfinished: drain and tests wait on it.
        self._idle = asyncio.Event()
        self._idle.set()
        # One thread: forward passes are serialized, and torch uses its own
        # intra-op threads inside it.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mooncaked-step")
        self._loop_task: asyncio.Task[None] | None = None
        self._closing = False
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        # Host tiers (attach_store).
        self.store: TieredStore | None = None
        self._prefetch: Prefetch | None = None
        self._prefetch_timeout_s = 0.0
        self._prefetch_wanted: PrefetchWanted | None = None
        self._load_tasks = TaskSet("engine-loads")
        self._prefetch_tasks = TaskSet("engine-prefetches")
        # Blocks cached on the device since the last step: offloaded after it.
        self._to_offload: list[BlockHash] = []
        # References held on device blocks until the store has copied them.
        self._offload_holds: dict[int, list[int]] = {}
        self._offload_ids = itertools.count()
        self.num_loads_total = 0
        self.num_offloads_total = 0
        self._checked_at_step = 0
        self.num_integrity_failures = 0
        self.pool.listeners.append(self._on_block_event)

    def _kv_budget_bytes(self) -> int:
        kv = self.config.kv
        device = self.loaded.device
        if device.type != "cuda":
            return kv.memory_bytes
        # Weights are loaded already: what the fraction of the card leaves
        # beyond what is in use now goes to KV blocks.
        free, total = torch.cuda.mem_get_info(device)
        return int(total * kv.gpu_memory_fraction) - (total - free)

    # -- host tiers ------------------------------------------------------

    def attach_store(
        self,
        store: TieredStore,
        prefetch: Prefetch | None = None,
        prefetch_timeout_s: float = 2.0,
        prefetch_wanted: PrefetchWanted | None = None,
    ) -> None:
        """Use ``store`` (started by the caller) for loads and offloads; before start().

        ``prefetch_wanted``, asked on arrival, lets a request no peer can help
        be admitted at once instead of waiting for a prefetch that finds nothing.
        """
        if self._loop_task is not None:
            raise RuntimeError("attach_store must be called before start()")
        self.store = store
        self._prefetch = prefetch
        self._prefetch_timeout_s = prefetch_timeout_s
        self._prefetch_wanted = prefetch_wanted

        def external(hashes: Any) -> int:
            # Asked once per admission: the store's per-tier hit/miss counters
            # then count prompts' blocks past the device hits.
            return store.lookup(hashes).num_blocks

        self.scheduler.external = external

    def reset_prefix_cache(self) -> int:
        """Forget every device block not in use; how many were dropped."""
        return self.pool.reset_prefix_cache()

    def _on_block_event(self, block_hash: BlockHash, stored: bool) -> None:
        if stored and self.store is not None:
            self._to_offload.append(block_hash)

    def _offload_new_blocks(self) -> None:
        store = self.store
        if store is None or not self._to_offload:
            return
        hashes, self._to_offload = self._to_offload, []
        cached = self.pool.cached_blocks
        pairs = [(h, cached[h]) for h in hashes if h in cached]
        if not pairs:
            return
        block_ids = [b for _, b in pairs]
        self.pool.touch(block_ids)
        try:
            fut = store.offload(
                [h for h, _ in pairs], DeviceBlocks(self.runner.kv_caches, block_ids)
            )
        except RuntimeError:  # the store is closing
            fut = None
        if fut is None:  # queue full: dropped, the blocks stay device-only
            self.pool.free(block_ids)
            return
        key = next(self._offload_ids)
        self._offload_holds[key] = block_ids
        self.num_offloads_total += 1
        fut.add_done_callback(lambda _f, key=key: self._offload_done(key))

    def _offload_done(self, key: int) -> None:
        self.pool.free(self._offload_holds.pop(key))
        self._wakeup.set()  # freed blocks may admit a waiting request

    async def _load(self, job: LoadJob) -> None:
        store = self.store
        loaded = 0
        try:
            if store is not None:
                loaded = await store.load(
                    job.hashes, DeviceBlocks(self.runner.kv_caches, job.block_ids)
                )
        except Exception:
            # A failed load costs a recompute, nothing more.
            log.exception("cache load failed", request_id=job.request.request_id)
        finally:
            self.num_loads_total += 1
            self.scheduler.finish_load(job.request, loaded)
            self._wakeup.set()

    async def _prefetch_then_release(self, req: Request, hashes: list[BlockHash]) -> None:
        prefetch = self._prefetch
        try:
            if prefetch is not None:
                await asyncio.wait_for(prefetch(hashes), self._prefetch_timeout_s)
        except TimeoutError:
            log.info("prefetch timed out", request_id=req.request_id)
        except Exception:
            log.exception("prefetch failed", request_id=req.request_id)
        finally:
            self.scheduler.release(req)
            self._wakeup.set()

    # -- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        if self._loop_task is not None:
            raise RuntimeError("engine already started")
        self._loop_task = asyncio.create_task(self._run_loop(), name="engine-step-loop")
        log.info(
            "engine started",
            model=self.model_name,
            num_blocks=self.pool.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            device=str(self.loaded.device),
        )

    async def close(self) -> None:
        """Abort everything in flight and stop the step loop."""
        self._closing = True
        for request_id in list(self._trackers):
            self._pending_aborts.add(request_id)
        self._wakeup.set()
        task, self._loop_task = self._loop_task, None
        if task is not None:
            try:
                await task
            except Exception:
                log.exception("engine step loop failed")
        self._prefetch_tasks.cancel()
        await self._prefetch_tasks.wait()
        # Loads write device blocks: let them end before their requests go.
        await self._load_tasks.wait()
        # Requests never scheduled by a loop that is gone still get their end.
        self._apply_aborts()
        self._executor.shutdown(wait=True)

    # -- requests --------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self._trackers)

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
    ) -> RequestStream:
        if self._closing or self._loop_task is None:
            raise EngineClosedError("the engine is not running")
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
        if -(-total // self.block_size) > self.pool.num_blocks:
            raise PromptTooLongError(
                f"{total} tokens need more KV blocks than this node has "
                f"({self.pool.num_blocks} blocks of {self.block_size} tokens)"
            )
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}-{next(self._ids)}"
        req = Request(rid, list(prompt_token_ids), sampling)
        # Held until we know whether a peer should be asked first; the
        # scheduler only admits between steps, so nothing runs meanwhile.
        self.scheduler.add_request(req, ready=False)
        try:
            prefetch = self._prefetch_hashes(req)
        except Exception:
            log.exception("prefetch check failed", request_id=rid)
            prefetch = None
        if prefetch is None:
            self.scheduler.release(req)
        else:
            self._prefetch_tasks.spawn(self._prefetch_then_release(req, prefetch))
        self.num_prompt_tokens_total += len(req.prompt_token_ids)
        tracker = _Tracker(
            req, IncrementalDetokenizer(self.tokenizer, prompt_ids=req.prompt_token_ids)
        )
        self._trackers[rid] = tracker
        self._idle.clear()
        self._wakeup.set()
        return RequestStream(self, tracker)

    def _prefetch_hashes(self, req: Request) -> list[BlockHash] | None:
        """The blocks worth asking peers for: full prompt blocks past the device hits."""
        if self._prefetch is None:
            return None
        # The scheduler's memo: admission reuses these hashes.
        hashes = self.scheduler.block_hashes(req)
        # The last block is recomputed anyway (one token must be sampled).
        hashes = hashes[: (len(req.prompt_token_ids) - 1) // self.block_size]
        on_device = len(self.pool.longest_cached_prefix(hashes))
        rest = hashes[on_device:]
        if not rest or (self._prefetch_wanted is not None and not self._prefetch_wanted(rest)):
            return None
        return rest

    async def wait_idle(self) -> None:
        """Return once no request is unfinished."""
        await self._idle.wait()

    def abort(self, request_id: str) -> None:
        if request_id in self._trackers:
            self._pending_aborts.add(request_id)
            self._wakeup.set()

    # -- the loop --------------------------------------------------------

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_aborts()
            if self._closing:
                return
            plan = self.scheduler.schedule()
            for job in plan.loads:
                self._load_tasks.spawn(self._load(job))
            if plan.is_empty:
                if not self._trackers and self._checked_at_step != self.num_steps:
                    # Idle: a cheap moment for the pool's self-check.
                    self._checked_at_step = self.num_steps
                    self._self_check()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                results = await loop.run_in_executor(self._executor, self.runner.execute, plan)
            except Exception as exc:
                # A failed forward pass fails the requests in it, not the daemon.
                log.exception("forward pass failed", num_chunks=len(plan.chunks))
                self._fail(plan, f"engine error: {exc}")
                continue
            self.num_steps += 1
            self._postprocess(plan, results)
            self._offload_new_blocks()

    def _postprocess(self, plan: StepPlan, results: list[SampledToken | None]) -> None:
        for req in self.scheduler.update(plan, results):
            tracker = self._trackers.get(req.request_id)
            if tracker is None:
                continue
            self.num_generation_tokens_total += 1
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            self._emit(tracker, [req.output_token_ids[-1]])

    def _emit(self, tracker: _Tracker, new_ids: list[int]) -> None:
        req = tracker.request
        text = tracker.held + tracker.detok.push(new_ids)
        finished = req.is_finished
        if finished:
            text += tracker.detok.flush()
        reason = req.finish_reason
        if tracker.stop_window:
            cut = _find_stop(text, req.sampling.stop)
            if cut is not None:
                text = text[:cut]
                if not finished:
                    self.scheduler.finish(req, FinishReason.STOP)
                finished, reason = True, FinishReason.STOP
            if not finished:
                # Hold back a tail that could still grow into a stop string.
                keep = tracker.stop_window - 1
                text, tracker.held = (text[:-keep], text[-keep:]) if keep else (text, "")
        logprobs = req.output_logprobs[tracker.num_sent_logprobs :]
        tracker.num_sent_logprobs = len(req.output_logprobs)
        self._send(tracker, new_ids, text, finished, reason, logprobs)

    def _send(
        self,
        tracker: _Tracker,
        new_ids: list[int],
        text: str,
        finished: bool,
        reason: FinishReason | None,
        logprobs: list[TokenLogprob],
        error: str | None = None,
    ) -> None:
        req = tracker.request
        tracker.queue.put_nowait(
            RequestOutput(
                request_id=req.request_id,
                new_token_ids=new_ids,
                text=text,
                finished=finished,
                finish_reason=reason,
                logprobs=logprobs,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
                num_output_tokens=req.num_output_tokens,
                error=error,
            )
        )
        if finished:
            del self._trackers[req.request_id]
            if not self._trackers:
                self._idle.set()

    def _apply_aborts(self) -> None:
        pending, self._pending_aborts = self._pending_aborts, set()
        for rid in pending:
            tracker = self._trackers.get(rid)
            if tracker is None:
                continue
            if tracker.request.state is RequestState.LOADING:
                # Its blocks are being written: abort once the load ends.
                self._pending_aborts.add(rid)
                continue
            self.scheduler.finish(tracker.request, FinishReason.ABORT)
            self._send(tracker, [], tracker.held, True, FinishReason.ABORT, [])

    def _fail(self, plan: StepPlan, message: str) -> None:
        for chunk in plan.chunks:
            tracker = self._trackers.get(chunk.request.request_id)
            if tracker is None:
                continue
            self.scheduler.finish(chunk.request, FinishReason.ABORT)
            self._send(tracker, [], "", True, FinishReason.ABORT, [], error=message)

    # -- introspection ---------------------------------------------------

    def stats(self) -> EngineStats:
        s = self.scheduler
        queried = s.prefix_queried_tokens
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_num_blocks=self.pool.num_blocks,
            kv_num_used_blocks=self.pool.num_used_blocks,
            kv_usage=self.pool.usage,
            prefix_queried_tokens=queried,
            prefix_hit_tokens=s.prefix_hit_tokens,
            prefix_hit_rate=s.prefix_hit_tokens / queried if queried else 0.0,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            num_preemptions_total=s.num_preemptions,
            num_steps=self.num_steps,
            num_loading=len(s.loading),
            num_loads_total=self.num_loads_total,
            num_offloads_total=self.num_offloads_total,
            num_integrity_failures=self.num_integrity_failures,
        )

    def _self_check(self) -> None:
        try:
            self.check_integrity()
        except RuntimeError:
            self.num_integrity_failures += 1
            log.exception("KV block pool failed its self-check")

    def check_integrity(self) -> None:
        self.pool.check_integrity([*self.scheduler.block_tables(), *self._offload_holds.values()])


def cpu_threads(configured: int) -> int:
    """Intra-op threads for CPU inference: the configured count, else cores - 1."""
    if configured > 0:
        return configured
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) - 1)


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_allocations_mapped() -> bool:
    """Stop glibc from mmap'ing (and unmapping) every large tensor; True if applied.

    A CPU decode step gathers several MB of K/V per layer into fresh tensors.
    Above glibc's mmap threshold each one is a new mapping, page-faulted in
    and unmapped on free: on a 64-sequence step that was most of the step's
    time (139 ms vs 50 ms in tools/bench_engine.py's workload). Serving them
    from the heap, and not trimming it back, reuses the same pages.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 512 << 20) == 1
    return mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and ok


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None
