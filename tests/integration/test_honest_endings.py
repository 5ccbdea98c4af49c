"""A request cut short says so: a stream cut at the drain timeout ends with an
error event and finish reason "abort", never like a finished one."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from mooncaked.daemon import Node


async def test_stream_cut_at_drain_timeout_says_aborted(
    node_factory: Callable[..., Awaitable[Node]],
) -> None:
    node = await node_factory(server={"drain_timeout_s": 0.5})
    events: list[Any] = []
    async with aiohttp.ClientSession() as s:
        body = {"prompt": "abort me", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        async with s.post(node.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            # Wait until tokens flow, then drain: the drain times out and aborts it.
            first = await r.content.readline()
            assert first.startswith(b"data: ")
            stopping = asyncio.create_task(node.stop())
            async for raw in r.content:
                line = raw.decode().strip()
                if line:
                    events.append(line[len("data: ") :])
            await stopping
    assert events[-1] == "[DONE]", events[-3:]
    payloads = [orjson.loads(e) for e in events[:-1]]
    reasons = [p["choices"][0]["finish_reason"] for p in payloads if p.get("choices")]
    assert "stop" not in reasons
    assert reasons[-1] == "abort", reasons[-3:]
    errors = [p["error"] for p in payloads if "error" in p]
    assert errors and errors[-1]["code"] == "aborted", payloads[-2:]
