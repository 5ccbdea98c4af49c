"""The Conductor in real daemons: profiled costs travel by gossip, placement
follows them, SLO rejections are 429s the official client understands, and
``/admin/explain`` / ``mooncakectl explain`` show the decision."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import openai
import pytest

from mooncaked.daemon import Node
from tests.conftest import make_config, wait_until
from tests.integration.clusters import Cluster, ClusterFactory


def costs_known_everywhere(cluster: Cluster) -> bool:
    for n in cluster.nodes:
        view = n.cluster.view if n.cluster is not None else None
        if view is None:
            return False
        for other in cluster.nodes:
            m = view.members.get(other.node_id)
            if m is None or m.state is None or not m.state.costs.known:
                return False
    return True


async def test_costs_gossip_placement_explain_and_slo_rejection(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = await cluster_factory(["prefill", "decode"], conductor={"profile": True})
    prefill, decode = cluster.nodes
    await wait_until(lambda: costs_known_everywhere(cluster), "costs gossiped to every node", 30)

    async with aiohttp.ClientSession() as http:
        async with http.get(f"{decode.url}/admin/status") as resp:
            status = (await resp.json())["conductor"]
        assert status["policy"] == "conductor" and status["profiled"] is True
        step = status["costs"]["step"]
        assert step["base_s"] > 0 or step["token_s"] > 0
        assert status["costs"]["kv_bytes_per_token"] > 0

        # What the decode node (the entry) would do with a prompt.
        async with http.post(
            f"{decode.url}/admin/explain", json={"prompt": list(range(3, 200)), "max_tokens": 8}
        ) as resp:
            assert resp.status == 200
            doc = await resp.json()
        assert doc["placement"]["prefill"] == [prefill.node_id]
        assert doc["placement"]["decode"] == decode.node_id
        [cand] = doc["prefill_candidates"]
        assert cand["costs_known"] and cand["ttft_s"] >= cand["prefill_s"] > 0
        async with http.post(f"{decode.url}/admin/explain", json={"prompt": []}) as resp:
            assert resp.status == 400 and "prompt" in (await resp.json())["error"]["message"]

        # A served request carries the Conductor's forecasts.
        async with http.post(
            f"{decode.url}/v1/completions",
            json={"prompt": list(range(3, 100)), "max_tokens": 4, "temperature": 0},
        ) as resp:
            assert resp.status == 200
            assert float(resp.headers["x-mooncaked-predicted-ttft-ms"]) > 0
            assert float(resp.headers["x-mooncaked-predicted-tbt-ms"]) > 0
            # The cost model's own figures; no request measured yet, so no
            # calibration: the promise is the model's.
            assert (
                resp.headers["x-mooncaked-model-ttft-ms"]
                == (resp.headers["x-mooncaked-predicted-ttft-ms"])
            )
            assert float(resp.headers["x-mooncaked-model-tbt-ms"]) > 0
            await resp.read()
        # Measured against the forecasts: TTFT at the first token, the mean
        # gap between the other three at the stream's end.
        async with http.get(f"{decode.url}/admin/status") as resp:
            calibration = (await resp.json())["conductor"]["calibration"]
        assert calibration["ttft"]["samples"] == 1
        assert calibration["tbt"]["samples"] == 1

    client = openai.AsyncOpenAI(base_url=f"{decode.url}/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            await client.completions.create(
                model="builtin:tiny",
                prompt="a prompt that cannot meet a one-microsecond TTFT",
                max_tokens=4,
                extra_body={"slo": {"ttft_ms": 0.001}},
            )
        err = caught.value
        assert err.code == "ttft_slo"
        assert "time to first token" in err.message
        assert int(err.response.headers["Retry-After"]) >= 1
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(
                model="builtin:tiny", prompt="x", max_tokens=4, extra_body={"slo": {"ttft": 1}}
            )
        # The same prompt with no SLO is served.
        ok = await client.completions.create(
            model="builtin:tiny", prompt="a prompt", max_tokens=4, temperature=0
        )
        assert ok.choices[0].text is not None
    finally:
        await client.close()

    async with aiohttp.ClientSession() as http:
        async with http.get(f"{decode.url}/metrics") as resp:
            metrics = await resp.text()
    assert (
        'mooncaked_conductor_rejections_total{policy="conductor",reason="ttft_slo"} 1.0' in metrics
    )
    assert 'mooncaked_conductor_decisions_total{outcome="rejected",policy="conductor"}' in metrics

    # The CLI renders the same decision.
    shown = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "mooncakectl", "--url", decode.url, "explain", "hello there"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert "prefill candidates" in shown.stdout and prefill.node_id in shown.stdout
    assert "decode on " + decode.node_id in shown.stdout
    bad = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "mooncakectl",
            "--url",
            decode.url,
            "explain",
            "x",
            "--max-tokens",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "--max-tokens" in bad.stderr
    cluster.assert_clean()


async def test_a_single_node_rejects_what_its_tbt_slo_cannot_keep() -> None:
    node = Node(
        make_config(slo={"tbt_s": 1e-6}, conductor={"early_reject": "current", "profile": True})
    )
    await node.start()
    try:
        await wait_until(
            lambda: node.services.costs is not None and node.services.costs.profiled,
            "the cost profile",
            30,
        )
        await wait_until(
            lambda: (
                node.cluster is not None
                and (m := node.cluster.view.members.get(node.node_id)) is not None
                and m.state is not None
                and m.state.costs.known
            ),
            "its own costs in its view",
            30,
        )
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{node.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}
            ) as resp:
                assert resp.status == 429
                body = await resp.json()
                assert body["error"]["code"] == "tbt_slo"
                assert "time between tokens" in body["error"]["message"]
                assert resp.headers["Retry-After"] == "1"
            # A request that asks for a looser TBT of its own is served.
            async with http.post(
                f"{node.url}/v1/completions",
                json={"prompt": "hi", "max_tokens": 4, "slo": {"tbt_ms": 10_000}},
            ) as resp:
                assert resp.status == 200, await resp.text()
    finally:
        await node.stop()
