"""Offload placement on real nodes: a memory node and a compute node with
``offload.memory_node = "auto"`` joined by gossip on loopback.

The compute node's Conductor pairs it with the memory node it sees in
gossip: ``/admin/explain`` names the memory node and the offloaded step's
terms, the request reaches the engine carrying the memory node's attention
address (``Request.memory_node``), and the greedy output is the same as a
node without offloading gives. The memory node counts as joined for the
tooling (``wait_joined``) and gossips its pool and read bandwidth.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.integration.clusters import ClusterFactory
from tests.integration.test_attention_offload import complete, prompts

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
    assert status["offload"]["side"] == "compute" and status["offload"]["memory_node"] == "auto"
    assert memory_status["offload"]["side"] == "memory"
    assert local.engine is not None
