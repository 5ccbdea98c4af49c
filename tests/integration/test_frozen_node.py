"""A frozen node (SIGSTOP: it neither answers nor closes a connection) costs its
requests the time gossip takes to declare it dead, not a timeout.

The grant time to live is set to 120 s here and every request must finish
within 60 s: without cutting in-flight calls on the membership change, the
calls to the frozen node would wait for the grant (or forever, for a
stream), and the requests would not finish in time.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import TEST_TOML, spawn_daemon
from tests.integration.test_disagg_faults import Cluster, burst, complete, reference

GRANT_TTL_S = 120.0
# Far below the grant time to live; far above gossip's few seconds.
FINISH_S = 60.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, grant_ttl_s=GRANT_TTL_S)
    try:
        yield c
    finally:
        c.stop()


def test_frozen_prefill_node_requests_move_to_the_next(cluster: Cluster, tmp_path: Path) -> None:
    prompts = burst(16, seed=11)
    want = reference(tmp_path, prompts)
    cluster.start("p1", "prefill")
    cluster.start("p2", "prefill")
    d = cluster.start("d1", "decode")
    cluster.wait_converged(["p1", "p2", "d1"])

    async def run() -> tuple[list[tuple[str, dict[str, str]]], float]:
        tasks = [asyncio.ensure_future(complete(d.url, p)) for p in prompts]
        three = asyncio.Event()
        for t in tasks:
            t.add_done_callback(lambda _t: sum(x.done() for x in tasks) >= 3 and three.set())
        await asyncio.wait_for(three.wait(), FINISH_S)
        cluster.nodes["p1"].proc.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        got = await asyncio.wait_for(asyncio.gather(*tasks), FINISH_S)
        return list(got), time.monotonic() - frozen_at

    got, after_s = asyncio.run(run())
    print(f"all {len(got)} requests done {after_s:.1f} s after the freeze")
    assert [g[0] for g in got] == want
    assert {h["x-mooncaked-decode-node"] for _, h in got} == {"d1"}
    for nid in ("p2", "d1"):
        cluster.assert_clean(nid)
    cluster.nodes["p1"].proc.send_signal(signal.SIGCONT)


def test_frozen_decode_node_mid_stream_resumes_elsewhere(cluster: Cluster, tmp_path: Path) -> None:
    prompt = burst(1, seed=9)[0]
    body = {"prompt": prompt, "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    solo = spawn_daemon(tmp_path / "solo", TEST_TOML)
    try:
        want = urllib.request.urlopen(
            urllib.request.Request(
                solo.url + "/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            ),
            timeout=FINISH_S,
        )
        want_text = json.loads(want.read())["choices"][0]["text"]
    finally:
        solo.stop()
    p = cluster.start("p1", "prefill")
    cluster.start("d1", "decode")
    cluster.start("d2", "decode")
    cluster.wait_converged(["p1", "d1", "d2"])

    async def run() -> tuple[str, str, list[Any]]:
        async with aiohttp.ClientSession() as s:
            r = await s.post(
                p.url + "/v1/completions",
                json={**body, "stream": True},
                timeout=aiohttp.ClientTimeout(total=FINISH_S),
            )
            assert r.status == 200
            victim = r.headers["x-mooncaked-decode-node"]
            text = ""
            events: list[Any] = []
            frozen = False
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                e = json.loads(line[6:])
                events.append(e)
                assert "error" not in e, e
                text += e["choices"][0]["text"]
                if not frozen and len(events) >= 20:
                    cluster.nodes[victim].proc.send_signal(signal.SIGSTOP)
                    frozen = True
            return text, victim, events

    text, victim, events = asyncio.run(run())
    assert text == want_text
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    survivor = "d2" if victim == "d1" else "d1"
    cluster.assert_clean("p1")
    cluster.assert_clean(survivor)
    cluster.nodes[victim].proc.send_signal(signal.SIGCONT)
