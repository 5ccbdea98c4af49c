"""The tiered KV cache in a real mooncaked process: restarts and crashes on one SSD path.

- A daemon stopped cleanly and started again on the same SSD path serves the
  prompts it saw from the SSD: cached_tokens > 0, the same greedy text.
- A daemon killed with SIGKILL while many distinct prompts are in flight
  (and their blocks being written through to the SSD) restarts with a
  consistent index. The test flips a byte in the slab under some blocks
  while the daemon is down: those blocks are dropped when read, never
  served; the prompts they belong to are served from the blocks before them
  and computed from there, to the same greedy text as the cold run.
"""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from mooncaked.cache.hashing import block_hashes
from mooncaked.cache.ssd import SLAB_NAME, SsdTier
from mooncaked.cache.store import BlockLayout
from tests.conftest import TEST_TOML, DaemonProcess, wait_until_sync

# Daemons killed and restarted over an SSD tier; the tiers have unit tests.
pytestmark = pytest.mark.slow

BLOCK = 16
MODEL_ID = "builtin:tiny@0"
WAIT_S = 60.0


def store_toml(ssd: Path, **extra: Any) -> str:
    keys = {"dram_bytes": 16 << 20, "ssd_path": str(ssd), "ssd_bytes": 64 << 20, **extra}
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in keys.items())
    return f"{TEST_TOML}\n[store]\n{body}\n"


def prompt(seed: int, num_blocks: int = 10) -> list[int]:
    """Token ids: ``num_blocks`` full blocks and one more token; distinct from
    the first token on, so no two prompts share a block."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (num_blocks * BLOCK + 1,), generator=g).tolist()
    ids[0] = 256 + seed % 100
    return ids


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=WAIT_S) as r:
        return json.loads(r.read())


async def complete(
    session: aiohttp.ClientSession, url: str, ids: list[int], max_tokens: int = 6
) -> dict[str, Any]:
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def run_completions(url: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    async def go() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as s:
            return [await complete(s, url, ids) for ids in prompts]

    return asyncio.run(go())


def cached(out: dict[str, Any]) -> int:
    return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.timeout(120)
def test_restarted_daemon_serves_hits_from_ssd(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    toml = store_toml(tmp_path / "ssd")
    ids = prompt(1)
    d1 = daemon_factory(toml)
    (cold,) = run_completions(d1.url, [ids])
    assert cached(cold) == 0
    # A clean stop finishes queued offloads and SSD writes before it exits.
    assert d1.stop() == 0

    d2 = daemon_factory(toml)
    stats = get_json(d2.url + "/admin/cache/stats?check=1")
    assert stats["integrity"] == "ok"
    assert stats["ssd"]["used_blocks"] >= 10 and stats["dram"]["used_blocks"] == 0
    (warm,) = run_completions(d2.url, [ids])
    assert cached(warm) == 10 * BLOCK
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    stats = get_json(d2.url + "/admin/cache/stats")
    assert stats["ssd"]["bytes_read"] == 10 * stats["layout"]["block_bytes"]
    assert stats["store"]["ssd_corrupt_dropped"] == 0


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.timeout(150)
def test_sigkill_during_ssd_writes_then_flipped_slots_are_never_served(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    ssd = tmp_path / "ssd"
    toml = store_toml(ssd)
    d1 = daemon_factory(toml)
    refs = [prompt(100 + i) for i in range(4)]
    cold = run_completions(d1.url, refs)
    assert all(cached(out) == 0 for out in cold)
    stats = get_json(d1.url + "/admin/cache/stats")
    layout = stats["layout"]
    num_slots = stats["ssd"]["capacity_blocks"]
    # Written through to the SSD (the flood below keeps the writers busy).
    wait_until_sync(
        lambda: get_json(d1.url + "/admin/cache/stats")["ssd"]["used_blocks"] >= 40,
        "the reference blocks on the SSD",
        WAIT_S,
    )

    # The flood: many distinct prompts at once, each written through to the
    # SSD as it is computed; the daemon dies with most still in flight.
    flood = [prompt(1000 + i, num_blocks=12) for i in range(48)]
    done: list[tuple[list[int], dict[str, Any]]] = []

    async def flood_and_kill() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as s:

            async def one(ids: list[int]) -> None:
                out = await complete(s, d1.url, ids)
                done.append((ids, out))

            tasks = [asyncio.ensure_future(one(ids)) for ids in flood]
            while len(done) < 8:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                tasks = [t for t in tasks if not t.done()]
            d1.signal(signal.SIGKILL)
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(flood_and_kill())
    assert d1.proc.wait(WAIT_S) == -signal.SIGKILL
    assert 8 <= len(done) < len(flood)

    # While it is down: which slot holds which block, read from its log.
    tag = BlockLayout(
        layout["num_layers"],
        layout["block_size"],
        layout["num_kv_heads"],
        layout["head_dim"],
        getattr(torch, layout["dtype"]),
    ).fingerprint()
    assert tag.hex() == layout["fingerprint"]
    peek = SsdTier(ssd, layout["block_bytes"], num_slots, layout_tag=tag)
    index = peek.peek_index()
    ref_hashes = [block_hashes(ids, BLOCK, MODEL_ID) for ids in refs]
    assert all(h in index for hashes in ref_hashes for h in hashes)
    # One flipped block per reference prompt, at different depths.
    victims = {0: 2, 1: 0, 2: 7}
    for i, j in victims.items():
        slot = index[ref_hashes[i][j]]
        flip(ssd / SLAB_NAME, slot * peek.slot_stride + [17, 0, layout["block_bytes"] - 1][i % 3])

    d2 = daemon_factory(toml)
    stats = get_json(d2.url + "/admin/cache/stats?check=1")
    assert stats["integrity"] == "ok"
    assert stats["ssd"]["used_blocks"] == len(index)
    warm = run_completions(d2.url, refs)
    for i, (c, w) in enumerate(zip(cold, warm, strict=True)):
        assert w["choices"][0]["text"] == c["choices"][0]["text"], f"reference prompt {i}"
        # Served from the SSD up to the flipped block, computed from there.
        assert cached(w) == victims.get(i, 10) * BLOCK, f"reference prompt {i}"
    stats = get_json(d2.url + "/admin/cache/stats?check=1")
    assert stats["store"]["ssd_corrupt_dropped"] == len(victims)
    assert stats["integrity"] == "ok"

    # Prompts that finished before the kill: the same text again, served
    # from exactly the leading blocks of theirs that the log recorded.
    again = run_completions(d2.url, [ids for ids, _ in done])
    for (ids, before), after in zip(done, again, strict=True):
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        hashes = block_hashes(ids, BLOCK, MODEL_ID)[:12]
        on_ssd = next((k for k, h in enumerate(hashes) if h not in index), len(hashes))
        assert cached(after) == on_ssd * BLOCK
    assert get_json(d2.url + "/admin/cache/stats")["store"]["ssd_corrupt_dropped"] == len(victims)
