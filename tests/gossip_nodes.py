"""Gossip services on loopback for tests: fast intervals, joins through seeds.

Waits are correctness bounds, never timing measurements: ``wait_for``
polls a condition until a limit and says how long it took.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from mooncaked.cluster.gossip.service import ClusterService
from mooncaked.config import ClusterConfig

# Probes, gossip and syncs several times a second: a loss is seen in seconds.
FAST = ClusterConfig(
    probe_interval_s=0.2,
    probe_timeout_s=0.1,
    suspect_timeout_s=1.0,
    gossip_interval_s=0.05,
    sync_interval_s=0.5,
    sync_timeout_s=1.0,
)


def seeded(*services: ClusterService, **changes: Any) -> ClusterConfig:
    """``FAST`` joining through ``services`` (running), with ``changes``."""
    seeds = tuple(f"127.0.0.1:{s.gossip_port}" for s in services)
    return dataclasses.replace(FAST, seeds=seeds, **changes)


async def wait_for(cond: Callable[[], bool], limit: float) -> float:
    """Until ``cond()`` holds, at most ``limit`` seconds; the seconds it took."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not cond():
        if loop.time() - start > limit:
            raise AssertionError(f"condition not met within {limit} s")
        await asyncio.sleep(0.02)
    return loop.time() - start
