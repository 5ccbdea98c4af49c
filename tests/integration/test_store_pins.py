"""Pins in a real mooncaked process, through the Python store client.

A session's prompt is pinned hard and another's soft; then many other
prompts go through a DRAM tier of 32 blocks and an SSD tier of 64, which
evicts every unpinned block of the early ones from both tiers. The pinned
prefixes are still in DRAM (and on the SSD). A pin past the budget
(``store.max_pinned_ratio`` of DRAM) is refused with an error naming it.
The daemon is stopped and started again on the same SSD path: the pins are
back (from the SSD log) with their blocks, and the session's prompt is
served from them. Then it is killed with SIGKILL and started again: the
same.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import pytest

from mooncaked.client import StoreClient, StoreError
from tests.conftest import TEST_TOML, DaemonProcess, wait_until_sync
from tests.integration.test_cache_daemon import cached, run_completions
from tests.integration.test_store_replicas import prompt

# float32: a block of builtin:tiny is 4 layers x K,V x 16 tokens x 2 heads x 32.
BLOCK_BYTES = 4 * 2 * 16 * 2 * 32 * 4


def store_toml(ssd: Path) -> str:
    keys: dict[str, Any] = {
        "dram_bytes": 32 * BLOCK_BYTES,
        "ssd_path": str(ssd),
        "ssd_bytes": 64 * BLOCK_BYTES,
        "max_pinned_ratio": 0.5,
    }
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in keys.items())
    return f'{TEST_TOML}\n[model]\ndtype = "float32"\n\n[store]\n{body}\n'


def tiers(client: StoreClient, ids: list[int]) -> list[list[str]]:
    return [b.here for b in client.kv.exists(prompt=ids).blocks]


# Three daemon starts, one after SIGKILL.
@pytest.mark.slow
def test_pinned_prefixes_survive_pressure_and_restarts(daemon_factory: Any, tmp_path: Path) -> None:
    toml = store_toml(tmp_path / "ssd")
    daemon: DaemonProcess = daemon_factory(toml)
    session, other = prompt(100), prompt(101, num_blocks=3)
    pressure = [prompt(200 + i, num_blocks=10) for i in range(20)]
    run_completions(daemon.url, [session, other])
    client = StoreClient(daemon.url)
    wait_until_sync(
        lambda: all(t for t in tiers(client, session) + tiers(client, other)),
        "the sessions' blocks in the store",
    )
    hard = client.kv.pin(prompt=session, hard=True)
    soft = client.kv.pin(prompt=other, ttl_s=3600)
    assert (hard.pinned, soft.pinned, hard.missing) == (6, 3, [])
    assert soft.pins.soft_blocks == 3 and soft.pins.hard_blocks == 6
    assert soft.pins.budget_blocks == 16  # half of 32 DRAM slots

    # Past the budget: 9 pinned, 10 more would be 19 of 16.
    run_completions(daemon.url, [pressure[0]])
    wait_until_sync(lambda: all(tiers(client, pressure[0])), "a 10-block prompt in the store")
    with pytest.raises(StoreError) as refused:
        client.kv.pin(prompt=pressure[0], hard=True)
    assert refused.value.status == 409 and refused.value.code == "pin_budget_exceeded"
    assert "store.max_pinned_ratio = 0.5" in refused.value.message
    assert "budget of 16 blocks" in refused.value.message

    # Pressure: 200 blocks through 32 DRAM slots and 64 SSD slots.
    run_completions(daemon.url, pressure[1:])
    evicted = [t for ids in pressure[:4] for t in tiers(client, ids)]
    assert evicted == [[]] * 40, "every unpinned block of the early prompts is gone"
    assert all("dram" in t for t in tiers(client, session)), "the hard pin stays in DRAM"
    assert all("dram" in t for t in tiers(client, other)), "so does the soft pin"
    stats = client.stats()
    assert stats["dram"]["evictions"] > 0 and stats["ssd"]["evictions"] > 0
    assert stats["watermark"]["evictions"] > 0
    print(
        f"pressure: {stats['dram']['evictions']} DRAM evictions "
        f"({stats['watermark']['evictions']} by watermark), "
        f"{stats['ssd']['evictions']} SSD evictions; pinned blocks kept: 9 of 9"
    )
    wait_until_sync(
        lambda: all("ssd" in t for t in tiers(client, session) + tiers(client, other)),
        "the pinned blocks on the SSD",
    )

    # A clean restart on the same SSD path.
    daemon.stop()
    daemon = daemon_factory(toml)
    client = StoreClient(daemon.url)
    check_restored(client, daemon, session, other)
    # Pins of blocks that are only on the SSD still count against the budget.
    fresh = prompt(400, num_blocks=10)
    run_completions(daemon.url, [fresh])
    wait_until_sync(lambda: all(tiers(client, fresh)), "a fresh prompt in the store")
    with pytest.raises(StoreError, match="9 pinned now"):
        client.kv.pin(prompt=fresh, hard=True)

    # Killed with SIGKILL, started again.
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(timeout=30)
    daemon = daemon_factory(toml)
    check_restored(StoreClient(daemon.url), daemon, session, other)


def check_restored(
    client: StoreClient, daemon: DaemonProcess, session: list[int], other: list[int]
) -> None:
    found = client.kv.exists(prompt=session).blocks + client.kv.exists(prompt=other).blocks
    assert [b.pinned for b in found] == ["hard"] * 6 + ["soft"] * 3
    assert all(b.here == ["ssd"] for b in found)
    pins = client.stats()["pins"]
    assert (pins["restored"], pins["hard_blocks"], pins["soft_blocks"]) == (9, 6, 3)
    assert (pins["in_dram"], pins["on_ssd"]) == (0, 9)
    (out,) = run_completions(daemon.url, [session])
    assert cached(out) == 6 * 16


def test_the_client_names_a_bad_request(daemon_factory: Any, tmp_path: Path) -> None:
    daemon: DaemonProcess = daemon_factory(store_toml(tmp_path / "ssd"))
    client = StoreClient(daemon.url)
    with pytest.raises(StoreError) as soft_forever:
        client.kv.pin(prompt="a prompt of a block or more: sixteen", hard=False)
    assert soft_forever.value.status == 400 and soft_forever.value.param == "ttl_s"
    with pytest.raises(StoreError) as short:
        client.kv.pin(prompt=[1, 2, 3], ttl_s=5)
    assert short.value.param == "prompt" and "no full block" in short.value.message
    with pytest.raises(ValueError, match="exactly one"):
        client.kv.exists()
    assert asyncio.run(_async_exists(daemon.url)) == [False] * 6


async def _async_exists(url: str) -> list[bool]:
    from mooncaked.client import AsyncStoreClient

    async with AsyncStoreClient(url) as client:
        return (await client.kv.exists(prompt=prompt(300))).anywhere
