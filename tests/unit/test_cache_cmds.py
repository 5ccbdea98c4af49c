"""mooncakectl cache stats | lookup | clear against a real Node with DRAM and SSD tiers.

The CLI blocks, so it runs in a thread while the test's event loop serves it.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from mooncakectl.cli import run
from mooncakectl.registry import Env, ExitStatus
from mooncaked.cache.hashing import block_hashes

# 160 bytes and a BOS token: ten full blocks and one token, so the four
# generated tokens do not fill an eleventh block.
PROMPT = (
    "The tiered cache keeps the KV blocks of this prompt on the device, in DRAM, on SSD. " * 2
)[:160]


def make_env(tty: bool = False) -> Env:
    return Env(stdout=io.StringIO(), stderr=io.StringIO(), environ={}, stdout_isatty=tty)


async def cli(url: str, *argv: str, tty: bool = False) -> tuple[int, str, str]:
    env = make_env(tty)
    status = await asyncio.to_thread(run, ["--url", url, *argv], env)
    return status, env.stdout.getvalue(), env.stderr.getvalue()  # type: ignore[attr-defined]


async def complete(url: str, prompt: str) -> dict[str, Any]:
    async with aiohttp.ClientSession(url) as s:
        r = await s.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0}
        )
        assert r.status == 200, await r.text()
        return await r.json()


async def test_cache_stats_lookup_clear(
    node_factory: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    node = await node_factory(
        store={"dram_bytes": 16 << 20, "ssd_path": str(tmp_path / "ssd"), "ssd_bytes": 32 << 20}
    )
    url = node.url

    status, out, _ = await cli(url, "cache", "lookup", PROMPT, "--json")
    assert status == ExitStatus.OK
    cold = json.loads(out)
    n = cold["num_prompt_tokens"]
    assert n == 161 and cold["hit_tokens"]["total"] == 0 and cold["computed_tokens"] == n

    first = await complete(url, PROMPT)
    assert first["usage"]["prompt_tokens"] == n
    await node.store.flush()

    status, out, _ = await cli(url, "cache", "lookup", PROMPT, "--json")
    hot = json.loads(out)
    usable = (n - 1) // 16 * 16
    assert hot["hit_tokens"] == {"device": usable, "dram": 0, "ssd": 0, "total": usable}
    assert hot["tiers"] == ["device"] * (usable // 16)

    # The same prompt as token ids, and plain output for a human.
    ids = ",".join(str(t) for t in node.engine.tokenizer.encode(PROMPT, add_special_tokens=True))
    status, out, _ = await cli(url, "cache", "lookup", "--token-ids", ids)
    assert status == ExitStatus.OK
    assert f"device:   {usable} tokens" in out
    assert f"computed: {n - usable} tokens" in out

    # With the device prefix cache dropped, the blocks are still in DRAM.
    assert node.engine.reset_prefix_cache() > 0
    status, out, _ = await cli(url, "cache", "lookup", PROMPT, "--json")
    assert json.loads(out)["hit_tokens"]["dram"] == usable

    status, out, _ = await cli(url, "cache", "stats", "--json")
    assert status == ExitStatus.OK
    stats = json.loads(out)
    num_blocks = usable // 16
    assert stats["dram"]["used_blocks"] == n // 16
    assert stats["ssd"]["used_blocks"] == n // 16  # written through
    assert stats["layout"]["block_size"] == 16
    assert stats["transfer"]["address"] == node.transfer.address

    status, out, _ = await cli(url, "cache", "stats")
    assert status == ExitStatus.OK
    lines = out.splitlines()
    assert lines[0].split() == ["TIER", "BLOCKS", "HIT", "RATIO", "READ", "WRITTEN", "EVICTIONS"]
    assert lines[1].startswith("device ")
    assert lines[2].split()[:2] == ["dram", f"{n // 16}/{stats['dram']['capacity_blocks']}"]
    assert lines[3].split()[:2] == ["ssd", f"{n // 16}/{stats['ssd']['capacity_blocks']}"]
    assert any(line.startswith("peer fetches:") for line in lines)

    status, out, _ = await cli(url, "cache", "stats", tty=True)
    assert status == ExitStatus.OK and "KV cache tiers" in out

    status, out, _ = await cli(url, "cache", "clear", "--json")
    assert status == ExitStatus.OK
    cleared = json.loads(out)
    # The device blocks went with reset_prefix_cache above; DRAM and SSD each
    # held every full block.
    assert cleared == {"device_blocks": 0, "store_blocks": 2 * (n // 16)}
    status, out, _ = await cli(url, "cache", "lookup", PROMPT, "--json")
    assert json.loads(out)["hit_tokens"]["total"] == 0

    # After the clear the prompt is computed again, to the same greedy text.
    again = await complete(url, PROMPT)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    await node.store.flush()
    status, out, _ = await cli(url, "cache", "clear")
    assert status == ExitStatus.OK
    assert out == f"cleared {num_blocks} device blocks and {2 * (n // 16)} DRAM/SSD blocks\n"


async def test_cache_command_mistakes(node_factory: Callable[..., Awaitable[Any]]) -> None:
    node = await node_factory()
    status, _, err = await cli(node.url, "cache", "lookup")
    assert status == ExitStatus.USAGE and "needs a prompt" in err
    status, _, err = await cli(node.url, "cache", "stats", "extra")
    assert status == ExitStatus.USAGE and "takes no prompt" in err
    status, _, err = await cli(node.url, "cache", "lookup", "--token-ids", "1,x")
    assert status == ExitStatus.USAGE and "comma-separated integers" in err
    status, _, err = await cli(node.url, "cache", "flush")
    assert status == ExitStatus.USAGE and "invalid choice" in err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    status, _, err = await cli(closed, "cache", "stats")
    assert status == ExitStatus.UNREACHABLE and "cannot reach mooncaked" in err


async def test_cache_pin_unpin_replicas(node_factory: Callable[..., Awaitable[Any]]) -> None:
    # 64 DRAM slots of 16-token blocks (float32 builtin:tiny: 32 KiB each);
    # a pin budget of a quarter of them.
    node = await node_factory(
        model={"dtype": "float32"},
        store={"dram_bytes": 64 * 32768, "max_pinned_ratio": 0.25},
    )
    url = node.url
    await complete(url, PROMPT)
    await node.store.flush()
    hashes = block_hashes(
        node.engine.tokenizer.encode(PROMPT, add_special_tokens=True), 16, node.engine.model_id
    )
    assert len(hashes) == 10

    status, out, _ = await cli(url, "cache", "pin", PROMPT, "--ttl", "60")
    assert status == ExitStatus.OK
    assert out == "pinned 10 of 10 blocks (soft, for 60 s); pins now 10 soft, 0 hard of 16\n"
    status, out, _ = await cli(
        url, "cache", "pin", "--hashes", ",".join(h.hex() for h in hashes[:2]), "--hard", "--json"
    )
    doc = json.loads(out)
    assert (doc["pinned"], doc["kind"], doc["pins"]["hard_blocks"]) == (2, "hard", 2)
    assert node.store.retention.pins.kind_of(hashes[0]).label == "hard"

    # Over the budget: the daemon's message names it, the exit status says HTTP error.
    other = "".join(chr(ord("a") + i % 26) for i in range(160))
    await complete(url, other)
    await node.store.flush()
    status, _, err = await cli(url, "cache", "pin", other, "--hard")
    assert status == ExitStatus.HTTP_ERROR
    assert "409" in err and "store.max_pinned_ratio = 0.25" in err

    status, out, _ = await cli(url, "cache", "stats")
    assert "pins:" in out and "2 hard of a budget of 16 blocks" in out

    status, out, _ = await cli(url, "cache", "unpin", PROMPT)
    assert (status, out) == (ExitStatus.OK, "unpinned 10 of 10 blocks\n")
    assert len(node.store.retention.pins) == 0

    # One node alone already holds every block once.
    status, out, _ = await cli(url, "cache", "replicas", PROMPT, "--replicas", "1", "--json")
    doc = json.loads(out)
    assert (doc["holders_after"], doc["short"], doc["nodes"]) == ([1] * 10, 0, {})
    status, _, err = await cli(url, "cache", "replicas", PROMPT)
    assert status == ExitStatus.USAGE and "--replicas N" in err
    status, _, err = await cli(url, "cache", "pin", PROMPT, "--hashes", hashes[0].hex())
    assert status == ExitStatus.USAGE and "not both" in err
