"""The decode node's side of prefill/decode disaggregation, as a KV connector.

A request that arrives with a ``PrefillSource`` (the prefill nodes the
entry node picked) offers every prompt token past the device prefix hit as
coming from outside. The scheduler allocates blocks for them; ``load``
grants those blocks to one prefill node (a ``KVGrant``: where the blocks are
in this node's KV segment, for how long) and asks it to prefill. The prefill
node writes the prompt's KV straight into the granted blocks and answers
with the first sampled token; the request then joins the decode batch. A
prefill node that fails, times out or is draining is replaced by the next
candidate (``PrefillWalk``: late binding); when none is left the load
delivers nothing and this node computes the prompt itself.

The grant is enforced where the bytes land: before asking a prefill node,
the receiver opens the granted blocks to that node's writes alone
(``WriteGrants``, the transfer engine's write grants), and closes them the
moment the call ends, answered or not; a write outside them, from another
node, or later, is refused. A node that did not answer may still have
written them while its grant was live (a peer that mapped the memory over
shm or RDMA is bounded only by the grant's expiry), so the load's result
tells the scheduler to keep those blocks from everyone until then (a
``BlockHold``): a request whose prefill failed computes into fresh blocks,
and an aborted one leaves them held. The pool owns the hold and lets it go.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from mooncaked.engine.connector import NO_HIT, BlockHold, KVConnector, KVHit, LoadResult
from mooncaked.engine.handoff import (
    HandoffStats,
    PrefillBusy,
    PrefillCall,
    PrefillError,
    PrefillReply,
    WriteGrants,
)
from mooncaked.engine.late_binding import PrefillWalk
from mooncaked.engine.offload.direct import DirectHandoff
from mooncaked.engine.offload.wire import OffloadError
from mooncaked.engine.plan import LoadJob
from mooncaked.handoff import (
    MAX_KV_READY_IN_S,
    KVGrant,
    KVLayout,
    PrefillSource,
    PrefillTarget,
)
from mooncaked.request import Request

log = structlog.get_logger(__name__)

__all__ = ["GRANT_GRACE_S", "KVReceiver"]

# A prefill node's late writes land by the grant's deadline; this much more
# covers the time the grant spent in flight to it.
GRANT_GRACE_S = 2.0

# The grant a prefill node is asked with, and the handles that end it.
OpenGrant = Callable[[PrefillTarget], Awaitable[tuple[KVGrant, list[object]]]]


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
        direct: DirectHandoff | None = None,
    ) -> None:
        """``write_grants`` opens the granted blocks to the asked node's writes;
        None where nothing enforces grants (tests of the engine alone).
        ``direct``: an offloading node's handoffs into its memory nodes."""
        self.node_id = node_id
        self.transfer_address = transfer_address
        self.segment = segment
        self.layout = layout
        self._prefill = prefill
        self.grant_ttl_s = grant_ttl_s
        self._write_grants = write_grants
        self._direct = direct
        # Requests whose handoff ran already (a failed one is computed here).
        self._tried: set[str] = set()
        self.stats = HandoffStats()

    def lookup(self, req: Request, num_computed_tokens: int) -> KVHit | None:
        if req.handoff.source is None or req.request_id in self._tried:
            return NO_HIT
        if req.num_output_tokens:
            return NO_HIT  # a preempted request recomputes here
        # An abort may cut the call short: the result holds the blocks.
        return KVHit(req.num_tokens - num_computed_tokens, cancellable=True)

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
            ttl_s=self._grant_ttl(req),
        )
        direct = self._direct_address(req, job, source)
        if direct:
            result = await self._load_direct(req, job, source, direct, grant.ttl_s)
            if result is not None:
                return result

        async def open_local(target: PrefillTarget) -> tuple[KVGrant, list[object]]:
            return grant, self._open_grants(grant, target)

        try:
            reply = await self._ask(req, job, source, open_local)
        except asyncio.CancelledError:
            # An abort: the load ends now, with a result like any other.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            self.stats.cancelled += 1
            return LoadResult(0, hold=self._until_expired(job, grant, swap=False))
        if reply is None:
            self.stats.fell_back += 1
            # A failed prefill node may still write the granted blocks until
            # the grant expires: compute into fresh blocks, those stay held.
            hold = self._until_expired(job, grant, swap=True)
            return LoadResult(0, prefill_node=self.node_id, hold=hold)
        return LoadResult(
            num_tokens=job.num_tokens,
            sampled=reply.token,
            num_cached_tokens=reply.num_cached_tokens,
            prefill_node=reply.node_id,
        )

    def _direct_address(self, req: Request, job: LoadJob, source: PrefillSource) -> str:
        """The memory node a direct handoff writes into ("": none). The whole
        prompt must come from outside (a prefix hit here is in local blocks
        and goes up with an upload), and no pipelined group writes it."""
        if self._direct is None or job.first_block or job.num_tokens != req.num_tokens:
            return ""
        if any(t.stages for t in source.targets):
            return ""
        return self._direct.address_for(req.memory_node or "")

    async def _load_direct(
        self, req: Request, job: LoadJob, source: PrefillSource, address: str, ttl_s: float
    ) -> LoadResult | None:
        """The prompt's KV written into the memory node at ``address``; None
        when it was not (the caller goes on with a local grant)."""
        direct = self._direct
        if direct is None:
            return None
        n, rid = job.num_tokens, req.request_id
        link = None
        try:
            link = await direct.open(address)
            opened = link

            async def open_remote(target: PrefillTarget) -> tuple[KVGrant, list[object]]:
                return await opened.reserve(rid, n, target.node_id, ttl_s), []

            reply = await self._ask(req, job, source, open_remote)
            if reply is None:
                return None
            await link.fill(rid, n)
        except OffloadError as exc:
            self.stats.direct_failed += 1
            log.warning("direct handoff failed; granting here", request_id=rid, error=str(exc))
            return None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            # The job's blocks were never granted: nothing to hold.
            self.stats.cancelled += 1
            return LoadResult(0)
        finally:
            if link is not None:
                await link.close()
        direct.adopt(address, rid, n)
        self.stats.direct += 1
        return LoadResult(
            num_tokens=n,
            sampled=reply.token,
            num_cached_tokens=reply.num_cached_tokens,
            prefill_node=reply.node_id,
            kv_remote=True,
        )

    async def _ask(
        self, req: Request, job: LoadJob, source: PrefillSource, open_grant: OpenGrant
    ) -> PrefillReply | None:
        """Offer the request to its prefill candidates in turn; the first reply,
        or None when nobody wrote its KV."""
        walk = PrefillWalk.of(source)
        while (step := walk.next()) is not None:
            i, max_wait = step
            target = source.targets[i]
            if max_wait < 0.0:
                # Slower than the candidates left even idle: not worth a call.
                self.stats.passed_on += 1
                continue
            if target.stages and not _tiles(target, self.layout.num_layers):
                log.warning(
                    "a pipelined group's stages do not hold this model's layers; skipping it",
                    request_id=req.request_id,
                    prefill_node=target.node_id,
                    layers=[(st.layer_lo, st.layer_hi) for st in target.stages],
                )
                continue
            t0 = self.ctx.clock()
            try:
                grant, opened = await open_grant(target)
            except ValueError as exc:
                # Nothing could write the blocks: no node is worth asking.
                log.error("cannot open a KV grant; computing it here", error=str(exc))
                return None
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
                last = i + 1 >= len(source.targets)
                log.warning(
                    "prefill failed; computing it here"
                    if last
                    else "prefill failed; trying the next node",
                    request_id=req.request_id,
                    prefill_node=target.node_id,
                    error=str(exc),
                )
                self.stats.retried += not last
                continue
            finally:
                # Whatever the outcome, this node writes no more: a late write
                # (a timed-out node still sending) is refused, not landed in
                # blocks the next node or this one now fills.
                if self._write_grants is not None:
                    for handle in opened:
                        self._write_grants.close(handle)
            self.stats.ok += 1
            log.info(
                "kv handoff done",
                request_id=req.request_id,
                prefill_node=reply.node_id,
                tokens=job.num_tokens,
                kv_bytes=reply.bytes_sent,
                cached_tokens=reply.num_cached_tokens,
                seconds=round(self.ctx.clock() - t0, 4),
            )
            return reply
        return None

    def _open_grants(self, grant: KVGrant, target: PrefillTarget) -> list[object]:
        """The grant opened to the target's writes: a prefill node's to all
        layers, each stage's of a pipelined group to its own layers alone."""
        if self._write_grants is None:
            return []
        # As long as the blocks stay held for a node that failed.
        ttl = grant.ttl_s + GRANT_GRACE_S
        if not target.stages:
            return [self._write_grants.open(grant, target.node_id, ttl)]
        opened: list[object] = []
        try:
            for stage in target.stages:
                layers = (stage.layer_lo, stage.layer_hi)
                opened.append(self._write_grants.open(grant, stage.node_id, ttl, layers))
        except BaseException:
            for handle in opened:
                self._write_grants.close(handle)
            raise
        return opened

    def _grant_ttl(self, req: Request) -> float:
        """How long a prefill node may write a request's blocks: ``grant_ttl_s``,
        or twice the time its placement forecast the prompt's KV to take when
        that is longer. A long prompt on a slow node must not fail over for
        taking long (and be computed twice): a node that is lost or frozen is
        cut by gossip (``MemberWatch``), not by the grant."""
        ttl = self.grant_ttl_s
        ready = req.handoff.kv_ready_at
        if ready > 0.0:
            ttl = max(ttl, min(MAX_KV_READY_IN_S, 2.0 * (ready - self.ctx.clock())))
        return ttl

    def _until_expired(self, job: LoadJob, grant: KVGrant, swap: bool) -> BlockHold:
        """The job's blocks, kept from everyone until no grant of them is live."""
        until = self.ctx.clock() + grant.ttl_s + GRANT_GRACE_S
        return BlockHold(tuple(job.block_ids), until, swap=swap)

    def request_finished(self, req: Request) -> None:
        self._tried.discard(req.request_id)


def _tiles(target: PrefillTarget, num_layers: int) -> bool:
    """Whether the target's stages hold layers 0..num_layers, each once, in order."""
    at = 0
    for stage in target.stages:
        if stage.layer_lo != at or stage.layer_hi <= at:
            return False
        at = stage.layer_hi
    return at == num_layers
