"""Cache poisoning through the transfer port, against a real daemon.

A process holding the cluster secret writes zeros over a node's DRAM-tier
segment, the memory peers fetch cached prefixes from. The node refuses (the
segment is read-only to peers) and counts it, and a reader that then fetches
the prefix gets the holder's KV intact: the same greedy text as a cold run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from mooncaked.config import Config
from mooncaked.engine.serving import KV_SEGMENT
from mooncaked.transfer import protocol as p
from mooncaked.wire.peer_cache import DRAM_SEGMENT
from tests.conftest import DaemonProcess
from tests.integration.test_peer_fetch import (
    BLOCK,
    HOLDER_TOML,
    WAIT_S,
    cached,
    complete,
    get_json,
    in_holder_dram,
    prompt,
    text,
)
from tests.transfer_attack import raw_write

# Daemon processes probing each other's segments; the grants have unit tests
# (test_transfer_access.py).
pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
async def test_writing_into_a_holders_dram_tier_is_refused_and_its_kv_served_intact(
    daemon_factory: Callable[..., DaemonProcess], node_factory: Callable[..., Awaitable[Any]]
) -> None:
    holder = daemon_factory(HOLDER_TOML)
    reader = await node_factory(transfer={"transports": ["tcp"]}, store={"peers": [holder.url]})
    secret = Config().node.cluster_secret.encode()  # the holder's: its config sets none
    ids = prompt(11)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as s:
        cold = await complete(s, holder.url, ids)
        await in_holder_dram(s, holder, 10)
        address = (await get_json(s, holder.url + "/admin/cache/stats"))["transfer"]["address"]

        # Zeros over the whole DRAM tier, and over the device KV cache (no grant).
        for segment in (DRAM_SEGMENT, KV_SEGMENT):
            status, _ = await asyncio.to_thread(
                raw_write, address, secret, "attacker", segment, 0, None
            )
            assert status == p.Status.FORBIDDEN, segment
        st = await get_json(s, holder.url + "/admin/cache/stats?check=1")
        assert st["transfer"]["served_forbidden"] == 2
        assert st["integrity"] == "ok"
        metrics = await (await s.get(holder.url + "/metrics")).text()
        assert "mooncaked_transfer_ops_refused_total 2.0" in metrics

        warm = await complete(s, reader.url, ids)
        assert cached(warm) == 10 * BLOCK
        assert text(warm) == text(cold)
        assert "transfer op refused by segment access" in holder.stderr()
