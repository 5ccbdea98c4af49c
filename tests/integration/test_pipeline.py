"""Pipelined prefill groups on real nodes (HTTP, gossip, transfer engine on loopback).

A group's stages each hold some of the model's layers; a prompt's chunks flow
through them and each writes its own layers' KV into the decode node's
blocks. Greedy output must be token-identical to one node's and to one
prefill node's, with groups of 2 and 3 stages, on long prompts and on their
cached prefixes; nothing may be left behind (blocks, grants, rows).
"""

from __future__ import annotations

import random
from typing import Any

import aiohttp
import orjson
import pytest

from mooncaked.cache.hashing import block_hashes, layer_hashes
from mooncaked.handoff import PrefillSource, PrefillTarget, StageRef
from mooncaked.request import SamplingParams
from mooncaked.rpc import Target, derive_key, signed_headers
from mooncaked.wire.generate import GenerateBody
from mooncaked.wire.paths import PIPELINE_CHUNK_PATH
from tests.conftest import wait_until
from tests.integration.clusters import Cluster, ClusterFactory, stage
from tests.integration.test_disagg import complete_all

# The builtin model's context is 4,096 positions.
LONG = (1024, 2500, 3500)


def long_prompts(seed: int, lengths: tuple[int, ...] = LONG) -> list[list[int]]:
    """Prompts of ``lengths`` tokens, then the same with new tails: the second
    half reuses the first half's prefixes (cached on every stage)."""
    rng = random.Random(seed)
    first = [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]
    again = [p[: len(p) - 200] + [rng.randrange(3, 250) for _ in range(150)] for p in first]
    return first + again


async def complete_halves(
    cluster: Cluster, batch: list[list[int]]
) -> list[tuple[str, list[float], int, dict[str, str]]]:
    """The first half, then the second (which reuses its prefixes)."""
    half = len(batch) // 2
    return [*await complete_all(cluster, batch[:half]), *await complete_all(cluster, batch[half:])]


def assert_no_leftovers(cluster: Cluster) -> None:
    cluster.assert_clean()
    for n in cluster.nodes:
        assert n.transfer is not None
        assert n.transfer.num_grants == 0, n.node_id
        assert n.transfer.metrics().served_forbidden == 0, n.node_id
        engine = n.engine
        assert (engine is not None and engine.pipe is None) or engine.pipe.status()[
            "inbound_requests"
        ] == 0


def heads(cluster: Cluster) -> set[str]:
    return {
        n.node_id
        for n in cluster.nodes
        if n.config.pipeline.enabled and n.config.pipeline.stage == 0
    }


async def check_group(
    cluster_factory: ClusterFactory,
    stages: list[tuple[str, Any]],
    batch: list[list[int]],
    want: list[tuple[str, list[float], int, dict[str, str]]],
) -> None:
    cluster = await cluster_factory(["decode", *stages])
    got = await complete_halves(cluster, batch)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g[0] == w[0], f"prompt {i} ({len(batch[i])} tokens): {g[0]!r} != {w[0]!r}"
    # Every prompt was pipelined through the group's head.
    assert {h["x-mooncaked-prefill-node"] for *_, h in got} == heads(cluster)
    # The second half started from the prefix every stage cached.
    half = len(batch) // 2
    assert all(cached > 0 for _, _, cached, _ in got[half:]), [g[2] for g in got]
    assert all(cached == 0 for _, _, cached, _ in got[:half])
    for n in cluster.nodes:
        if n.engine is not None and n.engine.pipe is not None:
            st = n.engine.pipe.status()
            assert st["chunks_refused"] == 0 and st["send_failures"] == 0, st
            async with aiohttp.ClientSession() as s, s.get(n.url + "/metrics") as r:
                text = await r.text()
            line = f'mooncaked_pipeline_chunks_total{{outcome="{"sent" if n.engine.span.first else "received"}"}}'
            assert line in text, text[:2000]
    assert_no_leftovers(cluster)


async def test_a_two_stage_group_gives_one_node_s_text(cluster_factory: ClusterFactory) -> None:
    batch = long_prompts(3, (300, 1200))
    solo = await cluster_factory(["both"])
    want = await complete_halves(solo, batch)
    await check_group(
        cluster_factory, [stage("g", 0, 2, chunk_tokens=128), stage("g", 1, 2)], batch, want
    )


@pytest.mark.slow
async def test_groups_of_2_and_3_stages_give_one_prefill_node_s_text(
    cluster_factory: ClusterFactory,
) -> None:
    batch = long_prompts(11)
    solo = await cluster_factory(["both"])
    want = await complete_halves(solo, batch)
    one = await cluster_factory(["prefill", "decode"])
    got = await complete_halves(one, batch)
    assert [g[0] for g in got] == [w[0] for w in want]
    for stages in (
        [stage("g2", i, 2) for i in range(2)],
        # Uneven: 1 + 1 + 2 layers, and chunks of the token budget.
        [stage("g3", i, 3, split=[1, 2], chunk_tokens=0) for i in range(3)],
    ):
        await check_group(cluster_factory, stages, batch, want)


async def test_a_stage_refuses_a_chunk_it_does_not_expect(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = await cluster_factory(["decode", stage("g", 0, 2), stage("g", 1, 2)])
    tail = cluster.nodes[2]
    body = orjson.dumps({"request_id": "nobody@stage1", "seq": 0, "start": 0, "end": 16})
    key = derive_key(tail.config.node.cluster_secret.encode())
    headers = {
        "Content-Type": "application/json",
        **signed_headers(
            key,
            "POST",
            PIPELINE_CHUNK_PATH,
            body,
            target=Target(tail.node_id, tail.services.identity.generation),
        ),
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(tail.url + PIPELINE_CHUNK_PATH, data=body, headers=headers) as r,
    ):
        assert r.status == 409
        assert "runs no request" in (await r.json())["error"]["message"]
    # Unsigned: refused before anything is read.
    async with (
        aiohttp.ClientSession() as s,
        s.post(tail.url + PIPELINE_CHUNK_PATH, data=body) as r,
    ):
        assert r.status == 401
    # A stage is no prefill node of its own.
    explain = cluster.nodes[0].url + "/admin/explain"
    async with aiohttp.ClientSession() as s, s.post(explain, json={"prompt": "x" * 2000}) as r:
        doc = await r.json()
    cands = doc["prefill_candidates"]
    assert [c["node_id"] for c in cands] == [cluster.nodes[1].node_id]
    assert cands[0]["stages"] == [n.node_id for n in cluster.nodes[1:]]
    assert doc["placement"]["prefill"] == [cluster.nodes[1].node_id]


async def test_a_stage_pulls_its_layers_prefix_from_another_group_s_same_stage(
    cluster_factory: ClusterFactory,
) -> None:
    """Group ``b``'s stages hold nothing of a prompt that group ``a`` computed:
    each pulls its own layers' blocks of the prefix from ``a``'s same stage
    (the keys of its layers name them), and computes only the rest."""
    rng = random.Random(23)
    first = [rng.randrange(3, 250) for _ in range(1500)]
    second = first[:1400] + [rng.randrange(3, 250) for _ in range(100)]
    solo = await cluster_factory(["both"])
    want = [text for text, *_ in await complete_halves(solo, [first, second])]
    cluster = await cluster_factory(
        ["decode", stage("a", 0, 2), stage("a", 1, 2), stage("b", 0, 2), stage("b", 1, 2)]
    )
    d, a0, a1, b0, b1 = cluster.nodes

    def target(head: int) -> PrefillTarget:
        refs = tuple(
            StageRef(n.node_id, n.url, n.engine.span.lo, n.engine.span.hi)  # type: ignore[union-attr]
            for n in cluster.nodes[head : head + 2]
        )
        return PrefillTarget(refs[0].node_id, refs[0].url, fetch=True, stages=refs)

    async def generate(prompt: list[int], head: int) -> tuple[str, int, str | None]:
        sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        body = GenerateBody(f"r{head}", prompt, sampling, PrefillSource((target(head),)))
        stream = await d.router.generate.open(d.node_id, d.url, body)
        text, cached, node = "", 0, None
        try:
            async for out in stream:
                text += out.text
                cached = out.num_cached_tokens
                node = out.prefill_node or node
        finally:
            await stream.aclose()
        return text, cached, node

    got, cached, node = await generate(first, 1)
    assert (got, cached, node) == (want[0], 0, a0.node_id)
    # Each of b's stages looks its own layers up in its own view.
    hashes = block_hashes(first, 16, a0.engine.model_id)[:80]  # type: ignore[union-attr]
    for holder, asker, lo, hi in ((a0, b0, 0, 2), (a1, b1, 2, 4)):

        def held(holder: Any = holder, asker: Any = asker, lo: int = lo, hi: int = hi) -> bool:
            view = asker.cluster.view if asker.cluster is not None else None
            run = layer_hashes(hashes, lo, hi)
            return view is not None and view.held_run(holder.node_id, run) >= 80

        await wait_until(held, f"{holder.node_id}'s blocks in {asker.node_id}'s view")
    got, cached, node = await generate(second, 3)
    assert got == want[1] and node == b0.node_id
    assert cached >= 1280, cached
    assert_no_leftovers(cluster)
