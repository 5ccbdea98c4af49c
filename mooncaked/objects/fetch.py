"""One object fetched onto this node: shards from any holder, a bounded number
at a time, each checked as it lands, failures fetched again elsewhere.

The loop, until every shard is held or the fetch's deadline passes:

1. ask for up to ``max_fetches - reading`` shards: the object's origin
   (``SwarmCall``; it knows what every fetcher holds and reads), or, when the
   origin cannot be reached, ``plan.assign`` over what gossip says each node
   holds (``Catalog``);
2. read each from its holder with the transfer engine (one READ per file the
   shard spans, straight into this copy's mapped file), within
   ``shard_timeout_s``;
3. check it against its checksum, write it back, journal it
   (``Replica.keep``): from then on it is held, advertised and served;
4. a read that failed leaves its holder out for ``_AVOID_S``, a shard that
   failed its check leaves that (shard, holder) out for good: the shard goes
   back to be fetched from another holder.

With nothing to read and nothing handed out (nobody reachable has what is
missing), the fetch asks again after a back-off that doubles up to
``_MAX_BACKOFF_S``. Progress (shards, bytes, bytes per holder, bad shards)
is in ``progress`` and each change wakes ``changed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from mooncaked.config import ObjectsConfig
from mooncaked.objects.catalog import Entry
from mooncaked.objects.messages import Grant, SwarmCall
from mooncaked.objects.peers import SwarmCaller, SwarmError
from mooncaked.objects.plan import Holder, assign
from mooncaked.objects.replica import Replica
from mooncaked.transfer import TransferEngine

log = structlog.get_logger(__name__)

# A holder whose read failed (unreachable, timed out) is left out this long.
_AVOID_S = 10.0
# After a call to the origin failed, gossip alone is asked this long.
_ORIGIN_RETRY_S = 1.0
_MIN_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0
# A swarm call's own time limit, beyond what the origin may hold it for.
_CALL_TIMEOUT_S = 10.0
# The longest an idle fetcher lets the origin hold its call.
_MAX_WAIT_S = 30.0


class FetchFailed(Exception):
    """The fetch ended without the whole object (deadline, or nobody has it)."""


@dataclass(slots=True)
class Progress:
    name: str
    version: int
    size: int
    num_shards: int
    shards_done: int = 0
    bytes_done: int = 0
    # Bytes read from each holder by this fetch.
    bytes_from: dict[str, int] = field(default_factory=dict)
    # Shards that failed their check, reads that failed.
    corrupt: int = 0
    failed_reads: int = 0
    state: str = "fetching"
    error: str = ""
    started: float = field(default_factory=time.monotonic)
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "version": self.version,
            "size": self.size,
            "num_shards": self.num_shards,
            "shards_done": self.shards_done,
            "bytes_done": self.bytes_done,
            "bytes_from": dict(self.bytes_from),
            "corrupt": self.corrupt,
            "failed_reads": self.failed_reads,
            "state": self.state,
            "elapsed_s": round(self.elapsed_s, 3),
            # Only once it failed: a stream event with an "error" is a failure.
            **({"error": self.error} if self.error else {}),
        }


@dataclass(frozen=True, slots=True)
class _Outcome:
    grant: Grant
    ok: bool
    # "corrupt" (its check failed) or the read's failure.
    reason: str = ""


class Fetch:
    """Fetches ``replica``'s missing shards. ``origin_url`` names the origin's
    API (None: not known yet, then looked up in ``catalog`` each time)."""

    def __init__(
        self,
        replica: Replica,
        *,
        node_id: str,
        config: ObjectsConfig,
        transfer: TransferEngine,
        client: SwarmCaller,
        origin_url: Callable[[], str | None],
        catalog: Callable[[], Entry | None],
        on_held: Callable[[int], None],
        rng: random.Random,
    ) -> None:
        self.replica = replica
        m = replica.manifest
        self.progress = Progress(m.name, m.version, m.size, m.num_shards)
        self.progress.shards_done = len(replica.have)
        self.progress.bytes_done = sum(m.shard_length(i) for i in replica.have)
        self.changed = asyncio.Event()
        self._node_id = node_id
        self._config = config
        self._transfer = transfer
        self._client = client
        self._origin_url = origin_url
        self._catalog = catalog
        self._on_held = on_held
        self._rng = rng
        self._reading: dict[asyncio.Task[_Outcome], Grant] = {}
        self._avoid: set[tuple[int, str]] = set()
        self._avoid_nodes: dict[str, float] = {}
        self._origin_failed_at = -1e9

    async def run(self) -> None:
        """Until the copy is whole; FetchFailed at the deadline. Reads still in
        flight when it fails are cancelled (their shards were not kept)."""
        p = self.progress
        failure: FetchFailed | None = None
        try:
            async with asyncio.TaskGroup() as reads:
                try:
                    await self._loop(reads)
                except FetchFailed as exc:
                    # Raised past the group, it would come out wrapped in a group.
                    failure = exc
                    for task in self._reading:
                        task.cancel()
        except asyncio.CancelledError:
            p.state, p.error = "cancelled", "the node is stopping or the object was removed"
            raise
        finally:
            self._reading.clear()
            p.elapsed_s = time.monotonic() - p.started
            self.wake()
        if failure is not None:
            p.state, p.error = "failed", str(failure)
            self.wake()
            raise failure
        await self._report_done()
        p.state = "done"
        self.wake()

    async def _loop(self, reads: asyncio.TaskGroup) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.fetch_timeout_s
        backoff = _MIN_BACKOFF_S
        while not self.replica.complete:
            left = deadline - loop.time()
            if left <= 0:
                raise FetchFailed(self._why_not())
            free = self._config.max_fetches - len(self._reading)
            grants = await self._ask(free, left) if free > 0 else []
            for g in grants:
                self._reading[reads.create_task(self._read(g))] = g
            if not self._reading:
                if not grants:
                    # Nobody reachable has what is missing: ask again later.
                    await asyncio.sleep(min(backoff, left))
                    backoff = min(2 * backoff, _MAX_BACKOFF_S)
                continue
            backoff = _MIN_BACKOFF_S
            done, _ = await asyncio.wait(
                self._reading, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                self._reading.pop(task)
                self._settle(task.result())

    def _why_not(self) -> str:
        p = self.progress
        return (
            f"{p.name!r}: {p.shards_done} of {p.num_shards} shards after "
            f"{self._config.fetch_timeout_s:g} s ({p.corrupt} failed their check, "
            f"{p.failed_reads} reads failed)"
        )

    # -- what to read ---------------------------------------------------------

    async def _ask(self, slots: int, left: float) -> list[Grant]:
        loop = asyncio.get_running_loop()
        url = self._origin_url()
        if url is not None and loop.time() - self._origin_failed_at >= _ORIGIN_RETRY_S:
            try:
                return await self._ask_origin(url, slots, left)
            except SwarmError as exc:
                self._origin_failed_at = loop.time()
                log.warning(
                    "object origin unreachable; choosing holders from gossip",
                    object=self.progress.name,
                    error=str(exc),
                )
        return self._ask_gossip(slots)

    def _call(self, slots: int, wait_s: float) -> SwarmCall:
        r = self.replica
        now = asyncio.get_running_loop().time()
        return SwarmCall(
            name=r.manifest.name,
            version=r.manifest.version,
            node=self._node_id,
            address=self._transfer.address,
            have=r.have.hex(),
            serves=r.serves,
            fetching=tuple(sorted(g.shard for g in self._reading.values())),
            avoid=tuple(sorted(self._avoid)),
            avoid_nodes=tuple(n for n, until in self._avoid_nodes.items() if until > now),
            slots=slots,
            wait_s=wait_s,
        )

    async def _ask_origin(self, url: str, slots: int, left: float) -> list[Grant]:
        idle = not self._reading
        wait_s = min(left, _MAX_WAIT_S) if idle else 0.0
        call = self._call(slots, wait_s)
        answer = await self._client.call(url, call, wait_s + _CALL_TIMEOUT_S)
        if not answer.coordinator:
            # It unregistered this version (or another node answers there now).
            raise SwarmError(f"{url} no longer coordinates {self.progress.name!r}")
        return [g for g in answer.assign if g.shard not in self.replica.have]

    def _ask_gossip(self, slots: int) -> list[Grant]:
        entry = self._catalog()
        if entry is None:
            return []
        now = asyncio.get_running_loop().time()
        uploads: dict[str, int] = {}
        for g in self._reading.values():
            uploads[g.node] = uploads.get(g.node, 0) + 1
        reading = {g.shard for g in self._reading.values()}
        origin = self.replica.manifest.origin
        holders = [
            Holder(c.node_id, c.have, is_origin=c.node_id == origin)
            for c in entry.copies.values()
            if c.node_id != self._node_id
        ]
        picks = assign(
            missing=[i for i in self.replica.have.missing() if i not in reading],
            holders=holders,
            uploads=uploads,
            claimed=(),
            slots=slots,
            max_uploads=self._config.max_uploads,
            rng=self._rng,
            # Nothing tells this fetcher what others read: no reason to wait.
            duplicates=True,
            avoid=self._avoid,
            avoid_nodes={n for n, until in self._avoid_nodes.items() if until > now},
        )
        return [Grant(p.shard, p.holder, entry.copies[p.holder].address) for p in picks]

    # -- reading --------------------------------------------------------------

    async def _read(self, grant: Grant) -> _Outcome:
        replica = self.replica
        try:
            self._transfer.add_peer(grant.node, grant.address)
            ops = replica.files.read_ops(grant.shard, grant.node)
            batch = await self._transfer.submit(ops, op_timeout_s=self._config.shard_timeout_s)
            try:
                ok = await batch.wait()
            except asyncio.CancelledError:
                # The copy may be closed next: let nothing land in it after.
                batch.cancel("the fetch was cancelled")
                with contextlib.suppress(asyncio.CancelledError):
                    await batch.wait()
                raise
            if not ok:
                reasons = "; ".join(r for _, r in batch.failures())
                return _Outcome(grant, False, reasons or "read failed")
        except ValueError as exc:  # a bad address, a segment the holder lacks
            return _Outcome(grant, False, str(exc))
        if not await asyncio.to_thread(replica.keep, grant.shard):
            return _Outcome(grant, False, "corrupt")
        return _Outcome(grant, True)

    def _settle(self, outcome: _Outcome) -> None:
        g, p = outcome.grant, self.progress
        if outcome.ok:
            self.replica.have.add(g.shard)
            length = self.replica.manifest.shard_length(g.shard)
            p.shards_done = len(self.replica.have)
            p.bytes_done += length
            p.bytes_from[g.node] = p.bytes_from.get(g.node, 0) + length
            self._on_held(g.shard)
        elif outcome.reason == "corrupt":
            p.corrupt += 1
            self._avoid.add((g.shard, g.node))
            log.warning(
                "object shard failed its check; fetching it elsewhere",
                object=p.name,
                shard=g.shard,
                holder=g.node,
            )
        else:
            p.failed_reads += 1
            self._avoid_nodes[g.node] = asyncio.get_running_loop().time() + _AVOID_S
            log.warning(
                "object shard read failed; fetching it elsewhere",
                object=p.name,
                shard=g.shard,
                holder=g.node,
                reason=outcome.reason,
            )
        p.elapsed_s = time.monotonic() - p.started
        self.wake()

    async def _report_done(self) -> None:
        """Tells the origin this node holds it all (it may then hand it out)."""
        url = self._origin_url()
        if url is None:
            return
        try:
            await self._client.call(url, self._call(0, 0.0), _CALL_TIMEOUT_S)
        except SwarmError as exc:
            log.info("object origin not told of the finished copy", error=str(exc))

    def wake(self) -> None:
        """Wakes whoever waits on ``changed`` (and gives them a new one to wait on)."""
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()
