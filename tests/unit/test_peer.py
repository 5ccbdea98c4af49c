"""Peer block fetch without an engine: two tiered stores, two transfer engines
and the holder's internal RPC, all real, on loopback in one process.

The holder's DRAM slots live in a shared segment of its transfer engine; the
reader leases them over HTTP, reads them in one transfer batch into its own
DRAM slots and releases the lease.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from aiohttp import web

from mooncaked.api.internal import InternalAPI
from mooncaked.cache.dram import Clock
from mooncaked.cache.hashing import block_hashes
from mooncaked.cache.peer import LeaseDesk, PeerFetcher, StaticPeers
from mooncaked.cache.store import BlockLayout, Tier, TieredStore
from mooncaked.config import StoreConfig, TransferConfig
from mooncaked.transfer import TransferEngine
from mooncaked.wire.kv_io import TransferBlockReader
from mooncaked.wire.lease import Holding, LeaseClient

LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
BB = LAYOUT.block_bytes
SECRET = b"peer-unit-secret"
HASHES = block_hashes(list(range(4 * 12)), 4, "test-model")
SEGMENT = "kv.dram"


def rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BB), dtype=torch.uint8, generator=g)


@dataclass
class Side:
    name: str
    store: TieredStore
    transfer: TransferEngine
    desk: LeaseDesk
    url: str = ""
    fetcher: PeerFetcher | None = None
    # Its process's generation: signed calls to it name it.
    generation: int = 1


async def make(
    stack: AsyncExitStack,
    name: str,
    tmp: Path,
    *,
    transports: tuple[str, ...] = ("shm", "tcp"),
    secret: bytes = SECRET,
    peers: tuple[str, ...] = (),
    ssd: bool = False,
    lease_timeout_s: float = 30.0,
    timeout_s: float = 5.0,
    generation: int = 1,
    port: int = 0,
    clock: Clock = time.monotonic,
) -> Side:
    """One node's cache side; everything it starts is closed with ``stack``."""
    cfg = StoreConfig(
        dram_bytes=16 * BB,
        ssd_path=str(tmp / f"{name}-ssd") if ssd else "",
        ssd_bytes=64 * 8192,
        ssd_io_threads=2,
        lease_timeout_s=lease_timeout_s,
    )
    transfer = TransferEngine(TransferConfig(transports=transports), name, secret)
    await transfer.start()
    stack.push_async_callback(transfer.close)
    segment = transfer.allocate(SEGMENT, TieredStore.dram_slots_for(cfg, LAYOUT) * BB)
    store = TieredStore(LAYOUT, cfg, clock=clock, pin_memory=False, dram_backing=segment.view)
    await store.start()
    stack.push_async_callback(store.close)
    desk = LeaseDesk(store, max_leases=2, clock=clock)
    holding = Holding(
        desk, BB, LAYOUT.fingerprint(), transfer.descriptor(SEGMENT), transfer.address
    )
    api = InternalAPI(
        secret=secret, node_id=lambda: name, generation=generation, holding=lambda: holding
    )
    app = web.Application()
    app.add_routes(api.routes())
    runner = web.AppRunner(app)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    port = runner.addresses[0][1]
    s = Side(name, store, transfer, desk, f"http://127.0.0.1:{port}", generation=generation)
    client = LeaseClient(
        secret=secret, node_id=lambda: name, block_bytes=BB, layout=LAYOUT.fingerprint()
    )
    await client.start()
    stack.push_async_callback(client.close)
    s.fetcher = PeerFetcher(
        store,
        StaticPeers(peers),
        client,
        TransferBlockReader(transfer, SEGMENT),
        timeout_s=timeout_s,
        max_fetches=4,
    )
    stack.push_async_callback(s.fetcher.close)
    return s


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as st:
        yield st


async def put(s: Side, hashes: list[bytes], data: torch.Tensor) -> None:
    fut = s.store.offload(hashes, data)
    assert fut is not None
    assert await fut == len(hashes)


async def read_back(s: Side, hashes: list[bytes]) -> torch.Tensor:
    out = torch.zeros((len(hashes), BB), dtype=torch.uint8)
    assert await s.store.load(hashes, out) == len(hashes)
    return out


@pytest.mark.parametrize("transports", [("tcp",), ("shm", "tcp")])
async def test_fetch_pulls_the_longest_prefix_from_the_peer_with_most(
    stack: AsyncExitStack, tmp_path: Path, transports: tuple[str, ...]
) -> None:
    big = await make(stack, "big", tmp_path)
    small = await make(stack, "small", tmp_path)
    data = rows(8, seed=1)
    await put(big, HASHES[:8], data)
    await put(small, HASHES[:3], data[:3])
    reader = await make(
        stack, "reader", tmp_path, transports=transports, peers=(small.url, big.url)
    )
    assert reader.fetcher is not None
    # Block 0 is local already: only 1..9 are asked for, 1..7 found.
    await put(reader, HASHES[:1], data[:1])
    assert await reader.fetcher.fetch(HASHES[:10]) == 8
    assert torch.equal(await read_back(reader, HASHES[:8]), data)
    assert reader.store.lookup(HASHES[:10], record_stats=False).tiers == (Tier.DRAM,) * 8
    st = reader.fetcher.stats()
    assert (st.fetches, st.ok, st.blocks, st.bytes) == (1, 1, 7, 7 * BB)
    m = reader.transfer.metrics()
    assert m.bytes_by_transport == {transports[0]: 7 * BB}
    # The loser's lease was given back, the winner's released after the read.
    for holder, blocks in ((big, 7), (small, 2)):
        ls = holder.desk.stats()
        assert (ls.granted, ls.blocks_granted, ls.released, ls.active) == (1, blocks, 1, 0)
        holder.store.dram.check_integrity()
        assert holder.store.dram.num_leases == 0
    reader.store.dram.check_integrity()
    # Everything local now: nobody is asked again.
    assert await reader.fetcher.fetch(HASHES[:8]) == 8
    assert reader.fetcher.stats().fetches == 1


async def test_ssd_blocks_are_promoted_before_they_are_leased(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    holder = await make(stack, "holder", tmp_path, ssd=True)
    data = rows(5, seed=2)
    await put(holder, HASHES[:5], data)
    await holder.store.flush()
    holder.store.dram.clear()
    assert holder.store.lookup(HASHES[:5], record_stats=False).tiers == (Tier.SSD,) * 5
    reader = await make(stack, "reader", tmp_path, peers=(holder.url,))
    assert reader.fetcher is not None
    assert await reader.fetcher.fetch(HASHES[:5]) == 5
    assert torch.equal(await read_back(reader, HASHES[:5]), data)
    assert holder.store.lookup(HASHES[:5], record_stats=False).tiers == (Tier.DRAM,) * 5


async def test_a_lapsed_lease_discards_what_was_read(stack: AsyncExitStack, tmp_path: Path) -> None:
    # Leases end a nanosecond after they are granted: by the release, the
    # holder may have reused the slots, so the reader must not keep the bytes.
    holder = await make(stack, "holder", tmp_path, lease_timeout_s=1e-9)
    await put(holder, HASHES[:4], rows(4, seed=3))
    reader = await make(stack, "reader", tmp_path, peers=(holder.url,))
    assert reader.fetcher is not None
    assert await reader.fetcher.fetch(HASHES[:4]) == 0
    st = reader.fetcher.stats()
    assert (st.failed, st.lapsed, st.ok, st.blocks) == (1, 1, 0, 0)
    assert reader.transfer.metrics().bytes_read == 4 * BB  # read, then thrown away
    assert reader.store.dram.num_cached == 0 and reader.store.dram.num_pending == 0
    assert holder.desk.stats().lapsed == 1
    reader.store.dram.check_integrity()


async def test_a_lease_whose_release_never_comes_ends_when_stats_are_read(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    # The reader was cut off (a partition) between its lookup and its release,
    # and no other reader asks: the lease still ends at its deadline.
    now = [100.0]
    holder = await make(stack, "holder", tmp_path, lease_timeout_s=5.0, clock=lambda: now[0])
    await put(holder, HASHES[:3], rows(3, seed=7))
    desk = holder.desk
    grant = await desk.grant(HASHES[:3], "gone", 10.0)
    assert grant is not None
    assert (desk.stats().active, holder.store.dram.num_leases) == (1, 1)
    now[0] += 5.0
    assert desk.stats().active == 1  # at its deadline, not past it
    now[0] += 0.001
    st = desk.stats()
    assert (st.active, st.lapsed, st.released) == (0, 1, 0)
    assert holder.store.dram.num_leases == 0
    assert desk.release(grant.lease_id) is False
    holder.store.dram.check_integrity()


async def test_bad_secret_dead_peer_and_empty_peer_mean_compute(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    holder = await make(stack, "holder", tmp_path)
    empty = await make(stack, "empty", tmp_path)
    await put(holder, HASHES[:4], rows(4, seed=4))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nobody listens
    stranger = await make(
        stack, "stranger", tmp_path, secret=b"another-cluster", peers=(holder.url, dead)
    )
    assert stranger.fetcher is not None
    assert await stranger.fetcher.fetch(HASHES[:4]) == 0
    st = stranger.fetcher.stats()
    assert (st.failed, st.lookup_errors, st.missed) == (1, 2, 0)
    assert holder.desk.stats().granted == 0
    reader = await make(stack, "reader", tmp_path, peers=(empty.url,))
    assert reader.fetcher is not None
    assert await reader.fetcher.fetch(HASHES[:4]) == 0
    st = reader.fetcher.stats()
    assert (st.missed, st.failed, st.lookup_errors) == (1, 0, 0)
    assert empty.desk.stats().empty == 1


async def test_concurrent_fetches_of_one_prefix_lease_it_once(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    holder = await make(stack, "holder", tmp_path)
    data = rows(6, seed=5)
    await put(holder, HASHES[:6], data)
    reader = await make(stack, "reader", tmp_path, peers=(holder.url,))
    assert reader.fetcher is not None
    got = await asyncio.gather(*(reader.fetcher.fetch(HASHES[:6]) for _ in range(3)))
    assert got == [6, 6, 6]
    assert holder.desk.stats().granted == 1
    assert torch.equal(await read_back(reader, HASHES[:6]), data)


async def test_holder_refuses_beyond_max_leases_and_ends_lapsed_ones(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    holder = await make(stack, "holder", tmp_path)
    await put(holder, HASHES[:3], rows(3, seed=6))
    desk = holder.desk  # max_leases=2
    a = await desk.grant(HASHES[:3], "r1", 10.0)
    b = await desk.grant(HASHES[:2], "r2", 10.0)
    assert a is not None and b is not None
    slots = [holder.store.dram.get_slot(h) for h in HASHES[:3]]
    assert a.offsets == tuple(holder.store.dram.slot_offset(s) for s in slots)  # type: ignore[arg-type]
    assert await desk.grant(HASHES[:1], "r3", 10.0) is None
    assert desk.stats().refused == 1
    assert desk.release(b.lease_id) is True
    assert desk.release(b.lease_id) is False
    assert await desk.grant(HASHES[5:6], "r3", 10.0) is None  # not held
    assert desk.stats().empty == 1
    assert desk.close() == 1
    assert desk.release(a.lease_id) is False
    assert holder.store.dram.num_leases == 0
    holder.store.dram.check_integrity()


async def test_reserved_slots_are_dropped_by_a_clear_in_between(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    s = await make(stack, "solo", tmp_path)
    await put(s, HASHES[2:3], rows(1, seed=7))
    res = s.store.reserve(HASHES[:4])
    # Stops at block 2, which DRAM has.
    assert res is not None and res.hashes == tuple(HASHES[:2])
    with pytest.raises(ValueError, match="num_filled"):
        s.store.commit_reserved(res, 3)
    await s.store.clear()
    assert s.store.commit_reserved(res, 2) == 0
    assert s.store.dram.num_cached == 0
    res = s.store.reserve(HASHES[:2])
    assert res is not None and s.store.commit_reserved(res, 1) == 1
    assert s.store.lookup(HASHES[:2], record_stats=False).num_blocks == 1
    s.store.dram.check_integrity()


async def test_would_ask_only_when_something_is_missing_and_someone_to_ask(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    holder = await make(stack, "holder", tmp_path)
    await put(holder, HASHES[:4], rows(4, seed=9))
    alone = await make(stack, "alone", tmp_path)
    assert alone.fetcher is not None
    # Nobody to ask: the engine admits such a prompt at once, and a fetch
    # that is made anyway asks nobody (and counts it).
    assert not alone.fetcher.would_ask(HASHES[:4])
    assert await alone.fetcher.fetch(HASHES[:4]) == 0
    st = alone.fetcher.stats()
    assert (st.nobody_to_ask, st.fetches, st.missed) == (1, 0, 0)
    reader = await make(stack, "reader", tmp_path, peers=(holder.url,))
    assert reader.fetcher is not None
    assert reader.fetcher.would_ask(HASHES[:4])
    assert await reader.fetcher.fetch(HASHES[:4]) == 4
    # All local now: nothing to ask for.
    assert not reader.fetcher.would_ask(HASHES[:4])
    assert reader.fetcher.would_ask(HASHES[:5])
    assert reader.fetcher.stats().nobody_to_ask == 0


async def test_a_read_the_first_holder_cannot_finish_goes_on_from_the_standby(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    # Both hold the prefix; the first's lease lapses at once (as a holder that
    # ended it early, or died, could not say it held), so its bytes are thrown
    # away and the standby offer, kept for this, gives them.
    first = await make(stack, "first", tmp_path, lease_timeout_s=1e-9)
    second = await make(stack, "second", tmp_path)
    data = rows(6, seed=11)
    await put(first, HASHES[:6], data)
    await put(second, HASHES[:6], data)
    reader = await make(stack, "reader", tmp_path, peers=(first.url, second.url))
    assert reader.fetcher is not None
    assert await reader.fetcher.fetch(HASHES[:6]) == 6
    assert torch.equal(await read_back(reader, HASHES[:6]), data)
    st = reader.fetcher.stats()
    assert (st.ok, st.failed, st.blocks, st.lapsed, st.failovers) == (1, 0, 6, 1, 1)
    for holder in (first, second):
        assert holder.desk.stats().active == 0
        holder.store.dram.check_integrity()
    reader.store.dram.check_integrity()


async def test_a_holder_gone_after_its_lease_costs_no_recompute(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    # The longer holder withdraws its DRAM segment right after it leased the
    # blocks (a node stopping): the read from it fails, and the standby,
    # holding fewer blocks, gives what it has; the rest is computed.
    gone = await make(stack, "gone", tmp_path)
    other = await make(stack, "other", tmp_path)
    data = rows(8, seed=12)
    await put(gone, HASHES[:8], data)
    await put(other, HASHES[:5], data[:5])
    grant = gone.desk.grant

    async def grant_then_vanish(*args: object, **kwargs: object) -> object:
        out = await grant(*args, **kwargs)  # type: ignore[arg-type]
        gone.transfer.unregister(SEGMENT)
        return out

    gone.desk.grant = grant_then_vanish  # type: ignore[method-assign]
    reader = await make(stack, "reader", tmp_path, peers=(gone.url, other.url))
    assert reader.fetcher is not None
    assert await reader.fetcher.fetch(HASHES[:8]) == 5
    assert torch.equal(await read_back(reader, HASHES[:5]), data[:5])
    st = reader.fetcher.stats()
    assert (st.ok, st.blocks, st.failovers) == (1, 5, 1)
    reader.store.dram.check_integrity()
    assert reader.store.dram.num_pending == 0
