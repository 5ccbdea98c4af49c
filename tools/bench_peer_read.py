"""Section 5 of ``tools/bench_cache.py``: one prefix read from a peer, call by call.

A holder and a reader in one process, each with its tiered store, its
transfer engine and (the holder) its internal API on loopback, as two nodes
have them. The reader fetches one prefix of 16 blocks of a SmolLM2-135M
layout (30 layers, 3 KV heads of 64, bf16: 5.9 MB) again and again (dropping
its copy each time), and the time of each call of the read path is taken
apart: the lease (an HTTP call), the read (the transfer engine) and the
release (an HTTP call). Then the same with a second holder whose lease lapses
at once, so that every read goes on from the standby offer.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import torch
from aiohttp import web

from mooncaked.api.internal import InternalAPI
from mooncaked.cache.dram import BlockLayout
from mooncaked.cache.hashing import block_hashes
from mooncaked.cache.peer import LeaseDesk, PeerFetcher, StaticPeers
from mooncaked.cache.store import TieredStore
from mooncaked.config import StoreConfig, TransferConfig
from mooncaked.transfer import TransferEngine
from mooncaked.wire.kv_io import TransferBlockReader
from mooncaked.wire.lease import Holding, LeaseClient

SECRET = b"bench-peer-read-secret"
SEGMENT = "kv.dram"
LAYOUT = BlockLayout(30, 16, 3, 64, torch.bfloat16)
NUM_BLOCKS = 16


async def _node(
    stack: AsyncExitStack, name: str, transport: str, *, lease_s: float = 30.0
) -> tuple[TieredStore, TransferEngine, str, LeaseClient]:
    cfg = StoreConfig(dram_bytes=64 * LAYOUT.block_bytes, lease_timeout_s=lease_s)
    transfer = TransferEngine(TransferConfig(transports=(transport,)), name, SECRET)
    await transfer.start()
    stack.push_async_callback(transfer.close)
    segment = transfer.allocate(
        SEGMENT, TieredStore.dram_slots_for(cfg, LAYOUT) * LAYOUT.block_bytes
    )
    store = TieredStore(LAYOUT, cfg, pin_memory=False, dram_backing=segment.view)
    await store.start()
    stack.push_async_callback(store.close)
    desk = LeaseDesk(store, max_leases=8)
    holding = Holding(
        desk,
        LAYOUT.block_bytes,
        LAYOUT.fingerprint(),
        transfer.descriptor(SEGMENT),
        transfer.address,
    )
    api = InternalAPI(secret=SECRET, node_id=lambda: name, generation=1, holding=lambda: holding)
    app = web.Application()
    app.add_routes(api.routes())
    runner = web.AppRunner(app)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    client = LeaseClient(
        secret=SECRET,
        node_id=lambda: name,
        block_bytes=LAYOUT.block_bytes,
        layout=LAYOUT.fingerprint(),
    )
    await client.start()
    stack.push_async_callback(client.close)
    return store, transfer, f"http://127.0.0.1:{runner.addresses[0][1]}", client


def _timed(
    phases: dict[str, list[float]], name: str, call: Callable[..., Any]
) -> Callable[..., Any]:
    async def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await call(*args, **kwargs)
        finally:
            phases[name].append(time.perf_counter() - t0)

    return run


async def _measure(transport: str, repeats: int, failover: bool) -> dict[str, float]:
    async with AsyncExitStack() as stack:
        hashes = block_hashes(list(range(NUM_BLOCKS * 16)), 16, "bench-peer-read")
        data = torch.randint(0, 256, (NUM_BLOCKS, LAYOUT.block_bytes), dtype=torch.uint8)
        holders = []
        for name, lease_s in (
            (("lapsing", 1e-9), ("holder", 30.0)) if failover else (("holder", 30.0),)
        ):
            store, _, url, _ = await _node(stack, name, transport, lease_s=lease_s)
            fut = store.offload(hashes, data)
            assert fut is not None and await fut == NUM_BLOCKS
            holders.append(url)
        store, transfer, _, client = await _node(stack, "reader", transport)
        phases: dict[str, list[float]] = {"lease": [], "read": [], "release": [], "fetch": []}
        reader = TransferBlockReader(transfer, SEGMENT)
        client.lookup = _timed(phases, "lease", client.lookup)  # type: ignore[method-assign]
        client.release = _timed(phases, "release", client.release)  # type: ignore[method-assign]
        reader.read = _timed(phases, "read", reader.read)  # type: ignore[method-assign]
        fetcher = PeerFetcher(
            store, StaticPeers(tuple(holders)), client, reader, timeout_s=10.0, max_fetches=4
        )
        stack.push_async_callback(fetcher.close)
        for i in range(repeats + 3):
            if i == 3:
                # The first three warm the connections up.
                for v in phases.values():
                    v.clear()
            await store.clear()
            t0 = time.perf_counter()
            got = await fetcher.fetch(hashes)
            phases["fetch"].append(time.perf_counter() - t0)
            if got != NUM_BLOCKS:
                raise RuntimeError(f"fetched {got} of {NUM_BLOCKS} blocks over {transport}")
        # Per call: a failover's fetch makes two of each.
        return {k: statistics.median(v) * 1e3 for k, v in phases.items()}


async def peer_read_section(repeats: int) -> None:
    """Print the read path's calls for one 16-block prefix, per transport."""
    mb = NUM_BLOCKS * LAYOUT.block_bytes / 1e6
    print(
        f"\n## 5. A {NUM_BLOCKS}-block prefix read from a peer ({mb:.1f} MB, SmolLM2 blocks), "
        f"median ms of {repeats}",
        flush=True,
    )
    print(f"{'case':<40} {'lease':>7} {'read':>7} {'release':>8} {'whole fetch':>12}", flush=True)
    for transport in ("shm", "tcp"):
        for failover in (False, True):
            r = await _measure(transport, repeats, failover)
            case = f"{transport}, " + (
                "first holder lapses, standby reads" if failover else "one holder"
            )
            print(
                f"{case:<40} {r['lease']:7.2f} {r['read']:7.2f} {r['release']:8.2f} "
                f"{r['fetch']:12.2f}",
                flush=True,
            )
