"""Offload placement on real nodes: a memory node and a compute node with
``offload.memory_node = "auto"`` joined by gossip on loopback.

The compute node's Conductor pairs it with the memory node it sees in
gossip: ``/admin/explain`` names the memory node and the offloaded step's
terms, the request reaches the engine carrying the memory node's attention
address (``Request.memory_node``), the memory node serves its decode
attention (none of its KV is left here), and the greedy output is the same
as a node without offloading gives. The memory node counts as joined for
the tooling (``wait_joined``) and gossips its pool and read bandwidth.

A compute node with two memory nodes (each request names its own, as
placement does, some none) keeps each sequence's KV on its own memory
node; one killed with SIGKILL mid-stream costs recomputes of its
sequences only: every request ends with the text local attention gives
(or an explicit error), the other memory node's sequences are never
uploaded twice, and nothing is left behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp

from mooncakectl.local.config import to_toml
from mooncaked.daemon import Node
from mooncaked.engine.core import EngineCore
from mooncaked.handoff import Handoff
from mooncaked.request import SamplingParams
from tests.conftest import TEST_SECTIONS, make_config, spawn_daemon, wait_until
from tests.integration.clusters import ClusterFactory
from tests.integration.test_attention_offload import (
    _free_port,
    complete,
    memory_config,
    prompts,
)

MEMORY = ("memory", {"offload": {"pool_bytes": 64 << 20, "kv_read_bps": 2e9}})
AUTO = ("both", {"offload": {"memory_node": "auto"}})


async def explain(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> dict[str, Any]:
    async with session.post(
        url + "/admin/explain", json={"prompt": prompt, "max_tokens": 12}
    ) as resp:
        assert resp.status == 200, await resp.text()
        doc: dict[str, Any] = await resp.json()
    return doc


async def test_placement_pairs_the_compute_node_with_the_memory_node(
    cluster_factory: ClusterFactory,
) -> None:
    # The cluster factory waits until every node sees every other as joined:
    # the memory node counts once its attention service is gossiped.
    cluster = await cluster_factory([MEMORY, AUTO, "both"])
    memory, compute, local = cluster.nodes
    server = memory.attention
    assert server is not None and compute.cluster is not None
    seen = compute.cluster.view.get(memory.node_id)
    assert seen is not None and seen.state is not None and seen.state.memory is not None
    info = seen.state.memory
    assert info.attention_addr.endswith(f":{server.address.rpartition(':')[2]}")
    assert info.kv_read_bps == 2e9 and info.total_bytes == 64 << 20 and info.shape is None

    carried: list[str | None] = []
    engine = compute.engine
    assert engine is not None
    engine.finish_listeners.append(lambda req: carried.append(req.memory_node))
    p = prompts(3, seed=11)
    async with aiohttp.ClientSession() as session:
        doc = await explain(session, compute.url, p[0])
        placed = doc["placement"]
        assert placed["decode"] == compute.node_id
        assert placed["memory"] == {"node": memory.node_id, "attention_addr": info.attention_addr}
        terms = placed["offload"]
        assert terms is not None and terms["tbt_s"] == placed["model_tbt_s"]
        assert set(terms) >= {"dense_s", "attention_s", "round_trip_s", "serial_s"}
        assert "attention on memory node" in doc["why"]
        got = [await complete(session, compute.url, x) for x in p]
        want = [await complete(session, local.url, x) for x in p]
        # The node without offloading is told of no memory node.
        plain = await explain(session, local.url, p[0])
        async with session.get(compute.url + "/admin/status") as resp:
            status = await resp.json()
        async with session.get(memory.url + "/admin/status") as resp:
            memory_status = await resp.json()
    assert got == want
    assert carried == [info.attention_addr] * len(p)
    assert plain["placement"]["memory"] is None
    offload = status["offload"]
    assert offload["side"] == "compute" and offload["memory_node"] == "auto"
    # The decode attention ran there, none here.
    served = memory_status["offload"]
    assert served["side"] == "memory"
    assert served["steps"] > 0 and served["layers"] > 0 and served["uploads"] == len(p)
    assert offload["layers"] == served["layers"] and offload["local_fallbacks"] == 0
    await engine.wait_idle()
    assert engine.pool.num_used_blocks == 0 and engine.scheduler.remote == set()
    engine.check_integrity()
    assert local.engine is not None


GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


async def _tokens(engine: EngineCore, prompt: list[int], memory_node: str = "") -> list[int] | str:
    """The request's tokens, or the error it ended with."""
    ids: list[int] = []
    stream = engine.add_request(prompt, GREEDY, handoff=Handoff(memory_node=memory_node))
    async for out in stream:
        ids += out.new_token_ids
        if out.finished and out.error is not None:
            return out.error
    return ids


async def _served(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/admin/status") as resp:
        doc: dict[str, Any] = (await resp.json())["offload"]
    return doc


async def test_a_memory_node_killed_costs_only_its_own_sequences(tmp_path: Path) -> None:
    ports = [_free_port(), _free_port()]
    memories = [
        spawn_daemon(tmp_path / f"memory{i}", to_toml({**TEST_SECTIONS, **memory_config(port)}))
        for i, port in enumerate(ports)
    ]
    doomed, kept = (f"127.0.0.1:{port}" for port in ports)
    compute = Node(
        make_config(offload={"memory_node": "auto", "micro_batches": 2, "timeout_s": 2.0})
    )
    await compute.start()
    try:
        engine = compute.engine
        assert engine is not None and engine.offload is not None
        batch = prompts(15, seed=5)
        # Local attention's tokens first (no memory node named): the reference.
        want = [await _tokens(engine, p) for p in batch]
        assert engine.offload.stats.layers == 0
        # Every third request attends here, the rest on one memory node or the other.
        where = [("", doomed, kept)[i % 3] for i in range(len(batch))]
        stats = engine.offload.stats
        tasks = [
            asyncio.ensure_future(_tokens(engine, p, m)) for p, m in zip(batch, where, strict=True)
        ]
        await wait_until(lambda: stats.layers > 40, "remote attention under way", 60)
        os.kill(memories[0].pid, signal.SIGKILL)
        async with asyncio.timeout(120):
            got = await asyncio.gather(*tasks)
        for tokens, expected in zip(got, want, strict=True):
            assert tokens == expected or (isinstance(tokens, str) and tokens)
        assert sum(isinstance(t, list) for t in got) == len(batch)
        # Only the killed node failed, and only its sequences were lost.
        assert stats.failures >= 1 and stats.last_error.startswith(doomed)
        assert 1 <= stats.lost <= where.count(doomed)
        async with aiohttp.ClientSession() as session:
            served = await _served(session, memories[1].url)
        # Each of the other node's sequences uploaded once: never lost, never moved.
        assert served["uploads"] == where.count(kept) and served["layers"] > 0
        await engine.wait_idle()
        assert engine.pool.num_used_blocks == 0 and engine.scheduler.remote == set()
        engine.check_integrity()
        # Idle, no memory node is held on to.
        await wait_until(
            lambda: engine.offload is not None and engine.offload.clients.num_connections == 0,
            "every memory node's connections closed",
            10,
        )
    finally:
        await compute.stop()
        for memory in memories:
            memory.proc.kill()
            memory.proc.wait()
