"""The decode node's side of prefill/decode disaggregation, as a KV connector.

A request that arrives with a ``PrefillSource`` (the prefill nodes the
entry node picked) offers every prompt token past the device prefix hit as
coming from outside. The scheduler allocates blocks for them; ``load``
grants those blocks to one prefill node (a ``KVGrant``: where the blocks are
in this node's KV segment, for how long) and asks it to prefill. The prefill
node writes the prompt's KV straight into the granted blocks and answers
with the first sampled token; the request then joins the decode batch. A
prefill node that fails, times out or is draining is replaced by the next
candidate; when none is left the load delivers nothing and this node
computes the prompt itself.

The grant is enforced where the bytes land: before asking a prefill node,
the receiver opens the granted blocks to that node's writes alone
(``WriteGrants``, the transfer engine's write grants), and closes them the
moment the call ends, answered or not; a write outside them, from another
node, or later, is refused. Blocks a prefill node was granted also stay held
(a reference on each) until it can no longer write them: at once when it
answered, else until the grant has expired (a peer that mapped the memory
over shm or RDMA while its grant was live is bounded by that); a request whose
prefill failed computes into fresh blocks instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import structlog

from mooncaked.engine.connector import KVConnector, LoadResult
from mooncaked.engine.handoff import (
    HandoffStats,
    PrefillBusy,
    PrefillCall,
    PrefillError,
    WriteGrants,
)
from mooncaked.engine.late_binding import PrefillWalk
from mooncaked.engine.plan import LoadJob
from mooncaked.handoff import KVGrant, KVLayout
from mooncaked.request import Request

log = structlog.get_logger(__name__)

__all__ = ["KVReceiver"]

# A prefill node's late writes land by the grant's deadline; this much more
# covers the time the grant spent in flight to it.
_GRANT_GRACE_S = 2.0


class KVReceiver(KVConnector):
    def __init__(
        self,
        *,
        node_id: str,
        transfer_address: str,
        segment: str,
        layout: KVLayout,
        prefill: PrefillCall,
        grant_ttl_s: float = 30.0,
        write_grants: WriteGrants | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``write_grants`` opens the granted blocks to the asked node's writes;
        None where nothing enforces grants (tests of the engine alone)."""
        self.node_id = node_id
        self.transfer_address = transfer_address
        self.segment = segment
        self.layout = layout
        self._prefill = prefill
        self.grant_ttl_s = grant_ttl_s
        self._write_grants = write_grants
        self._clock = clock
        # Requests whose handoff ran already (a failed one is computed here).
        self._tried: set[str] = set()
        # Blocks a prefill node may still write: key -> block ids.
        self._holds: dict[int, list[int]] = {}
        self._hold_timers: dict[int, asyncio.TimerHandle] = {}
        self._next_hold = 0
        self.stats = HandoffStats()

    def lookup(self, req: Request, num_computed_tokens: int) -> int | None:
        if req.handoff.source is None or req.request_id in self._tried:
            return 0
        if req.num_output_tokens:
            return 0  # a preempted request recomputes here
        return req.num_tokens - num_computed_tokens

    async def load(self, req: Request, job: LoadJob) -> LoadResult:
        self._tried.add(req.request_id)
        source = req.handoff.source
        if source is None:
            return LoadResult(0)
        grant = KVGrant(
            request_id=req.request_id,
            node_id=self.node_id,
            transfer_address=self.transfer_address,
            segment=self.segment,
            layout=self.layout,
            first_block=job.first_block,
            block_ids=tuple(job.block_ids),
            ttl_s=self.grant_ttl_s,
        )
        # Held for as long as a prefill node may write them.
        hold = self._hold(job.block_ids)
        walk = PrefillWalk.of(source)
        while (step := walk.next()) is not None:
            i, max_wait = step
            target = source.targets[i]
            if max_wait < 0.0:
                # Slower than the candidates left even idle: not worth a call.
                self.stats.passed_on += 1
                continue
            t0 = self._clock()
            try:
                opened = self._open_grant(grant, target.node_id)
            except ValueError as exc:
                # Nothing could write the blocks: no node is worth asking.
                log.error("cannot open a KV grant; computing it here", error=str(exc))
                break
            try:
                reply = await self._prefill(target, req, grant, max_wait)
            except PrefillBusy as exc:
                # Late binding: its true queue is longer than the entry
                # thought; the next candidate is forecast to start sooner.
                log.info(
                    "prefill node busy; asking the next",
                    request_id=req.request_id,
                    prefill_node=target.node_id,
                    reason=str(exc),
                )
                self.stats.passed_on += 1
                continue
            except PrefillError as exc:
                log.warning(
                    "prefill failed; trying the next node"
                    if i + 1 < len(source.targets)
                    else "prefill failed; computing it here",
                    request_id=req.request_id,
                    prefill_node=target.node_id,
                    error=str(exc),
                )
                self.stats.retried += i + 1 < len(source.targets)
                continue
            except asyncio.CancelledError:
                self.stats.cancelled += 1
                self._release_later(hold)
                raise
            finally:
                # Whatever the outcome, this node writes no more: a late write
                # (a timed-out node still sending) is refused, not landed in
                # blocks the next node or this one now fills.
                if opened is not None and self._write_grants is not None:
                    self._write_grants.close(opened)
            self._release(hold)
            self.stats.ok += 1
            log.info(
                "kv handoff done",
                request_id=req.request_id,
                prefill_node=reply.node_id,
                tokens=job.num_tokens,
                kv_bytes=reply.bytes_sent,
                cached_tokens=reply.num_cached_tokens,
                seconds=round(self._clock() - t0, 4),
            )
            return LoadResult(
                num_tokens=job.num_tokens,
                sampled=reply.token,
                num_cached_tokens=reply.num_cached_tokens,
                prefill_node=reply.node_id,
            )
        self.stats.fell_back += 1
        # A failed prefill node may still write the granted blocks until the
        # grant expires: compute into fresh blocks and keep those held.
        self._swap_blocks(req, job, hold)
        return LoadResult(0, prefill_node=self.node_id)

    def _open_grant(self, grant: KVGrant, peer: str) -> object | None:
        if self._write_grants is None:
            return None
        # As long as the blocks stay held for a node that failed.
        return self._write_grants.open(grant, peer, self.grant_ttl_s + _GRANT_GRACE_S)

    def _swap_blocks(self, req: Request, job: LoadJob, hold: int) -> None:
        pool = self.ctx.pool
        fresh = pool.allocate(len(job.block_ids))
        if fresh is None:
            # Short of blocks: keep the granted ones, once nobody can write them.
            log.warning("no blocks to swap a failed handoff's for", request_id=req.request_id)
            self._release_later(hold)
            return
        first = job.first_block
        granted = req.block_ids[first : first + len(fresh)]
        req.block_ids[first : first + len(fresh)] = fresh
        # The request's references on the granted blocks move to the hold.
        self._holds[hold] = self._holds[hold] + granted
        self._release_later(hold)

    def _hold(self, block_ids: Sequence[int]) -> int:
        key = self._next_hold
        self._next_hold += 1
        self.ctx.pool.touch(block_ids)
        self._holds[key] = list(block_ids)
        return key

    def _release(self, key: int) -> None:
        timer = self._hold_timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        block_ids = self._holds.pop(key, None)
        if block_ids:
            self.ctx.pool.free(block_ids)
            self.ctx.wakeup()

    def _release_later(self, key: int) -> None:
        loop = asyncio.get_running_loop()
        self._hold_timers[key] = loop.call_later(
            self.grant_ttl_s + _GRANT_GRACE_S, self._release, key
        )

    def load_cancellable(self, req: Request) -> bool:
        # Cancelling a handoff holds its granted blocks until the grant expires.
        return True

    def request_finished(self, req: Request) -> None:
        self._tried.discard(req.request_id)

    def held_blocks(self) -> list[list[int]]:
        return list(self._holds.values())

    async def close(self) -> None:
        for key in list(self._holds):
            self._release(key)
