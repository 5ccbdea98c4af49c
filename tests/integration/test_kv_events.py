"""KV events out of a real node, read as a router built for vLLM reads them.

A ZMQ SUB socket binds on loopback and the node's PUB socket connects to it
(llm-d's indexer takes events so); the subscriber decodes each batch with
plain msgpack. A prompt's blocks arrive as ``BlockStored`` with the hashes
and tokens the node computed; clearing the cache sends ``AllBlocksCleared``;
prompts that overflow a small pool evict blocks, which ``BlockRemoved`` names.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import pytest_asyncio
import torch
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from mooncaked.cache.hashing import block_hashes
from mooncaked.config import ConfigError
from mooncaked.daemon import Node
from mooncaked.kv_events.wire import external_hash
from tests.conftest import wait_until

BLOCK = 16
TOPIC = "kv@node-a@builtin-tiny"
WAIT_S = 10.0


def prompt(seed: int, num_blocks: int = 10) -> list[int]:
    """``num_blocks`` full blocks and one more token; no two seeds share a block."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (num_blocks * BLOCK + 1,), generator=g).tolist()
    ids[0] = 256 + seed
    return ids


class Subscriber:
    """A SUB socket bound on loopback; batches decoded, sequence numbers checked."""

    def __init__(self, sock: zmq.asyncio.Socket, endpoint: str) -> None:
        self.sock = sock
        self.endpoint = endpoint
        # Watched from before the node connects.
        self.monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.last_seq = -1
        self.events: list[dict[str, Any]] = []

    async def connected(self) -> None:
        """Until a publisher's connection is through (the subscription goes out then)."""
        message = await asyncio.wait_for(self.monitor.recv_multipart(), WAIT_S)
        assert parse_monitor_message(message)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED

    async def next_batch(self, timeout_s: float = WAIT_S) -> list[dict[str, Any]] | None:
        try:
            topic, seq, payload = await asyncio.wait_for(self.sock.recv_multipart(), timeout_s)
        except TimeoutError:
            return None
        assert topic == TOPIC.encode()
        number = int.from_bytes(seq, "big")
        assert number > self.last_seq, "sequence numbers go up"
        self.last_seq = number
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and rank == 0
        self.events += events
        return events

    async def until(
        self, found: Callable[[dict[str, Any]], bool], quiet_s: float = WAIT_S
    ) -> dict[str, Any] | None:
        """Batches until an event ``found`` accepts (that event), or None once
        none came for ``quiet_s``."""
        while (batch := await self.next_batch(quiet_s)) is not None:
            for event in batch:
                if found(event):
                    return event
        return None


@pytest_asyncio.fixture
async def subscriber() -> AsyncIterator[Subscriber]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.SUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.setsockopt_string(zmq.SUBSCRIBE, "kv@")
    sub = Subscriber(sock, f"tcp://127.0.0.1:{port}")
    try:
        yield sub
    finally:
        sock.disable_monitor()
        sub.monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()


async def complete(s: aiohttp.ClientSession, ids: list[int]) -> None:
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0}
    async with s.post("/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()


async def first_stored(
    sub: Subscriber, s: aiohttp.ClientSession
) -> tuple[list[int], dict[str, Any]]:
    """A prompt served and its ``BlockStored``. A PUB socket drops what it sends
    before it has taken in the subscription (which it does as it sends), so
    the first events may go nowhere: prompts are served until one's arrive."""
    await sub.connected()
    served: dict[tuple[int, ...], list[int]] = {}
    for seed in range(5):
        ids = prompt(seed)
        served[tuple(ids[:BLOCK])] = ids
        await complete(s, ids)
        event = await sub.until(
            lambda e: e["type"] == "BlockStored" and tuple(e["token_ids"][:BLOCK]) in served,
            2.0,
        )
        if event is not None:
            return served[tuple(event["token_ids"][:BLOCK])], event
    raise AssertionError("no BlockStored reached the subscriber")


StartNode = Callable[..., Awaitable[Node]]


async def events_node(node_factory: StartNode, sub: Subscriber, **sections: Any) -> Node:
    cluster = {"kv_events_endpoint": sub.endpoint, "kv_events_topic": TOPIC}
    return await node_factory(cluster=cluster, **sections)


@pytest.mark.timeout(120)
async def test_a_prompts_blocks_are_stored_then_cleared(
    node_factory: StartNode, subscriber: Subscriber
) -> None:
    node = await events_node(node_factory, subscriber)
    engine = node.engine
    assert engine is not None
    async with aiohttp.ClientSession(node.url) as s:
        ids, stored = await first_stored(subscriber, s)
        # What the node computed: its hashes of the prompt's full blocks.
        hashes = block_hashes(ids, BLOCK, engine.model_id)
        assert set(hashes) <= set(engine.pool.cached_blocks)
        assert stored == {
            "type": "BlockStored",
            "block_hashes": [external_hash(h) for h in hashes],
            "parent_block_hash": None,
            "token_ids": ids[: len(hashes) * BLOCK],
            "block_size": BLOCK,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }

        async with s.get("/admin/status") as r:
            status = (await r.json())["kv_events"]
        assert status["endpoint"] == subscriber.endpoint and status["topic"] == TOPIC
        assert status["events_sent"] >= 1 and status["events_dropped"] == 0
        async with s.get("/metrics") as r:
            metrics = await r.text()
        assert "mooncaked_kv_events_sent_total" in metrics
        assert "mooncaked_kv_events_dropped_total 0.0" in metrics

        # Idle, and no copy out of the pool in flight: every cached block goes.
        await wait_until(lambda: engine.pool.num_holds == 0, "offloads to end")
        async with s.post("/admin/cache/clear", json={}) as r:
            assert r.status == 200, await r.text()
        cleared = await subscriber.until(lambda e: e["type"] != "BlockStored")
        assert cleared == {"type": "AllBlocksCleared"}
        assert engine.pool.cached_blocks == {}


@pytest.mark.timeout(120)
async def test_prompts_that_overflow_the_pool_remove_the_oldest_blocks(
    node_factory: StartNode, subscriber: Subscriber
) -> None:
    # 24 blocks: room for two 11-block prompts, so the third evicts.
    node = await events_node(node_factory, subscriber, kv={"num_blocks": 24})
    engine = node.engine
    assert engine is not None
    async with aiohttp.ClientSession(node.url) as s:
        await first_stored(subscriber, s)

        def removals() -> list[dict[str, Any]]:
            return [e for e in subscriber.events if e["type"] == "BlockRemoved"]

        for seed in range(10, 16):
            if removals():
                break
            await complete(s, prompt(seed))
            # A prompt that evicted nothing sends no removal: on to the next.
            await subscriber.until(lambda e: e["type"] == "BlockRemoved", 2.0)
        assert removals(), "no BlockRemoved after the pool overflowed"
        removed = removals()[0]
    assert removed["medium"] == "GPU" and removed["block_hashes"]
    # The least recently used blocks go first: those of the first prompt served
    # (whose BlockStored may have gone before the subscription was through).
    oldest = prompt(0)
    oldest_hashes = {external_hash(h) for h in block_hashes(oldest, BLOCK, engine.model_id)}
    assert set(removed["block_hashes"]) <= oldest_hashes
    held = {external_hash(h) for h in engine.pool.cached_blocks}
    assert not set(removed["block_hashes"]) & held


async def test_an_endpoint_that_cannot_be_bound_stops_start_up(
    node_factory: StartNode, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/missing-dir/kv.sock"
    with pytest.raises(ConfigError, match=re.escape("'cluster.kv_events_endpoint'")):
        await node_factory(cluster={"kv_events_endpoint": endpoint})
