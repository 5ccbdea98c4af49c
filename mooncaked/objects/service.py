"""``ObjectStore``: a node's named objects. What it registered (``put``), the
copies it fetched (``get``), the fetches it coordinates as an origin
(``answer``), and what it tells gossip (``ads``).

    async with object_store(config, ...) as store:
        manifest = await store.put("smollm2", "/models/smollm2.gguf")
        job = await store.get("other-model")     # a fetch, or the copy held
        replica = await job.result               # FetchFailed when it fails
        await store.remove("other-model")

Start-up opens what the data directory holds: each registration whose files
are unchanged (size and mtime) is registered again as it was, one whose
files changed is hashed again under a new version, and each fetched copy
resumes from its journal (``objects.verify_on_start``: each journaled shard
is read and checked again first). Every copy's files are registered with the
transfer engine, read-only to peers.

Locating an object: the newest version gossip knows, else the first of
``objects.peers`` that knows it (how a node finds its model before it joins
the cluster); its origin coordinates the fetch, and gossip's ads stand in
when the origin cannot be reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from mooncaked.cluster.state import ClusterView
from mooncaked.config import Config, ConfigError, check_object_name
from mooncaked.objects.catalog import Catalog, Entry
from mooncaked.objects.disk import ObjectsDir, Registration, stamps_of
from mooncaked.objects.fetch import Fetch, FetchFailed, Progress
from mooncaked.objects.files import ObjectFiles, build_manifest, scan
from mooncaked.objects.manifest import Manifest, ShardSet
from mooncaked.objects.messages import ObjectAd, SwarmAnswer, SwarmCall
from mooncaked.objects.peers import SwarmCaller, SwarmClient, SwarmError
from mooncaked.objects.replica import Replica
from mooncaked.objects.swarm import Swarm
from mooncaked.rpc import Target
from mooncaked.tasks import TaskSet
from mooncaked.transfer import TransferEngine

log = structlog.get_logger(__name__)

ViewGetter = Callable[[], ClusterView | None]
Publish = Callable[[list[dict[str, Any]]], None]
# Gossip hears of new shards at most this often (each change is a state bump).
_PUBLISH_DELAY_S = 0.1
# How long a get waits to learn of an object gossip does not know yet.
_LOCATE_TIMEOUT_S = 2.0
_MIN_LOCATE_BACKOFF_S = 0.05
_MAX_LOCATE_BACKOFF_S = 2.0
# A question to one of ``objects.peers`` not answered by then goes to the next.
_PEER_CALL_TIMEOUT_S = 10.0


class ObjectNotFound(LookupError):
    """No node this one can ask knows an object of that name."""


@dataclass(slots=True, eq=False)
class Job:
    """A fetch of one object onto this node, or the copy it already holds."""

    manifest: Manifest
    fetch: Fetch | None
    result: asyncio.Future[Replica]
    # Said every tenth of the object, for the logs.
    logged_tenths: int = field(default=0)

    def progress(self) -> dict[str, Any]:
        if self.fetch is not None:
            return self.fetch.progress.to_dict()
        m = self.manifest
        held = Progress(m.name, m.version, m.size, m.num_shards, m.num_shards, m.size)
        held.state = "done"
        return held.to_dict()


class ObjectStore:
    def __init__(
        self,
        config: Config,
        *,
        node_id: Callable[[], str],
        secret: bytes,
        transfer: TransferEngine,
        view: ViewGetter,
        api_addr: Callable[[], str],
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
        client: SwarmCaller | None = None,
    ) -> None:
        """``client`` (tests): how swarm calls reach other nodes, instead of HTTP."""
        self.config = config.objects
        # What ``objects.share_model`` registers (as the engine loads it).
        self._model_path = os.path.abspath(config.model.path)
        self._node_id = node_id
        self._transfer = transfer
        self._view = view
        self._api_addr = api_addr
        self._rng = rng
        self._clock = clock
        self.disk = ObjectsDir(config.data_dir / "objects")
        self.catalog = Catalog(view, node_id)
        self._http = SwarmClient(secret=secret, targets=self._target_at)
        self._client: SwarmCaller = client if client is not None else self._http
        # By name: what this node registered (one version each), and its swarm.
        self._origins: dict[str, Replica] = {}
        self._registrations: dict[str, Registration] = {}
        self._swarms: dict[str, Swarm] = {}
        # By (name, version): copies fetched (whole or in part), fetches running.
        self._copies: dict[tuple[str, int], Replica] = {}
        self._jobs: dict[tuple[str, int], Job] = {}
        self._tasks = TaskSet("objects")
        self._publish: Publish | None = None
        self._publish_handle: asyncio.TimerHandle | None = None
        self._watched: ClusterView | None = None
        self._lock = asyncio.Lock()

    # -- lifecycle --------------------------------------------------------------

    async def start(self) -> None:
        await self._http.__aenter__()
        for manifest in await asyncio.to_thread(self.disk.copies):
            await self._open_copy(manifest)
        for reg in await asyncio.to_thread(self.disk.registrations):
            await self._reopen(reg)
        if self.config.share_model:
            try:
                await self.put(self.config.share_model, self._model_path)
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"'objects.share_model' = {self.config.share_model!r}: cannot share "
                    f"'model.path' {self._model_path!r}: {exc}"
                ) from None
        log.info(
            "objects started",
            registered=sorted(self._origins),
            copies=[f"{n}@{v}" for n, v in sorted(self._copies)],
        )

    async def close(self) -> None:
        self.detach()
        self._tasks.cancel()
        await self._tasks.wait()
        for replica in [*self._origins.values(), *self._copies.values()]:
            with contextlib.suppress(Exception):
                replica.close(self._transfer)
        self._origins.clear()
        self._copies.clear()
        await self._http.__aexit__()

    def attach(self, publish: Publish, view: ClusterView) -> None:
        """Gossip runs: advertise this node's copies through ``publish``, and
        forget the fetchers ``view`` sees go down."""
        self._publish = publish
        self._watched = view
        view.member_watchers.append(self._member_event)
        self._publish_now()

    def detach(self) -> None:
        self._publish = None
        if self._publish_handle is not None:
            self._publish_handle.cancel()
            self._publish_handle = None
        view, self._watched = self._watched, None
        if view is not None and self._member_event in view.member_watchers:
            view.member_watchers.remove(self._member_event)

    # -- put --------------------------------------------------------------------

    async def put(self, name: str, path: str | os.PathLike[str]) -> Manifest:
        """Registers the file or directory at ``path`` as object ``name`` (its
        metadata only: nothing is copied). Putting the same unchanged path under
        the same name again keeps its version; anything else is a new version."""
        check_object_name(name)
        where = Path(path)
        if not where.is_absolute():
            # The daemon's working directory is nobody's business.
            raise ValueError(f"an object's path must be absolute, got {str(path)!r}")
        async with self._lock:
            old = self._registrations.get(name)
            if old is not None and await asyncio.to_thread(_unchanged, old, where):
                return old.manifest
            version = max(int(time.time() * 1000), old.manifest.version + 1 if old else 1)
            manifest, files = await asyncio.to_thread(self._hash, name, version, where)
            await self._register_origin(Registration(manifest, str(where), files[1]), files[0])
            await self._save_registrations()
        log.info(
            "object registered",
            object=name,
            version=manifest.version,
            path=str(where),
            size=manifest.size,
            shards=manifest.num_shards,
        )
        return manifest

    def _hash(
        self, name: str, version: int, where: Path
    ) -> tuple[Manifest, tuple[ObjectFiles, tuple[tuple[int, int], ...]]]:
        scanned = scan(where)
        stamps = stamps_of([scanned.file_path(f) for f in scanned.files])
        manifest, files = build_manifest(
            name,
            version,
            self._node_id(),
            scanned,
            shard_bytes=self.config.shard_bytes,
            algorithm=self.config.checksum,
        )
        return manifest, (files, stamps)

    async def _register_origin(self, reg: Registration, files: ObjectFiles) -> None:
        name = reg.manifest.name
        replica = Replica(reg.manifest, files, ShardSet.full(reg.manifest.num_shards), None)
        old = self._origins.pop(name, None)
        if old is not None:
            self._swarms.pop(name, None)
            old.close(self._transfer)
        replica.register(self._transfer)
        self._origins[name] = replica
        self._registrations[name] = reg
        self._swarms[name] = Swarm(
            reg.manifest,
            me=self._node_id(),
            address=lambda: self._transfer.address,
            config=self.config,
            clock=self._clock,
            rng=self._rng,
        )
        self._changed()

    async def _reopen(self, reg: Registration) -> None:
        where = Path(reg.path)
        try:
            if await asyncio.to_thread(_unchanged, reg, where):
                scanned = await asyncio.to_thread(scan, where)
                files = await asyncio.to_thread(ObjectFiles.origin, reg.manifest, scanned)
                await self._register_origin(reg, files)
                return
            log.info("registered object changed on disk; hashing it again", path=reg.path)
            await self.put(reg.manifest.name, where)
        except (OSError, ValueError) as exc:
            log.warning(
                "registered object dropped", object=reg.manifest.name, path=reg.path, error=str(exc)
            )
            self._registrations.pop(reg.manifest.name, None)
            await self._save_registrations()

    async def _save_registrations(self) -> None:
        await asyncio.to_thread(self.disk.save_registrations, list(self._registrations.values()))

    async def _open_copy(self, manifest: Manifest) -> Replica:
        replica = await asyncio.to_thread(
            Replica.open_copy,
            self.disk,
            manifest,
            serves=self.config.serve_fetched,
            verify=self.config.verify_on_start,
        )
        try:
            replica.register(self._transfer)
        except BaseException:
            replica.close(None)
            raise
        self._copies[manifest.ref] = replica
        self._changed()
        return replica

    # -- get --------------------------------------------------------------------

    async def get(self, name: str, *, locate_timeout_s: float = _LOCATE_TIMEOUT_S) -> Job:
        """The fetch of the newest version of ``name`` (joined if one runs), or
        the copy this node holds; ObjectNotFound when nobody asked within
        ``locate_timeout_s`` knows it."""
        check_object_name(name)
        manifest, origin_url = await self._locate(name, locate_timeout_s)
        ref = manifest.ref
        job = self._jobs.get(ref)
        if job is not None:
            return job
        loop = asyncio.get_running_loop()
        async with self._lock:
            # Looked up again: another get may have started it meanwhile.
            job = self._jobs.get(ref)
            if job is not None:
                return job
            held = self._held(manifest)
            if held is not None:
                done: asyncio.Future[Replica] = loop.create_future()
                done.set_result(held)
                return Job(manifest, None, done)
            replica = self._copies.get(ref) or await self._open_copy(manifest)
            fetch = Fetch(
                replica,
                node_id=self._node_id(),
                config=self.config,
                transfer=self._transfer,
                client=self._client,
                origin_url=lambda: self._origin_url(manifest) or origin_url,
                catalog=lambda: self.catalog.entries(self._own()).get(ref),
                on_held=lambda shard: self._on_held(ref),
                rng=self._rng,
            )
            job = Job(manifest, fetch, loop.create_future())
            # Read here if nobody else does, so an unwatched failure is not reported as lost.
            job.result.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._jobs[ref] = job
            self._tasks.spawn(self._run(job, replica), name=f"objects:fetch:{name}")
        return job

    async def materialize(self, name: str) -> Path:
        """Where object ``name`` is on this node once held (fetched first, if
        need be: progress logged); FetchFailed or ObjectNotFound when it cannot be."""
        log.info("fetching object from peers", object=name)
        job = await self.get(name, locate_timeout_s=self.config.fetch_timeout_s)
        replica = await job.result
        return replica.path

    async def _run(self, job: Job, replica: Replica) -> None:
        fetch = job.fetch
        if fetch is None:
            raise RuntimeError("a job without a fetch has nothing to run")
        p = fetch.progress
        log.info("object fetch started", object=p.name, version=p.version, shards=p.num_shards)
        try:
            await fetch.run()
        except FetchFailed as exc:
            log.error("object fetch failed", object=p.name, error=str(exc))
            if not job.result.done():
                job.result.set_exception(exc)
        except asyncio.CancelledError:
            job.result.cancel()
            raise
        else:
            log.info(
                "object fetched",
                object=p.name,
                version=p.version,
                size=p.size,
                seconds=round(p.elapsed_s, 3),
                bytes_from=p.bytes_from,
                corrupt=p.corrupt,
                failed_reads=p.failed_reads,
            )
            if not job.result.done():
                job.result.set_result(replica)
        finally:
            self._jobs.pop(job.manifest.ref, None)
            # Whoever watches the progress learns that the result is in.
            fetch.wake()
            self._changed()

    def _on_held(self, ref: tuple[str, int]) -> None:
        job = self._jobs.get(ref)
        if job is not None and job.fetch is not None:
            p = job.fetch.progress
            tenths = 10 * p.shards_done // max(1, p.num_shards)
            if tenths > job.logged_tenths:
                job.logged_tenths = tenths
                log.info(
                    "object fetch progress",
                    object=p.name,
                    percent=10 * tenths,
                    shards=f"{p.shards_done}/{p.num_shards}",
                )
        self._changed()

    def _held(self, manifest: Manifest) -> Replica | None:
        """This node's whole copy of ``manifest``, if it has one."""
        origin = self._origins.get(manifest.name)
        if origin is not None and origin.manifest.ref == manifest.ref:
            return origin
        copy = self._copies.get(manifest.ref)
        return copy if copy is not None and copy.complete else None

    async def _locate(self, name: str, timeout_s: float) -> tuple[Manifest, str | None]:
        """The newest manifest of ``name`` and its origin's API URL (if known)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        backoff = _MIN_LOCATE_BACKOFF_S
        while True:
            entry = self.catalog.newest(name, self._own())
            if entry is not None:
                url = self._origin_url(entry.manifest)
                mine = entry.manifest.origin == self._node_id()
                if url is not None or mine or not self.config.peers:
                    return entry.manifest, url
            # Gossip knows no origin to call (it may not run yet): ask the peers.
            found = await self._ask_peers(name)
            if found is not None and (entry is None or found[0].version >= entry.manifest.version):
                return found
            if entry is not None:
                return entry.manifest, None
            if loop.time() + backoff > deadline:
                raise ObjectNotFound(
                    f"no node knows an object named {name!r} (asked gossip and "
                    f"{len(self.config.peers)} configured peers)"
                )
            if backoff == _MIN_LOCATE_BACKOFF_S:
                log.info("object not known yet; asking again until someone knows it", object=name)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, _MAX_LOCATE_BACKOFF_S)

    async def _ask_peers(self, name: str) -> tuple[Manifest, str | None] | None:
        call = SwarmCall(name, 0, self._node_id(), self._transfer.address, "", False)
        for url in self.config.peers:
            try:
                answer = await self._client.call(url, call, _PEER_CALL_TIMEOUT_S)
            except SwarmError as exc:
                if exc.status != 404:
                    log.info("object peer did not answer", peer=url, error=str(exc))
                continue
            if answer.manifest is not None:
                origin = url if answer.coordinator else (answer.redirect or None)
                return answer.manifest, origin
        return None

    def _origin_url(self, manifest: Manifest) -> str | None:
        if manifest.origin == self._node_id():
            return None
        view = self._view()
        member = view.get(manifest.origin) if view is not None else None
        if member is None or not member.is_up or member.state is None:
            return None
        return f"http://{member.state.api_addr}" if member.state.api_addr else None

    # -- remove -----------------------------------------------------------------

    async def remove(self, name: str) -> dict[str, Any]:
        """Unregisters ``name`` here (if this node registered it) and drops
        every local copy of it (a fetch of it running is cancelled first)."""
        check_object_name(name)
        out: dict[str, Any] = {"name": name, "unregistered": None, "dropped": []}
        for ref, job in list(self._jobs.items()):
            if ref[0] == name and not job.result.done():
                job.result.cancel()
        for task in list(self._tasks):
            if task.get_name() == f"objects:fetch:{name}":
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        async with self._lock:
            origin = self._origins.pop(name, None)
            if origin is not None:
                self._swarms.pop(name, None)
                self._registrations.pop(name, None)
                origin.close(self._transfer)
                await self._save_registrations()
                out["unregistered"] = origin.manifest.version
            for ref in [r for r in self._copies if r[0] == name]:
                replica = self._copies.pop(ref)
                replica.close(self._transfer)
                await asyncio.to_thread(self.disk.remove_copy, replica.manifest)
                out["dropped"].append(ref[1])
        if out["unregistered"] is None and not out["dropped"]:
            raise ObjectNotFound(f"this node neither registered nor holds an object named {name!r}")
        self._changed()
        log.info("object removed", **out)
        return out

    # -- the origin's side ------------------------------------------------------

    async def answer(self, call: SwarmCall) -> SwarmAnswer:
        """A fetcher's swarm call; ObjectNotFound if this node knows no such
        object, ValueError for a call that does not fit it."""
        origin = self._origins.get(call.name)
        if origin is not None and not call.have:
            # Asked where it is (``objects.peers``), not for shards.
            return SwarmAnswer(origin.manifest)
        if origin is not None and call.version in (0, origin.manifest.version):
            m = origin.manifest
            have = (
                ShardSet.from_hex(call.have, m.num_shards) if call.have else ShardSet(m.num_shards)
            )
            entry = self.catalog.entries(self._own()).get(m.ref)
            copies = entry.copies.values() if entry is not None else ()
            grants = await self._swarms[call.name].answer(call, have, copies)
            return SwarmAnswer(m if call.version == 0 else None, tuple(grants))
        entry = self._entry(call.name, call.version)
        if entry is None:
            raise ObjectNotFound(
                f"this node knows no object {call.name!r}@{call.version or 'newest'}"
            )
        return SwarmAnswer(
            entry.manifest, coordinator=False, redirect=self._origin_url(entry.manifest) or ""
        )

    def newest(self, name: str) -> Entry | None:
        """The newest version of ``name`` this node knows of, with its copies."""
        return self.catalog.newest(name, self._own())

    def _entry(self, name: str, version: int) -> Entry | None:
        if version == 0:
            return self.catalog.newest(name, self._own())
        return self.catalog.entries(self._own()).get((name, version))

    # -- what others see ----------------------------------------------------------

    def _own(self) -> list[tuple[ObjectAd, str]]:
        """This node's copies as ads (every one, served or not), with its API address."""
        address, api = self._transfer.address, self._api_addr()
        out = [(r.ad(address), api) for r in self._origins.values()]
        out += [(r.ad(address), api) for r in self._copies.values() if len(r.have)]
        return out

    def ads(self) -> list[dict[str, Any]]:
        """What gossip spreads: the copies this node serves."""
        address = self._transfer.address
        replicas = [*self._origins.values(), *self._copies.values()]
        return [r.ad(address).to_dict() for r in replicas if r.serves and len(r.have)]

    def _changed(self) -> None:
        if self._publish is None or self._publish_handle is not None:
            return
        loop = asyncio.get_running_loop()
        self._publish_handle = loop.call_later(_PUBLISH_DELAY_S, self._publish_now)

    def _publish_now(self) -> None:
        self._publish_handle = None
        if self._publish is not None:
            self._publish(self.ads())

    def _member_event(self, node_id: str, generation: int, up: bool) -> None:
        if not up:
            for swarm in self._swarms.values():
                swarm.forget(node_id)

    def _target_at(self, url: str) -> Target | None:
        view = self._view()
        if view is None:
            return None
        member = view.member_at(url.removeprefix("http://").rstrip("/"))
        return None if member is None else Target(member.node_id, member.generation)

    # -- reading ------------------------------------------------------------------

    def listing(self) -> list[dict[str, Any]]:
        """Every object known, newest first by name: its manifest's summary,
        who holds which shards, and this node's part in it."""
        entries = self.catalog.entries(self._own())
        out: list[dict[str, Any]] = []
        for (name, version), e in sorted(entries.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
            m = e.manifest
            out.append(
                {
                    "name": name,
                    "version": version,
                    "origin": m.origin,
                    "size": m.size,
                    "shard_bytes": m.shard_bytes,
                    "num_shards": m.num_shards,
                    "algorithm": m.algorithm,
                    "digest": m.digest.hex(),
                    "files": len(m.files),
                    "holders": {
                        c.node_id: {"shards": len(c.have), "have": c.have.hex()}
                        for c in sorted(e.copies.values(), key=lambda c: c.node_id)
                    },
                    "local": self._local(m),
                }
            )
        return out

    def _local(self, m: Manifest) -> dict[str, Any] | None:
        origin = self._origins.get(m.name)
        if origin is not None and origin.manifest.ref == m.ref:
            return {"state": "origin", "path": str(origin.path)}
        job = self._jobs.get(m.ref)
        copy = self._copies.get(m.ref)
        if copy is None:
            return None
        state = "fetching" if job is not None else ("complete" if copy.complete else "partial")
        out: dict[str, Any] = {"state": state, "path": str(copy.path), "shards": len(copy.have)}
        if job is not None:
            out["progress"] = job.progress()
        return out

    def whole_copy(self, name: str) -> Replica | None:
        """The newest whole copy of ``name`` on this node (registered or fetched)."""
        found = [
            r
            for r in (*self._origins.values(), *self._copies.values())
            if r.manifest.name == name and r.complete
        ]
        return max(found, key=lambda r: r.manifest.version) if found else None

    def status(self) -> dict[str, Any]:
        return {
            "registered": sorted(self._origins),
            "copies": len(self._copies),
            "fetching": [f"{n}@{v}" for n, v in sorted(self._jobs)],
            "coordinating": {
                n: {
                    "fetchers": s.num_fetchers,
                    "grants": s.stats.grants,
                    "duplicates": s.stats.duplicates,
                }
                for n, s in sorted(self._swarms.items())
            },
        }


def _unchanged(reg: Registration, where: Path) -> bool:
    """Whether the files ``reg`` registered are still as they were."""
    if Path(reg.path) != where:
        return False
    try:
        scanned = scan(where)
    except (OSError, ValueError):
        return False
    if [f.path for f in scanned.files] != [f.path for f in reg.manifest.files]:
        return False
    try:
        return stamps_of([scanned.file_path(f) for f in scanned.files]) == reg.stamps
    except OSError:
        return False


@contextlib.asynccontextmanager
async def object_store(
    config: Config,
    *,
    node_id: Callable[[], str],
    secret: bytes,
    transfer: TransferEngine,
    view: ViewGetter,
    api_addr: Callable[[], str],
    rng: random.Random,
) -> AsyncIterator[ObjectStore]:
    """The node's objects while entered; leaving cancels fetches and withdraws
    every copy's segments."""
    store = ObjectStore(
        config,
        node_id=node_id,
        secret=secret,
        transfer=transfer,
        view=view,
        api_addr=api_addr,
        rng=rng,
    )
    try:
        await store.start()
        yield store
    finally:
        await store.close()
