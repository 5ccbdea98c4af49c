"""The writer's side of the KV store: put blocks with a replica count, change
it, remove blocks, say where they are, and keep a request's prompt.

``put(hashes, n)``: every block this node holds (DRAM, or the SSD: promoted
first) should be on ``n`` nodes in all. Holders come from gossip's block
index (``cluster/replicas.py``); the nodes that lack blocks are asked in
order of free DRAM. For each: ``reserve`` (inbox rows granted to this node),
one transfer batch writing this node's leased DRAM slots into the rows,
``commit`` with each block's checksum; the holder checks the bytes and
publishes them (``cache/inbox.py``), and its gossip announces them like any
cached block. An inbox smaller than the put takes it in rounds.

``change(hashes, n)``: a put for blocks short of ``n`` holders, then copies
dropped on holders past ``n`` (least free DRAM first, this node last; never
the last copy; pinned copies are kept). ``remove``: every copy this node
knows of, pins and all. Gossip is eventually consistent: a holder this
node has not heard of yet is not counted, and one gone meanwhile is.

``retain(job)`` is the engine's retain hook: a finished request's prompt
blocks are soft-pinned here for the time it asked, and (on the node that
computed them) put with the replica count it asked, counting the decode
node it sent them to as a holder. It runs on a task this object owns.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from mooncaked.cache.hashing import BlockHash
from mooncaked.cache.inbox import Outcome
from mooncaked.cache.ssd import data_crc
from mooncaked.cache.ssd_writer import NO_DEADLINE
from mooncaked.cache.store import TieredStore
from mooncaked.cluster.replicas import holders, plan_drop, plan_put, rank_targets
from mooncaked.cluster.state import ClusterView
from mooncaked.engine.store_connector import RetainJob
from mooncaked.rpc import Target
from mooncaked.tasks import TaskSet
from mooncaked.transfer import OpStatus, TransferEngine, TransferOp
from mooncaked.wire.replicas import (
    CommitBody,
    DropBody,
    ReplicaClient,
    ReplicaError,
    ReserveAnswer,
    ReserveBody,
)

log = structlog.get_logger(__name__)

ViewGetter = Callable[[], ClusterView | None]


@dataclass(slots=True)
class HolderResult:
    """What one node did with this put, change or remove."""

    stored: int = 0
    held: int = 0
    corrupt: int = 0
    # Not reserved (inbox full), not written, or no DRAM slot there.
    failed: int = 0
    dropped: int = 0
    kept_pinned: int = 0
    error: str | None = None


@dataclass(slots=True)
class ReplicaReport:
    replicas: int
    num_blocks: int
    # Blocks this node holds in no tier: it cannot send them.
    missing: int = 0
    # Per block: holders known before, and after what this call did.
    holders_before: list[int] = field(default_factory=list)
    holders_after: list[int] = field(default_factory=list)
    nodes: dict[str, HolderResult] = field(default_factory=dict)

    @property
    def short(self) -> int:
        """Blocks with fewer holders than asked for."""
        return sum(1 for n in self.holders_after if n < self.replicas)

    def to_json(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas,
            "num_blocks": self.num_blocks,
            "missing": self.missing,
            "short": self.short,
            "holders_before": self.holders_before,
            "holders_after": self.holders_after,
            "nodes": {n: dataclasses.asdict(r) for n, r in sorted(self.nodes.items())},
        }


@dataclass(frozen=True, slots=True)
class _Blocks:
    """The blocks of one put as the writer sends them: by index into
    ``hashes``, each leased DRAM slot and its checksum."""

    hashes: list[BlockHash]
    slots: dict[int, int]
    crcs: dict[int, int]
    # Soft-pin the copies for this long where they land (0: not).
    pin_s: float


@dataclass(slots=True)
class ReplicatorStats:
    puts: int = 0
    blocks_sent: int = 0
    blocks_stored: int = 0
    blocks_refused: int = 0
    blocks_dropped: int = 0
    holder_errors: int = 0
    retained: int = 0
    retain_failures: int = 0


class Replicator:
    """Puts, replica changes and removes of one node's KV blocks."""

    def __init__(
        self,
        store: TieredStore,
        transfer: TransferEngine,
        client: ReplicaClient,
        *,
        node_id: Callable[[], str],
        model_id: Callable[[], str],
        view: ViewGetter,
        layout: bytes,
        dram_segment: str,
    ) -> None:
        self._store = store
        self._transfer = transfer
        self._client = client
        self._node_id = node_id
        self._model_id = model_id
        self._view = view
        self._layout = layout
        self._dram_segment = dram_segment
        self._timeout_s = store.config.replica_timeout_s
        self._tasks = TaskSet("replicator")
        self._stats = ReplicatorStats()

    def stats(self) -> ReplicatorStats:
        return dataclasses.replace(self._stats)

    async def close(self) -> None:
        """Wait for retain jobs in flight (each bounded by the replica timeout)."""
        await self._tasks.wait()

    # -- where blocks are --------------------------------------------------------

    def held_by(self, hashes: Sequence[BlockHash], also: Sequence[str] = ()) -> list[set[str]]:
        """Each block's holders: gossip's, with this node's own copies as its
        store says now (gossip may lag), and ``also``."""
        view = self._view()
        out = holders(view, hashes) if view is not None else [set() for _ in hashes]
        me = self._node_id()
        for i, h in enumerate(hashes):
            if self._store.tiers_of(h):
                out[i].add(me)
            else:
                out[i].discard(me)
            out[i].update(also)
        return out

    # -- put -----------------------------------------------------------------------

    async def put(
        self,
        hashes: Sequence[BlockHash],
        replicas: int,
        *,
        also_held_by: Sequence[str] = (),
        pin_s: float = 0.0,
    ) -> ReplicaReport:
        """Copy the blocks until each is on ``replicas`` nodes (this one counts);
        the new copies soft-pinned for ``pin_s`` seconds where they land (0: not)."""
        report, _ = await self._put(list(dict.fromkeys(hashes)), replicas, also_held_by, pin_s)
        return report

    async def _put(
        self,
        hashes: list[BlockHash],
        replicas: int,
        also_held_by: Sequence[str],
        pin_s: float = 0.0,
    ) -> tuple[ReplicaReport, list[set[str]]]:
        """``put``, and each block's holders afterwards."""
        if isinstance(replicas, bool) or replicas < 1:
            raise ValueError(f"replicas must be >= 1 (this node's copy counts), got {replicas!r}")
        self._stats.puts += 1
        await self._promote(hashes)
        held_by = self.held_by(hashes, also_held_by)
        report = ReplicaReport(replicas, len(hashes))
        report.holders_before = [len(h) for h in held_by]
        me = self._node_id()
        report.missing = sum(1 for h in held_by if me not in h)
        view = self._view()
        # Only blocks in DRAM can be written from here: lease them for the whole put.
        sendable = [i for i, h in enumerate(hashes) if self._store.dram.contains(h)]
        short = [i for i in sendable if len(held_by[i]) < replicas]
        if view is None or not short:
            report.holders_after = [len(h) for h in held_by]
            return report, held_by
        lease = self._store.dram.lease([hashes[i] for i in short], f"replicas:{me}", NO_DEADLINE)
        if lease is None or lease.num_blocks != len(short):
            raise RuntimeError("DRAM blocks vanished between the check and the lease")
        try:
            slots = dict(zip(short, lease.slot_ids, strict=True))
            crcs = await asyncio.to_thread(self._checksums, hashes, slots)
            targets = rank_targets(view, self._model_id(), exclude={me})
            plan = plan_put([held_by[i] for i in short], replicas, targets)
            sends = {t: [short[j] for j in idx] for t, idx in plan.items()}
            blocks = _Blocks(hashes, slots, crcs, pin_s)
            results = await asyncio.gather(
                *(self._send(view, t, idx, blocks) for t, idx in sends.items())
            )
        finally:
            self._store.dram.release(lease)
        for (target, _), (result, stored) in zip(sends.items(), results, strict=True):
            report.nodes[target] = result
            for i in stored:
                held_by[i].add(target)
        report.holders_after = [len(h) for h in held_by]
        return report, held_by

    async def _promote(self, hashes: list[BlockHash]) -> None:
        """Bring SSD-only blocks into DRAM, run by run (a peer writes from DRAM)."""
        run: list[BlockHash] = []
        for h in [*hashes, None]:
            if h is not None and not self._store.dram.contains(h) and self._store.tiers_of(h):
                run.append(h)
                continue
            if run:
                await self._store.promote(run, owner="replicas")
                run = []

    def _checksums(self, hashes: list[BlockHash], slots: dict[int, int]) -> dict[int, int]:
        """Worker thread: each leased block's checksum, as the holder will compute it."""
        dram = self._store.dram
        return {i: data_crc(hashes[i], dram.slot(s).numpy()) for i, s in slots.items()}

    async def _send(
        self, view: ClusterView, target: str, indices: list[int], blocks: _Blocks
    ) -> tuple[HolderResult, list[int]]:
        """Write ``indices`` to ``target`` (rounds while its inbox takes some);
        what it did, and the indices it holds now."""
        result = HolderResult()
        done: list[int] = []
        member = view.get(target)
        if member is None or member.state is None:
            result.error = "not in this node's cluster view"
            return result, done
        url, bound = f"http://{member.state.api_addr}", Target(target, member.generation)
        todo = list(indices)
        try:
            while todo:
                body = ReserveBody(
                    self._node_id(),
                    tuple(blocks.hashes[i] for i in todo),
                    self._store.block_bytes,
                    self._layout,
                )
                answer = await self._client.reserve(url, bound, body, self._timeout_s)
                if answer.node_id != target:
                    raise ReplicaError(f"{url} answered as {answer.node_id!r}, not {target!r}")
                held = [todo[k] for k in answer.held]
                result.held += len(held)
                done += held
                if answer.reservation_id == 0:
                    result.failed += len(todo) - len(held)
                    break
                picked = [todo[k] for k in answer.reserved]
                done += await self._write_and_commit(url, bound, answer, picked, blocks, result)
                taken = {*picked, *held}
                todo = [i for i in todo if i not in taken]
        except ReplicaError as exc:
            self._stats.holder_errors += 1
            result.error = str(exc)
            result.failed += len(todo)
            log.warning("replicas.holder_failed", holder=target, error=str(exc))
        return result, done

    async def _write_and_commit(
        self,
        url: str,
        bound: Target,
        answer: ReserveAnswer,
        picked: list[int],
        blocks: _Blocks,
        result: HolderResult,
    ) -> list[int]:
        """One round: the reserved blocks written into their rows, committed;
        the indices the holder keeps."""
        written = await self._write(answer, [blocks.slots[i] for i in picked])
        self._stats.blocks_sent += sum(written)
        body = CommitBody(
            self._node_id(),
            answer.reservation_id,
            tuple(blocks.crcs[i] if ok else None for i, ok in zip(picked, written, strict=True)),
            blocks.pin_s,
        )
        outcomes = (await self._client.commit(url, bound, body, self._timeout_s)).outcomes
        kept: list[int] = []
        counts = dict.fromkeys(Outcome, 0)
        for i, outcome in zip(picked, outcomes, strict=True):
            counts[outcome] += 1
            if outcome in (Outcome.STORED, Outcome.HELD):
                kept.append(i)
        result.stored += counts[Outcome.STORED]
        result.held += counts[Outcome.HELD]
        result.corrupt += counts[Outcome.CORRUPT]
        result.failed += counts[Outcome.NOT_WRITTEN] + counts[Outcome.NO_SLOT]
        self._stats.blocks_stored += counts[Outcome.STORED]
        self._stats.blocks_refused += counts[Outcome.CORRUPT]
        return kept

    async def _write(self, answer: ReserveAnswer, slots: list[int]) -> list[bool]:
        """Write DRAM ``slots`` into the holder's rows; whether each landed."""
        dram, bb = self._store.dram, self._store.block_bytes
        ops = [
            TransferOp.write(
                self._dram_segment, dram.slot_offset(s), answer.node_id, answer.segment, off, bb
            )
            for s, off in zip(slots, answer.offsets, strict=True)
        ]
        try:
            self._transfer.add_peer(answer.node_id, answer.transfer_address)
            batch = await self._transfer.submit(ops, op_timeout_s=self._timeout_s)
            await batch.wait()
        except (OSError, ValueError, RuntimeError) as exc:
            # Nothing landed (or nothing is known to have): the commit says
            # so, and the holder gives the rows back at once.
            log.warning("replicas.write_failed", holder=answer.node_id, error=repr(exc))
            return [False] * len(ops)
        return [st is OpStatus.DONE for st in batch.statuses]

    # -- change and remove -------------------------------------------------------

    async def change(self, hashes: Sequence[BlockHash], replicas: int) -> ReplicaReport:
        """Raise or lower the number of holders of each block to ``replicas``;
        lowering never drops the last copy, nor a pinned one."""
        hashes = list(dict.fromkeys(hashes))
        report, held_by = await self._put(hashes, replicas, ())
        view = self._view()
        if view is None:
            return report
        plan = plan_drop(view, held_by, replicas, keep=self._node_id())
        await self._drop_all(view, plan, hashes, unpin=False, report=report)
        for node, indices in plan.items():
            result = report.nodes.get(node)
            if result is not None and result.error is None:
                for i in indices:
                    report.holders_after[i] -= 1
        return report

    async def remove(self, hashes: Sequence[BlockHash]) -> ReplicaReport:
        """Drop every copy of the blocks this node knows of (pins end)."""
        hashes = list(dict.fromkeys(hashes))
        held_by = self.held_by(hashes)
        report = ReplicaReport(0, len(hashes), holders_before=[len(h) for h in held_by])
        plan: dict[str, list[int]] = {}
        for i, nodes in enumerate(held_by):
            for node in nodes:
                plan.setdefault(node, []).append(i)
        view = self._view()
        await self._drop_all(view, plan, hashes, unpin=True, report=report)
        report.holders_after = [0] * len(hashes)
        return report

    async def _drop_all(
        self,
        view: ClusterView | None,
        plan: dict[str, list[int]],
        hashes: list[BlockHash],
        *,
        unpin: bool,
        report: ReplicaReport,
    ) -> None:
        me = self._node_id()

        async def one(node: str, indices: list[int]) -> None:
            result = report.nodes.setdefault(node, HolderResult())
            body = DropBody(tuple(hashes[i] for i in indices), unpin)
            if node == me:
                pins = self._store.retention.pins
                keep = [] if unpin else [h for h in body.hashes if h in pins]
                result.dropped += self._store.remove([h for h in body.hashes if h not in keep])
                result.kept_pinned += len(keep)
                return
            member = view.get(node) if view is not None else None
            if member is None or member.state is None:
                result.error = "not in this node's cluster view"
                return
            try:
                answer = await self._client.drop(
                    f"http://{member.state.api_addr}",
                    Target(node, member.generation),
                    body,
                    self._timeout_s,
                )
            except ReplicaError as exc:
                self._stats.holder_errors += 1
                result.error = str(exc)
                return
            result.dropped += answer.dropped
            result.kept_pinned += answer.kept_pinned
            self._stats.blocks_dropped += answer.dropped

        await asyncio.gather(*(one(n, idx) for n, idx in plan.items()))

    # -- a request's retention ---------------------------------------------------

    def retain(self, job: RetainJob) -> None:
        """The engine's retain hook: the work runs on a task of this object's."""
        self._tasks.spawn(self._retain(job), name=f"retain-{job.request_id}")

    async def _retain(self, job: RetainJob) -> None:
        me = self._node_id()
        try:
            self._store.pin(job.hashes, ttl_s=job.retain.retain_s, hard=False)
            self._stats.retained += 1
            # Only the node that computed the prompt copies it: the decode
            # node that received it is a holder already, counted as one.
            if job.prefill_node in (None, me) and job.retain.replicas > 1:
                also = (job.sent_to,) if job.sent_to else ()
                await self.put(
                    job.hashes,
                    job.retain.replicas,
                    also_held_by=also,
                    pin_s=job.retain.retain_s,
                )
        except ValueError as exc:
            # The pin budget, mostly: keeping is a favour, the request is done.
            self._stats.retain_failures += 1
            log.warning("replicas.retain_refused", request_id=job.request_id, error=str(exc))
