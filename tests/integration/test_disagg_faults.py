"""Disaggregated serving under faults, on real ``mooncaked`` processes.

``kill -9`` of a prefill node during a burst, and of a decode node in the
middle of a stream: every request completes with the same text as a single
node gives, none hangs, and every surviving node's block pool passes its
self-check with nothing left in use.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import TEST_TOML, DaemonProcess, spawn_daemon

# Daemon clusters with nodes killed mid-burst, checked against a solo run.
pytestmark = pytest.mark.slow

MAX_TOKENS = 8
WAIT_S = 90.0


def toml(node_id: str, role: str, seeds: list[str], grant_ttl_s: float = 4.0) -> str:
    return (
        TEST_TOML
        + f"""
[node]
id = "{node_id}"
role = "{role}"
cluster_secret = "disagg-fault-tests-secret-of-32-bytes-or-more"

[model]
cpu_threads = 1

[store]
dram_bytes = 16777216

[cluster]
seeds = {json.dumps(seeds)}
probe_interval_s = 0.3
probe_timeout_s = 0.1
suspect_timeout_s = 1.0

[disagg]
# Blocks granted to a prefill node that died stay held this long (+ 2 s).
grant_ttl_s = {grant_ttl_s}
"""
    )


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


class Cluster:
    def __init__(self, tmp: Path, grant_ttl_s: float = 4.0) -> None:
        self.tmp = tmp
        self.grant_ttl_s = grant_ttl_s
        self.nodes: dict[str, DaemonProcess] = {}
        self.seed: list[str] = []

    def start(self, node_id: str, role: str, extra: str = "") -> DaemonProcess:
        """``extra``: TOML appended to the node's config (its own sections)."""
        d = spawn_daemon(
            self.tmp / node_id, toml(node_id, role, self.seed, self.grant_ttl_s) + extra
        )
        self.nodes[node_id] = d
        if not self.seed:
            self.seed = [get(d.url + "/admin/cluster")["nodes"][0]["gossip_addr"]]
        return d

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start_all(self, roles: dict[str, str]) -> dict[str, DaemonProcess]:
        """Start each node in turn (the first is every other's seed), then wait
        until each sees all of them alive."""
        started = {node_id: self.start(node_id, role) for node_id, role in roles.items()}
        self.wait_converged(list(roles))
        return started

    def wait_converged(self, ids: list[str]) -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            ok = True
            for nid in ids:
                members = get(self.nodes[nid].url + "/admin/cluster")["nodes"]
                alive = {m["node_id"] for m in members if m["status"] == "alive" and m.get("state")}
                ok &= set(ids) <= alive
            if ok:
                return
            time.sleep(0.1)
        raise AssertionError(f"{ids} not all alive in every view within {WAIT_S} s")

    def assert_clean(self, node_id: str) -> None:
        url = self.nodes[node_id].url
        deadline = time.monotonic() + WAIT_S
        while True:
            st = get(url + "/admin/status")
            if st["load"]["running"] == 0 and st["load"]["waiting"] == 0:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"{node_id} still has work: {st['load']}")
            time.sleep(0.1)
        stats = get(url + "/admin/cache/stats?check=1")
        assert stats.get("integrity") == "ok", stats
        # Blocks held for a failed handoff are let go once their grant expires.
        while (kv := get(url + "/admin/status")["kv"])["blocks_used"] != 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"{node_id} still holds KV blocks: {kv}")
            time.sleep(0.1)

    def stop(self) -> None:
        for d in self.nodes.values():
            if d.proc.poll() is None:
                # A node a test froze must run again to drain and stop.
                d.proc.send_signal(signal.SIGCONT)
                d.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with Cluster(tmp_path) as c:
        yield c


def burst(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(300)]
    return [
        [*shared, *(rng.randrange(3, 250) for _ in range(rng.randint(50, 400)))] for _ in range(n)
    ]


async def complete(url: str, prompt: list[int]) -> tuple[str, dict[str, str]]:
    async with aiohttp.ClientSession() as s:
        r = await s.post(
            url + "/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=aiohttp.ClientTimeout(total=WAIT_S),
        )
        body = await r.json()
        assert r.status == 200, body
        return body["choices"][0]["text"], {
            k: v for k, v in r.headers.items() if k.startswith("x-mooncaked-")
        }


async def three_done(tasks: list[asyncio.Future[Any]], timeout_s: float) -> None:
    """Until three of ``tasks`` are done (AssertionError after ``timeout_s``)."""
    three = asyncio.Event()
    for t in tasks:
        t.add_done_callback(lambda _t: sum(x.done() for x in tasks) >= 3 and three.set())
    try:
        await asyncio.wait_for(three.wait(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"fewer than three requests done within {timeout_s} s") from None


def reference(tmp: Path, prompts: list[list[int]]) -> list[str]:
    solo = spawn_daemon(tmp / "solo", TEST_TOML)
    try:
        return [asyncio.run(complete(solo.url, p))[0] for p in prompts]
    finally:
        solo.stop()


def test_kill_9_of_a_prefill_node_during_a_burst(cluster: Cluster, tmp_path: Path) -> None:
    prompts = burst(32, seed=5)
    want = reference(tmp_path, prompts)
    d = cluster.start_all({"p1": "prefill", "p2": "prefill", "d1": "decode"})["d1"]

    async def run() -> list[tuple[str, dict[str, str]]]:
        tasks = [asyncio.ensure_future(complete(d.url, p)) for p in prompts]
        # Once a few have been through, p1 dies with the rest in flight.
        await three_done(tasks, WAIT_S)
        cluster.nodes["p1"].proc.send_signal(signal.SIGKILL)
        return list(await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S))

    got = asyncio.run(run())
    assert [g[0] for g in got] == want
    assert {h["x-mooncaked-decode-node"] for _, h in got} == {"d1"}
    # Those placed after the kill, or cut by it, went to p2 (or were computed
    # on d1 itself when no prefill node answered).
    assert {h["x-mooncaked-prefill-node"] for _, h in got} <= {"p1", "p2", "d1"}
    for nid in ("p2", "d1"):
        cluster.assert_clean(nid)


def decode_node_fault_mid_stream(
    cluster: Cluster, tmp_path: Path, sig: signal.Signals, max_tokens: int, wait_s: float
) -> str:
    """Streams one request through a 1P+2D cluster and sends ``sig`` to its
    decode node after 20 events; checks the client got the single-node text
    in one stream and the others are clean. Returns the victim's id."""
    prompt = burst(1, seed=9)[0]
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    solo = spawn_daemon(tmp_path / "solo", TEST_TOML)
    try:
        want = urllib.request.urlopen(
            urllib.request.Request(
                solo.url + "/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            ),
            timeout=wait_s,
        )
        want_text = json.loads(want.read())["choices"][0]["text"]
    finally:
        solo.stop()
    p = cluster.start_all({"p1": "prefill", "d1": "decode", "d2": "decode"})["p1"]

    async def run() -> tuple[str, str, list[Any]]:
        async with aiohttp.ClientSession() as s:
            r = await s.post(
                p.url + "/v1/completions",
                json={**body, "stream": True},
                timeout=aiohttp.ClientTimeout(total=wait_s),
            )
            assert r.status == 200
            victim = r.headers["x-mooncaked-decode-node"]
            text = ""
            events: list[Any] = []
            hit = False
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                e = json.loads(line[6:])
                events.append(e)
                assert "error" not in e, e
                text += e["choices"][0]["text"]
                if not hit and len(events) >= 20:
                    cluster.nodes[victim].proc.send_signal(sig)
                    hit = True
            return text, victim, events

    text, victim, events = asyncio.run(run())
    assert text == want_text
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    survivor = "d2" if victim == "d1" else "d1"
    cluster.assert_clean("p1")
    cluster.assert_clean(survivor)
    return victim


def test_kill_9_of_a_decode_node_mid_stream_resumes_elsewhere(
    cluster: Cluster, tmp_path: Path
) -> None:
    decode_node_fault_mid_stream(cluster, tmp_path, signal.SIGKILL, 160, WAIT_S)


def stage_toml(index: int) -> str:
    return f'\n[pipeline]\ngroup = "g"\nstage = {index}\nnum_stages = 2\nchunk_tokens = 256\n'


@pytest.mark.parametrize("victim", ["s0", "s1"])
def test_kill_9_of_a_stage_of_a_pipelined_group_mid_request(
    cluster: Cluster, tmp_path: Path, victim: str
) -> None:
    """A group's stage dies while long prompts flow through it: the decode node
    computes them itself (no other prefill candidate), every request ends
    with the single node's text, and the surviving stage lets go of all it
    held for them (rows, grants, blocks)."""
    rng = random.Random(17)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(1000, 3000))] for _ in range(10)]
    want = reference(tmp_path, prompts)
    cluster.start("s0", "prefill", stage_toml(0))
    cluster.start("s1", "prefill", stage_toml(1))
    d = cluster.start("d1", "decode")
    cluster.wait_converged(["s0", "s1", "d1"])

    async def run() -> list[tuple[str, dict[str, str]]]:
        tasks = [asyncio.ensure_future(complete(d.url, p)) for p in prompts]
        await three_done(tasks, WAIT_S)
        cluster.nodes[victim].proc.send_signal(signal.SIGKILL)
        return list(await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S))

    got = asyncio.run(run())
    assert [g[0] for g in got] == want
    # The group's head served those before the kill; d1 the rest.
    served = [h["x-mooncaked-prefill-node"] for _, h in got]
    assert set(served) <= {"s0", "d1"} and "s0" in served and "d1" in served, served
    survivor = "s1" if victim == "s0" else "s0"
    for nid in (survivor, "d1"):
        cluster.assert_clean(nid)
    st = get(cluster.nodes[survivor].url + "/admin/status")["pipeline"]
    assert st["inbound_requests"] == 0 and st["outbound_requests"] == 0, st
    # Rows a dead stage might still have written wait out its grant, then free.
    deadline = time.monotonic() + WAIT_S
    while (st := get(cluster.nodes[survivor].url + "/admin/status")["pipeline"])[
        "input_blocks_held"
    ]:
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
