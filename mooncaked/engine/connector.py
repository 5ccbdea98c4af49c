"""The KV connector: how KV blocks reach the device from outside it, and leave it.

Split by role, as the scheduler and the runner are:

- **Scheduler side** (event loop). The scheduler asks ``lookup`` how many
  tokens of a request past its device prefix hit can come from outside (a
  host tier, a peer, a remote prefill node), allocates blocks for them and
  emits a ``LoadJob``; the engine runs ``load`` for it as a task of its own,
  overlapped with other requests' steps, and the request joins the running
  set when it ends. ``lookup`` may answer None ("not known yet": a prefetch
  is in flight) and wake the engine once it knows. ``after_step`` starts
  saving what the step produced (offloads); ``request_finished`` drops a
  request's state.
- **Worker side** (the step thread). ``build_meta`` turns a plan into plain
  data before the step; the runner calls ``save_layer(layer, meta)`` after
  each layer's forward has written its K/V, so KV can stream out layer by
  layer while the next layers compute, and ``wait_for_save(meta)`` before
  it returns the step's results.

Implementations: ``TieredStoreConnector`` (DRAM/SSD tiers and peer
fetches, in ``mooncaked.engine.store_connector``) and the prefill/decode
handoff. ``MultiConnector`` runs several: the first whose ``lookup`` offers
tokens serves a request's load, and every one sees every save.

A failed load is never a failed request: it returns fewer tokens (or
raises, which the engine logs) and the rest is computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mooncaked.engine.kv_pool import BlockPool
    from mooncaked.engine.plan import LoadJob, SampledToken, StepPlan
    from mooncaked.request import Request

__all__ = ["ConnectorContext", "KVConnector", "LoadResult", "MultiConnector"]


@dataclass(frozen=True, slots=True)
class ConnectorContext:
    """What the engine lends its connector when it binds it."""

    pool: BlockPool
    # Per layer (K, V), each [num_blocks, block_size, kv_heads, head_dim].
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    block_size: int
    # Wakes the step loop (a lookup that answered None knows now; blocks were freed).
    wakeup: Callable[[], None]


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


class KVConnector:
    """No tier outside the device: every hook does nothing. Subclasses override."""

    ctx: ConnectorContext

    def bind(self, ctx: ConnectorContext) -> None:
        """Called once by the engine, before it starts."""
        self.ctx = ctx

    # -- scheduler side (event loop) ----------------------------------------

    def request_added(self, req: Request) -> None:
        """A request entered the waiting queue (a chance to start fetching early)."""

    def lookup(self, req: Request, num_computed_tokens: int) -> int | None:
        """Tokens after the first ``num_computed_tokens`` that can come from outside;
        None while that is not known yet (the connector wakes the engine when it is).

        ``req.block_hashes`` covers every full block of the request's tokens.
        """
        return 0

    async def load(self, req: Request, job: LoadJob) -> LoadResult:
        """Fill ``job.block_ids`` with what ``lookup`` offered; may deliver less."""
        return LoadResult(0)

    def load_cancellable(self, req: Request) -> bool:
        """Whether ``req``'s load may be cancelled (an abort) without leaving
        anything still writing into its blocks once ``load`` returns."""
        return False

    def after_step(self) -> None:
        """A step's outputs are applied: start saving what it produced."""

    def request_finished(self, req: Request) -> None:
        """``req`` left the scheduler (finished, aborted, failed)."""

    def held_blocks(self) -> list[list[int]]:
        """Device blocks the connector holds a reference on (for the pool's self-check)."""
        return []

    def num_saves(self) -> int:
        """Saves started so far (offloads, handoffs), for the engine's stats."""
        return 0

    async def close(self) -> None:
        """Wait for what is in flight; release what was held."""

    # -- worker side (step thread) ------------------------------------------

    def build_meta(self, plan: StepPlan) -> Any:
        """Plain data for the worker side of this step (event loop, before the step)."""
        return None

    def save_layer(self, layer: int, meta: Any) -> None:
        """Layer ``layer`` of the step has written its K/V (step thread)."""

    def wait_for_save(self, meta: Any) -> None:
        """Block until this step's saves are out of the device blocks (step thread)."""


class MultiConnector(KVConnector):
    """Several connectors as one; the first that offers tokens loads them."""

    def __init__(self, connectors: Sequence[KVConnector]) -> None:
        self.connectors = list(connectors)
        # request id -> the connector whose lookup offered tokens last.
        self._chosen: dict[str, KVConnector] = {}

    def bind(self, ctx: ConnectorContext) -> None:
        super().bind(ctx)
        for c in self.connectors:
            c.bind(ctx)

    def request_added(self, req: Request) -> None:
        for c in self.connectors:
            c.request_added(req)

    def lookup(self, req: Request, num_computed_tokens: int) -> int | None:
        self._chosen.pop(req.request_id, None)
        for c in self.connectors:
            n = c.lookup(req, num_computed_tokens)
            if n is None:
                return None
            if n > 0:
                self._chosen[req.request_id] = c
                return n
        return 0

    async def load(self, req: Request, job: LoadJob) -> LoadResult:
        c = self._chosen.get(req.request_id)
        if c is None:
            return LoadResult(0)
        try:
            return await c.load(req, job)
        finally:
            self._chosen.pop(req.request_id, None)

    def load_cancellable(self, req: Request) -> bool:
        c = self._chosen.get(req.request_id)
        return c is not None and c.load_cancellable(req)

    def after_step(self) -> None:
        for c in self.connectors:
            c.after_step()

    def request_finished(self, req: Request) -> None:
        self._chosen.pop(req.request_id, None)
        for c in self.connectors:
            c.request_finished(req)

    def held_blocks(self) -> list[list[int]]:
        return [t for c in self.connectors for t in c.held_blocks()]

    def num_saves(self) -> int:
        return sum(c.num_saves() for c in self.connectors)

    async def close(self) -> None:
        for c in reversed(self.connectors):
            await c.close()

    def build_meta(self, plan: StepPlan) -> Any:
        metas = [c.build_meta(plan) for c in self.connectors]
        return None if all(m is None for m in metas) else metas

    def save_layer(self, layer: int, meta: Any) -> None:
        if meta is None:
            return
        for c, m in zip(self.connectors, meta, strict=True):
            if m is not None:
                c.save_layer(layer, m)

    def wait_for_save(self, meta: Any) -> None:
        if meta is None:
            return
        for c, m in zip(self.connectors, meta, strict=True):
            if m is not None:
                c.wait_for_save(m)
