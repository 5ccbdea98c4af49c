"""What this node tells gossip about itself: role, model, API address, load, costs.

``LoadMeter`` is the ``local_state`` callback of the gossip service: role,
model, API address, draining, the load and work the engine publishes once
per scheduling pass (``EngineCore.snapshot``), the node's fitted cost model
and its forecast of the decode batch. Gossip polls it every round (five
times a second by default), so it reads that snapshot only; nothing here
reaches into the engine's scheduler, runner or model.

``CostMeter`` learns the costs: every engine step is a sample of the step
model (``fit.StepFitter``), every peer read a sample of a link's
bandwidth, every finished request a sample of output lengths. ``profile``
runs a few prompts of known lengths and a small decode batch through the
engine at start-up, so the model is usable before the first real request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from mooncaked.cluster.costs import NodeCosts, StepCost, StepFeatures, prefill_pairs
from mooncaked.cluster.fit import LinkMeter, StepFitter
from mooncaked.cluster.forecast import (
    DecodeWork,
    DepartureRate,
    OutputLengths,
    PrefillWork,
)
from mooncaked.cluster.state import LocalState, MemoryInfo, NodeLoad, OffloadInfo, StageInfo
from mooncaked.cluster.work import NodeWork, gossiped_load, queue_s
from mooncaked.config import PipelineConfig
from mooncaked.engine.plan import StepPlan
from mooncaked.request import Request, SamplingParams

if TYPE_CHECKING:
    from mooncaked.engine.core import EngineCore
    from mooncaked.engine.snapshot import EngineSnapshot

log = structlog.get_logger(__name__)


def step_features(plan: StepPlan) -> StepFeatures:
    """A step plan as the step model's inputs. A one-token chunk is priced as a
    decode (a prompt's last token computes as one) whatever its phase."""
    tokens = pairs = seqs = ctx = 0
    for c in plan.chunks:
        n = len(c.token_ids)
        if n == 1:
            seqs += 1
            ctx += c.start_pos + 1
        else:
            tokens += n
            pairs += prefill_pairs(n, c.start_pos)
    return StepFeatures(tokens, pairs, seqs, ctx)


def engine_work(snapshot: EngineSnapshot, now: float) -> NodeWork:
    """An engine's published work as the forecasts' plain data (``work.NodeWork``),
    a handoff's expected start counted from ``now``."""
    return NodeWork(
        prefill=[PrefillWork(n, c) for n, c in snapshot.prefill],
        decode=[
            DecodeWork(ctx, out, more, max(0.0, ready_at - now) if ready_at > 0.0 else 0.0)
            for ctx, out, more, ready_at in snapshot.decode
        ],
        running_decode_batch=snapshot.load.running_decode_batch,
        kv_usage=snapshot.load.kv_usage,
    )


class CostMeter:
    """This node's cost model, learnt from its own steps, reads and requests."""

    def __init__(self, engine: EngineCore, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._engine = engine
        # The clock departures are timed by: the load meter's, which reads them.
        self._clock = clock
        self.fitter = StepFitter()
        self.links = LinkMeter()
        self.lengths = OutputLengths()
        self._profiling = False
        self.profiled = False
        self._kv_bytes_per_token = engine.snapshot.model.kv_bytes_per_token
        self._costs = NodeCosts()
        self.departures = DepartureRate()
        self._costs_at: tuple[int, StepCost] | None = None

    def attach(self) -> None:
        self._engine.step_listeners.append(self._on_step)
        self._engine.finish_listeners.append(self._on_finish)

    def _on_step(self, plan: StepPlan, seconds: float) -> None:
        self.fitter.add(step_features(plan), seconds, pinned=self._profiling)

    def _on_finish(self, req: Request) -> None:
        if not self._profiling and req.finish_reason is not None:
            self.lengths.add(req.handoff.output_offset + len(req.output_token_ids))
            # In a steady state requests join the batch as fast as they leave it.
            self.departures.add(self._clock(), req.num_prompt_tokens)

    def queue_s(self) -> float:
        """How long a prompt queued now waits here, priced by this node's
        model as gossip publishes it (what a late-binding offer is judged by)."""
        return queue_s(self.costs(), engine_work(self._engine.snapshot, self._clock()))

    def on_read(self, peer: str, nbytes: int, seconds: float) -> None:
        self.links.add(peer, nbytes, seconds)

    def costs(self) -> NodeCosts:
        """The model as gossip carries it (rebuilt only when it changed)."""
        # The fit too, not only the sample count: the profile's closing refit adds no sample.
        stamp = (self.fitter.num_samples, self.fitter.cost)
        if stamp != self._costs_at:
            self._costs_at = stamp
            model = self._engine.snapshot.model
            step = self.fitter.cost
            # Rounded to 4 significant digits: a refit that changes nothing
            # of substance is no news for gossip.
            self._costs = NodeCosts(
                step=type(step)(*(float(f"{c:.4g}") for c in step.coefficients())),
                kv_bytes_per_token=self._kv_bytes_per_token,
                chunk_tokens=model.max_num_batched_tokens,
                max_batch=model.max_num_seqs,
                links=self.links.links(),
            )
        elif self._costs.links != self.links.links():
            self._costs = NodeCosts(
                step=self._costs.step,
                kv_bytes_per_token=self._costs.kv_bytes_per_token,
                chunk_tokens=self._costs.chunk_tokens,
                max_batch=self._costs.max_batch,
                links=self.links.links(),
            )
        return self._costs

    async def profile(self, *, seed: int = 0) -> None:
        """Run prompts of a few lengths, then a decode batch, through the engine;
        their steps are kept for good in the fit. Errors end the profile early
        (the online samples take over), never the node."""
        engine = self._engine
        model = engine.snapshot.model
        rng = random.Random(seed)
        vocab = max(2, model.vocab_size)
        longest = max(16, min(1024, model.max_model_len // 2))
        lengths = [n for n in (16, 64, 256, 1024) if n <= longest] or [longest]
        self._profiling = True
        try:
            for n in lengths:
                await self._run(engine, [rng.randrange(1, vocab) for _ in range(n)], 2, "len", n)
            batch = min(16, model.max_num_seqs)
            await asyncio.gather(
                *(
                    self._run(engine, [rng.randrange(1, vocab) for _ in range(32)], 16, "dec", i)
                    for i in range(batch)
                )
            )
        except Exception:
            log.exception("cost profile failed; the model learns from real requests instead")
        finally:
            self._profiling = False
            self.fitter.refit()
            # The profile's prompts are not anybody's prefix.
            with contextlib.suppress(Exception):
                engine.reset_prefix_cache()
        self.profiled = True
        log.info(
            "cost model profiled",
            samples=self.fitter.num_samples,
            median_error=round(self.fitter.median_relative_error(), 3),
            **{
                k: f"{v:.3g}"
                for k, v in zip(
                    ("base_s", "token_s", "pair_s", "seq_s", "ctx_s"),
                    self.fitter.cost.coefficients(),
                    strict=True,
                )
            },
        )

    @staticmethod
    async def _run(
        engine: EngineCore, prompt: list[int], max_tokens: int, tag: str, i: int
    ) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        await engine.run_probe(prompt, sampling, f"profile-{tag}-{i}")


class LoadMeter:
    """``local_state`` for ``ClusterService``: cheap enough to run every gossip round."""

    def __init__(
        self,
        *,
        role: str,
        api_addr: str,
        engine: Callable[[], EngineCore | None],
        draining: Callable[[], bool],
        clock: Callable[[], float],
        costs: CostMeter | None = None,
        pipeline: PipelineConfig | None = None,
        dram_free: Callable[[], int] | None = None,
        memory_load: Callable[[], NodeLoad] | None = None,
        memory: Callable[[], MemoryInfo] | None = None,
        offload: Callable[[EngineCore], OffloadInfo | None] | None = None,
    ) -> None:
        """``dram_free``: free slots of the node's DRAM tier (replicas go
        where most are free). ``memory_load``: a memory node's (no engine)
        KV use and the sequences it serves; ``memory``: its attention
        service and pool. ``offload``: what a compute node whose attention
        placement offloads says of it."""
        self._memory_load = memory_load
        self._memory = memory
        self._offload = offload
        self._offload_info: OffloadInfo | None = None
        self._offload_asked = False
        self._role = role
        self._dram_free = dram_free
        self._api_addr = api_addr
        self._engine = engine
        self._draining = draining
        self._clock = clock
        self.costs = costs
        self._pipeline = pipeline
        self._stage_info: StageInfo | None = None

    def __call__(self) -> LocalState:
        engine = self._engine()
        if engine is None:
            load = self._memory_load() if self._memory_load is not None else NodeLoad()
            return LocalState(
                role=self._role,
                api_addr=self._api_addr,
                draining=self._draining(),
                load=load,
                memory=self._memory() if self._memory is not None else None,
            )
        now = self._clock()
        snapshot = engine.snapshot
        work = engine_work(snapshot, now)
        if self._dram_free is not None:
            work = dataclasses.replace(work, dram_free_blocks=self._dram_free())
        meter = self.costs
        if meter is not None:
            load, forecast = gossiped_load(
                meter.costs(), work, meter.lengths, meter.departures, now
            )
            costs = meter.costs()
        else:
            costs = NodeCosts()
            load, forecast = gossiped_load(
                costs, work, OutputLengths(), DepartureRate(), now, forecast=False
            )
        return LocalState(
            role=self._role,
            model_id=snapshot.model.model_id,
            api_addr=self._api_addr,
            draining=self._draining(),
            load=load,
            costs=costs,
            forecast=forecast,
            stage=self._stage(engine),
            offload=self._offload_of(engine),
        )

    def _offload_of(self, engine: EngineCore) -> OffloadInfo | None:
        # Fixed for the engine's life: worked out once.
        if not self._offload_asked and self._offload is not None:
            self._offload_info = self._offload(engine)
            self._offload_asked = True
        return self._offload_info

    def _stage(self, engine: EngineCore) -> StageInfo | None:
        """This node's place in its pipelined prefill group, if it is a stage."""
        p = self._pipeline
        span = engine.span
        if p is None or not p.enabled or span.whole:
            return None
        info = self._stage_info
        if info is None:
            arch, dtype, pipe = engine.loaded.arch, engine.loaded.dtype, engine.pipe
            info = self._stage_info = StageInfo(
                group=p.group,
                index=p.stage,
                num_stages=p.num_stages,
                layer_lo=span.lo,
                layer_hi=span.hi,
                num_layers=span.num_layers,
                act_bytes_per_token=arch.hidden_size * dtype.itemsize,
                chunk_tokens=p.chunk_tokens,
                max_tokens=pipe.act_in.shape[0]
                if pipe is not None and pipe.act_in is not None
                else 0,
            )
        return info
