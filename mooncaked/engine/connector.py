"""The KV connector: how KV blocks reach the device from outside it, and leave it.

Split by role, as the scheduler and the runner are:

- **Scheduler side** (event loop). The scheduler asks ``lookup`` how many
  tokens of a request past its device prefix hit can come from outside (a
  host tier, a peer, a remote prefill node). The answer is a value, a
  ``KVHit``, and asking has no effect: ``lookup`` may be asked again and
  again while the request waits. It may answer None ("not known yet": a
  prefetch is in flight) and wake the engine once it knows. When the
  request is admitted, ``request_admitted`` hears the answer it was
  admitted with; with tokens to load, the scheduler allocates blocks for
  them and emits a ``LoadJob`` that says who serves it. The engine runs
  ``load`` for the job as a task of its own, overlapped with other
  requests' steps; the load answers with a ``LoadResult`` (what landed, and
  what must become of the blocks), which the scheduler applies, and the
  request joins the running set. ``after_step`` takes the worker side's
  report of a step and starts saving what the step produced (offloads);
  ``kv_sent`` says what a request's KV handoff came to, for its final
  output; ``request_finished`` drops a request's state.
- **Worker side** (the step thread). ``build_meta`` turns a plan into frozen
  plain data before the step; the runner calls ``save_layer(layer, meta)``
  after each layer's forward has written its K/V, so KV can stream out
  layer by layer while the next layers compute, and ``wait_for_save(meta)``
  before it returns the step's results. ``wait_for_save`` returns the
  step's report (plain data: what was sent, what failed), which the engine
  hands to ``after_step`` on the event loop. The step thread never changes
  an object the event loop owns.

Implementations: ``TieredStoreConnector`` (DRAM/SSD tiers and peer
fetches, in ``mooncaked.engine.store_connector``) and the prefill/decode
handoff (``kv_receiver``, ``kv_sender``). ``MultiConnector`` runs several:
the first whose ``lookup`` offers tokens serves a request's load, and every
one sees every save.

A failed load is never a failed request: it returns fewer tokens (or
raises, which the engine logs) and the rest is computed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mooncaked.engine.kv_pool import BlockPool
    from mooncaked.engine.plan import LoadJob, SampledToken, StepPlan
    from mooncaked.request import KVSent, Request

__all__ = [
    "NO_HIT",
    "BlockHold",
    "ConnectorContext",
    "KVConnector",
    "KVHit",
    "LoadResult",
    "MultiConnector",
]


@dataclass(frozen=True, slots=True)
class ConnectorContext:
    """What the engine lends its connector when it binds it."""

    pool: BlockPool
    # Per layer (K, V), each [num_blocks, block_size, kv_heads, head_dim].
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    block_size: int
    # Wakes the step loop (a lookup that answered None knows now; blocks were freed).
    wakeup: Callable[[], None]
    # The engine's clock: the deadlines of the pool's timed holds are on it.
    clock: Callable[[], float] = time.monotonic


@dataclass(frozen=True, slots=True)
class KVHit:
    """What ``lookup`` found: tokens after the device prefix hit that can come
    from outside, and how their load runs."""

    num_tokens: int = 0
    # Which connector serves them: its index among a MultiConnector's (0 alone).
    source: int = 0
    # Whether an abort may cancel the load: it then ends early with a result
    # like any other, and nothing outside writes the blocks past what that
    # result holds them for.
    cancellable: bool = False


NO_HIT = KVHit()


@dataclass(frozen=True, slots=True)
class BlockHold:
    """Blocks of a load's job that a writer outside this node may still write
    until ``until`` (the engine's clock): the pool keeps a reference on them
    till then, so nobody else is handed them meanwhile."""

    block_ids: tuple[int, ...]
    until: float
    # The request stops using them and computes into fresh blocks in their
    # place (a load that failed: what lands late must not mix with what the
    # request computes). False: the request keeps them (it is being aborted).
    swap: bool = False


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What a load put in place: the KV of ``num_tokens`` tokens from the job's
    first block on, and, when it came from a node that ran the forward pass
    (a remote prefill), the token it sampled after them."""

    num_tokens: int
    sampled: SampledToken | None = None
    # Set when another node ran the prompt's forward pass: the prompt tokens
    # it served from a cache, which is what the request reports as cached
    # (None: the loaded tokens were all cached, as from a host tier).
    num_cached_tokens: int | None = None
    # The node that ran the forward pass, when it was another one.
    prefill_node: str | None = None
    # What must become of blocks someone outside may still write.
    hold: BlockHold | None = None
    # The KV went to the memory node that attends over it (a direct
    # handoff), not into the job's blocks: they go back, unwritten.
    kv_remote: bool = False


class KVConnector:
    """No tier outside the device: every hook does nothing. Subclasses override."""

    ctx: ConnectorContext

    def bind(self, ctx: ConnectorContext) -> None:
        """Called once by the engine, when it starts."""
        self.ctx = ctx

    # -- scheduler side (event loop) ----------------------------------------

    def request_added(self, req: Request) -> None:
        """A request entered the waiting queue (a chance to start fetching early)."""

    def lookup(self, req: Request, num_computed_tokens: int) -> KVHit | None:
        """Tokens after the first ``num_computed_tokens`` that can come from outside;
        None while that is not known yet (the connector wakes the engine when it is).

        Free of effects: asked on every scheduling pass the request waits in.
        ``req.block_hashes`` covers every full block of the request's tokens.
        """
        return NO_HIT

    def num_held(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``hashes`` (past the device's) this node's own
        tiers hold, that a load could bring in now; no effects."""
        return 0

    def request_admitted(self, req: Request, hit: KVHit) -> None:
        """``req`` was admitted with ``hit`` (``req.num_computed_tokens`` is its
        device prefix hit): once per admission, for the connector's counters."""

    async def load(self, req: Request, job: LoadJob) -> LoadResult:
        """Fill ``job.block_ids`` with what ``lookup`` offered; may deliver less.

        A job marked ``cancellable`` returns a result when its task is
        cancelled, as when it ends any other way."""
        return LoadResult(0)

    def after_step(self, report: Any) -> None:
        """A step's outputs are applied (event loop): ``report`` is what
        ``wait_for_save`` returned for it (None: nothing). A chance to start
        saving what the step produced."""

    def kv_sent(self, req: Request) -> KVSent | None:
        """What became of the KV ``req`` was to send (the prefill side of a
        handoff), for its final output; None when it sends none."""
        return None

    def request_finished(self, req: Request) -> None:
        """``req`` left the scheduler (finished, aborted, failed)."""

    def num_saves(self) -> int:
        """Saves started so far (offloads, handoffs), for the engine's stats."""
        return 0

    async def close(self) -> None:
        """Wait for what is in flight."""

    # -- worker side (step thread) ------------------------------------------

    def build_meta(self, plan: StepPlan) -> Any:
        """Frozen plain data for the worker side of this step (event loop,
        before the step); None when there is nothing to do."""
        return None

    def save_layer(self, layer: int, meta: Any) -> None:
        """Layer ``layer`` of the step has written its K/V (step thread)."""

    def wait_for_save(self, meta: Any) -> Any:
        """Block until this step's saves are out of the device blocks (step
        thread); the step's report, for ``after_step``."""
        return None


class MultiConnector(KVConnector):
    """Several connectors as one; the first that offers tokens loads them.

    A lookup asks them in order and stops at the first that offers tokens
    (or does not know yet); its answer names that one, and the load goes to
    the one the job names.
    """

    def __init__(self, connectors: Sequence[KVConnector]) -> None:
        self.connectors = tuple(connectors)

    def bind(self, ctx: ConnectorContext) -> None:
        super().bind(ctx)
        for c in self.connectors:
            c.bind(ctx)

    def request_added(self, req: Request) -> None:
        for c in self.connectors:
            c.request_added(req)

    def lookup(self, req: Request, num_computed_tokens: int) -> KVHit | None:
        for i, c in enumerate(self.connectors):
            hit = c.lookup(req, num_computed_tokens)
            if hit is None:
                return None
            if hit.num_tokens > 0:
                return dataclasses.replace(hit, source=i)
        return NO_HIT

    def num_held(self, hashes: Sequence[bytes]) -> int:
        for c in self.connectors:
            n = c.num_held(hashes)
            if n:
                return n
        return 0

    def request_admitted(self, req: Request, hit: KVHit) -> None:
        # Those the lookup asked: up to the one that offered, or all of them.
        asked = self.connectors[: hit.source + 1] if hit.num_tokens else self.connectors
        for i, c in enumerate(asked):
            c.request_admitted(req, hit if hit.num_tokens and i == hit.source else NO_HIT)

    async def load(self, req: Request, job: LoadJob) -> LoadResult:
        if not 0 <= job.source < len(self.connectors):
            raise RuntimeError(f"load {job.request_id} names connector {job.source}")
        return await self.connectors[job.source].load(req, job)

    def after_step(self, report: Any) -> None:
        reports = report if report is not None else (None,) * len(self.connectors)
        for c, r in zip(self.connectors, reports, strict=True):
            c.after_step(r)

    def kv_sent(self, req: Request) -> KVSent | None:
        for c in self.connectors:
            sent = c.kv_sent(req)
            if sent is not None:
                return sent
        return None

    def request_finished(self, req: Request) -> None:
        for c in self.connectors:
            c.request_finished(req)

    def num_saves(self) -> int:
        return sum(c.num_saves() for c in self.connectors)

    async def close(self) -> None:
        for c in reversed(self.connectors):
            await c.close()

    def build_meta(self, plan: StepPlan) -> Any:
        metas = tuple(c.build_meta(plan) for c in self.connectors)
        return None if all(m is None for m in metas) else metas

    def save_layer(self, layer: int, meta: Any) -> None:
        if meta is None:
            return
        for c, m in zip(self.connectors, meta, strict=True):
            if m is not None:
                c.save_layer(layer, m)

    def wait_for_save(self, meta: Any) -> Any:
        if meta is None:
            return None
        reports = tuple(
            c.wait_for_save(m) if m is not None else None
            for c, m in zip(self.connectors, meta, strict=True)
        )
        return None if all(r is None for r in reports) else reports
