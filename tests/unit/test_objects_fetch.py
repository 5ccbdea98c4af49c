"""Fetching objects between in-process nodes (real transfer engines on loopback,
swarm calls routed in process): shared load, corrupt and lost holders, the
origin out of reach, deadlines, restarts and removal."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from mooncaked.config import Config, with_overrides
from mooncaked.objects.catalog import Copy, Entry
from mooncaked.objects.fetch import Fetch, FetchFailed
from mooncaked.objects.messages import SwarmAnswer, SwarmCall
from mooncaked.objects.peers import SwarmError
from mooncaked.objects.replica import Replica
from mooncaked.objects.service import ObjectNotFound, ObjectStore
from mooncaked.transfer import TransferEngine

SECRET = b"objects-unit-secret-of-some-length"
SHARD = 4096


class Router:
    """Swarm calls to ``http://<node id>``, straight into that node's store."""

    def __init__(self) -> None:
        self.stores: dict[str, ObjectStore] = {}

    async def call(self, peer: str, body: SwarmCall, timeout_s: float) -> SwarmAnswer:
        store = self.stores.get(peer.removeprefix("http://"))
        if store is None:
            raise SwarmError(f"{peer}: connection refused")
        try:
            return await store.answer(body)
        except ObjectNotFound as exc:
            raise SwarmError(str(exc), 404) from None


class Nodes:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.router = Router()
        self.engines: dict[str, TransferEngine] = {}
        self.stores: dict[str, ObjectStore] = {}

    def config(self, node: str, **objects: Any) -> Config:
        return with_overrides(
            Config(),
            node={"id": node, "data_dir": str(self.tmp / node)},
            transfer={"transports": objects.pop("transports", ["tcp"])},
            objects={"shard_bytes": SHARD, "peers": ["http://a"], **objects},
        )

    async def start(self, node: str, **objects: Any) -> ObjectStore:
        cfg = self.config(node, **objects)
        engine = self.engines.get(node)
        if engine is None:
            engine = TransferEngine(cfg.transfer, node, SECRET)
            await engine.start()
            self.engines[node] = engine
        store = ObjectStore(
            cfg,
            node_id=lambda: node,
            secret=SECRET,
            transfer=engine,
            view=lambda: None,
            api_addr=lambda: node,
            rng=random.Random(node),
            client=self.router,
        )
        await store.start()
        self.stores[node] = self.router.stores[node] = store
        return store

    async def stop(self, node: str, *, engine: bool = True) -> None:
        self.router.stores.pop(node, None)
        store = self.stores.pop(node, None)
        if store is not None:
            await store.close()
        if engine:
            e = self.engines.pop(node, None)
            if e is not None:
                await e.close()

    async def close(self) -> None:
        for node in list(self.stores):
            await self.stop(node)
        for e in self.engines.values():
            await e.close()


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[Nodes]:
    n = Nodes(tmp_path)
    try:
        yield n
    finally:
        await n.close()


def blob(tmp_path: Path, size: int = 20 * SHARD + 123) -> Path:
    path = tmp_path / "src" / "blob.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(random.Random(size).randbytes(size))
    return path


def flip(path: Path, offset: int) -> None:
    """Inverts three bytes of the file at ``offset``, in place."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        old = fh.read(3)
        fh.seek(offset)
        fh.write(bytes(b ^ 0xFF for b in old))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def fetched(store: ObjectStore, name: str = "blob") -> tuple[Replica, dict[str, Any]]:
    job = await store.get(name)
    replica = await asyncio.wait_for(job.result, 60)
    return replica, job.progress()


async def test_nodes_joining_together_share_the_load(nodes: Nodes, tmp_path: Path) -> None:
    src = blob(tmp_path, 64 * SHARD)
    a = await nodes.start("a")
    m = await a.put("blob", src)
    assert m.num_shards == 64 and m.origin == "a"
    fetchers = [await nodes.start(n, transports=["shm", "tcp"]) for n in ("b", "c", "d")]
    results = await asyncio.gather(*(fetched(s) for s in fetchers))
    from_origin = 0
    for replica, progress in results:
        assert digest(replica.path) == digest(src)
        assert progress["state"] == "done" and progress["corrupt"] == 0
        assert sum(progress["bytes_from"].values()) == m.size
        from_origin += progress["bytes_from"].get("a", 0)
    # Each shard from the origin about once; the peers serve each other the rest.
    assert from_origin <= 1.5 * m.size, from_origin / m.size
    listing = {e["name"]: e for e in a.listing()}
    assert listing["blob"]["local"] == {"state": "origin", "path": str(src)}
    assert a.status()["coordinating"]["blob"]["fetchers"] == 3


async def test_every_fetch_reads_the_origin_when_peers_do_not_serve(
    nodes: Nodes, tmp_path: Path
) -> None:
    src = blob(tmp_path)
    a = await nodes.start("a")
    m = await a.put("blob", src)
    fetchers = [await nodes.start(n, serve_fetched=False) for n in ("b", "c")]
    for replica, progress in await asyncio.gather(*(fetched(s) for s in fetchers)):
        assert digest(replica.path) == digest(src)
        assert progress["bytes_from"] == {"a": m.size}
    assert fetchers[0].ads() == []


async def test_a_corrupt_shard_is_fetched_again_from_another_holder(
    nodes: Nodes, tmp_path: Path
) -> None:
    src = blob(tmp_path)
    a = await nodes.start("a")
    m = await a.put("blob", src)
    b = await nodes.start("b")
    b_copy, _ = await fetched(b)
    # Flip bytes of shard 3 in b's file: b still says it holds it.
    flip(b_copy.path, 3 * SHARD + 10)
    c = await nodes.start("c")
    replica, progress = await fetched(c)
    assert digest(replica.path) == digest(src)
    # b is the peer, so every shard is read from it first: shard 3 fails its
    # check and comes from the origin.
    assert progress["corrupt"] == 1
    assert progress["bytes_from"] == {"b": m.size - SHARD, "a": SHARD}


async def test_a_holder_that_is_gone_is_left_out(nodes: Nodes, tmp_path: Path) -> None:
    src = blob(tmp_path)
    a = await nodes.start("a")
    m = await a.put("blob", src)
    b = await nodes.start("b")
    await fetched(b)
    await nodes.stop("b")  # its store and its transfer engine: reads from it fail
    c = await nodes.start("c", shard_timeout_s=5.0)
    replica, progress = await fetched(c)
    assert digest(replica.path) == digest(src)
    assert progress["failed_reads"] >= 1
    assert progress["bytes_from"] == {"a": m.size}


async def test_without_the_origin_the_holders_gossip_names_serve(
    nodes: Nodes, tmp_path: Path
) -> None:
    src = blob(tmp_path)
    a = await nodes.start("a")
    m = await a.put("blob", src)
    b = await nodes.start("b")
    b_copy, _ = await fetched(b)
    await nodes.stop("a")
    c = await nodes.start("c")
    replica = await asyncio.to_thread(Replica.open_copy, c.disk, m, serves=True, verify=False)
    replica.register(nodes.engines["c"])
    entry = Entry(m, {"b": Copy("b", b_copy.have.copy(), nodes.engines["b"].address)})
    fetch = make_fetch(nodes, c, replica, catalog=lambda: entry)
    await fetch.run()
    assert digest(replica.path) == digest(src)
    assert fetch.progress.bytes_from == {"b": m.size} and fetch.progress.state == "done"
    replica.close(nodes.engines["c"])


def make_fetch(
    nodes: Nodes, store: ObjectStore, replica: Replica, catalog: Callable[[], Entry | None]
) -> Fetch:
    return Fetch(
        replica,
        node_id="c",
        config=store.config,
        transfer=nodes.engines["c"],
        client=nodes.router,
        origin_url=lambda: "http://a",
        catalog=catalog,
        on_held=lambda shard: None,
        rng=random.Random(0),
    )


async def test_a_fetch_nobody_can_serve_fails_at_its_deadline(nodes: Nodes, tmp_path: Path) -> None:
    src = blob(tmp_path)
    a = await nodes.start("a")
    await a.put("blob", src)
    # The origin answers calls but its transfer endpoint is gone.
    await nodes.engines["a"].close()
    c = await nodes.start("c", fetch_timeout_s=1.0, shard_timeout_s=0.5)
    job = await c.get("blob")
    with pytest.raises(FetchFailed, match=r"'blob': 0 of 21 shards after 1 s"):
        await asyncio.wait_for(job.result, 30)
    assert job.progress()["state"] == "failed"
    with pytest.raises(ObjectNotFound, match="no node knows an object named 'nothing'"):
        await c.get("nothing", locate_timeout_s=0.1)


async def test_copies_survive_a_restart_and_a_torn_journal_costs_a_refetch(
    nodes: Nodes, tmp_path: Path
) -> None:
    src = blob(tmp_path)
    a = await nodes.start("a")
    m = await a.put("blob", src)
    b = await nodes.start("b")
    await fetched(b)
    await nodes.stop("b", engine=False)
    b = await nodes.start("b")
    job = await b.get("blob")
    assert job.fetch is None and (await job.result).complete
    await nodes.stop("b", engine=False)
    # The last record torn, and shard 0 flipped on disk.
    journal = b.disk.journal_path(m)
    journal.write_bytes(journal.read_bytes()[:-3])
    path = b.disk.data_dir(m) / "blob.bin"
    flip(path, 0)
    b = await nodes.start("b", verify_on_start=True)
    replica, progress = await fetched(b)
    assert digest(replica.path) == digest(src)
    assert progress["shards_done"] == m.num_shards
    assert progress["bytes_from"] == {"a": 2 * SHARD}  # shard 0 and the torn one
    # The origin's registration survives its restart too, as it was.
    await nodes.stop("a", engine=False)
    a = await nodes.start("a")
    assert a.listing()[0]["version"] == m.version and a.listing()[0]["local"]["state"] == "origin"


async def test_remove_drops_copies_and_withdraws_segments(nodes: Nodes, tmp_path: Path) -> None:
    src = blob(tmp_path)
    a = await nodes.start("a")
    m = await a.put("blob", src)
    # The same unchanged path again: the same version; changed: a new one.
    assert (await a.put("blob", src)).version == m.version
    os.utime(src, ns=(1, 1))
    m2 = await a.put("blob", src)
    assert m2.version > m.version
    b = await nodes.start("b")
    replica, _ = await fetched(b)
    assert replica.manifest.version == m2.version
    assert nodes.engines["b"].segment(m2.segment(0)) is not None
    out = await b.remove("blob")
    assert out == {"name": "blob", "unregistered": None, "dropped": [m2.version]}
    assert not b.disk.copy_dir(m2).exists()
    assert nodes.engines["b"].segment(m2.segment(0)) is None
    with pytest.raises(ObjectNotFound):
        await b.remove("blob")
    assert (await a.remove("blob"))["unregistered"] == m2.version
    assert nodes.engines["a"].segments() == [] and src.exists()
    with pytest.raises(ValueError, match="must be absolute"):
        await a.put("blob", "relative/path")
