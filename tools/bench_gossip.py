"""Gossip at scale: convergence time, bandwidth, block-index apply rate and memory.

One command, everything in one process:

    PYTHONPATH=. python tools/bench_gossip.py [--sizes 10,25,50,100,128] [--trials 5]

1. Clusters of each size, every node a ``ClusterService`` on its own real
   loopback UDP socket and TCP listener, all in one event loop, at the
   default ``ClusterConfig`` intervals. After the membership converges:
   - idle bandwidth: bytes sent per node per second with nothing changing;
   - convergence: a random node changes its load; the time until every node's
     view shows the new state version (median and max of ``--trials``);
   - churn bandwidth: every node changes its load once a second.
   Then the fits ``t = a + b ln N`` and ``t = a + b N`` over the sizes (R² of
   each), and the goal check: a change reaches 100+ nodes within 2 s.
2. Block index: 1M events (80% stores, 20% removals) published, flushed in
   batches of 1,000, sealed into wire packets; the receiving side's
   open + decode + apply rate in events per CPU second, against a baseline
   that applies the same packets one Python step per event.
3. Memory of one node's replica of 1M blocks, measured with tracemalloc.

All nodes share one core's worth of Python here, so the convergence times are
upper bounds of what separate processes would see.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import math
import os
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import replace

from mooncaked.cluster import wire
from mooncaked.cluster.gossip.core import GossipCore
from mooncaked.cluster.gossip.service import ClusterService
from mooncaked.cluster.state import (
    BlockLog,
    BlockOp,
    LocalState,
    MemberStatus,
    NodeBlocks,
    Tier,
)
from mooncaked.config import ClusterConfig, LogConfig
from mooncaked.log import configure_logging

SECRET = b"bench-gossip-secret"


# ------------------------------------------------------------------ clusters


class BenchCluster:
    def __init__(self, n: int, config: ClusterConfig, seed: int) -> None:
        self.n = n
        self.config = config
        self.rng = random.Random(seed)
        self.loads = {f"b{i:03d}": LocalState(model_id="bench") for i in range(n)}
        self.services: list[ClusterService] = []

    def _local(self, node_id: str) -> Callable[[], LocalState]:
        return lambda: self.loads[node_id]

    async def start(self) -> None:
        first = ClusterService(
            self.config, "b000", SECRET, local_state=self._local("b000"), rng=random.Random(0)
        )
        await first.start()
        self.services.append(first)
        seeds = (f"127.0.0.1:{first.gossip_port}",)
        cfg = replace(self.config, seeds=seeds)
        for i in range(1, self.n):
            node_id = f"b{i:03d}"
            s = ClusterService(
                cfg, node_id, SECRET, local_state=self._local(node_id), rng=random.Random(i)
            )
            await s.start()
            self.services.append(s)

    async def close(self) -> None:
        for s in self.services:
            await s.close()

    def converged(self) -> bool:
        for s in self.services:
            members = s.view.members
            if len(members) != self.n:
                return False
            for m in members.values():
                if m.status is not MemberStatus.ALIVE or m.state is None:
                    return False
        return True

    def bytes_sent(self) -> int:
        return sum(s.counters.bytes_sent for s in self.services)

    def dropped_broadcasts(self) -> int:
        return sum(s.counters.dropped_broadcasts for s in self.services)


async def wait_until(cond: Callable[[], bool], limit: float, step: float = 0.005) -> float | None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not cond():
        if loop.time() - start > limit:
            return None
        await asyncio.sleep(step)
    return loop.time() - start


async def bandwidth(cluster: BenchCluster, seconds: float) -> float:
    before = cluster.bytes_sent()
    await asyncio.sleep(seconds)
    return (cluster.bytes_sent() - before) / cluster.n / seconds


async def one_change(cluster: BenchCluster) -> float | None:
    origin = cluster.rng.choice(cluster.services)
    node_id = origin.node_id
    cur = cluster.loads[node_id]
    cluster.loads[node_id] = replace(
        cur, load=replace(cur.load, queued_prefill_tokens=cur.load.queued_prefill_tokens + 1)
    )
    origin.refresh_state()
    me = origin.view.members[node_id].state
    if me is None:
        raise RuntimeError("the origin has no state of its own")
    version = me.version

    def everyone() -> bool:
        for s in cluster.services:
            st = s.view.members[node_id].state
            if st is None or st.version < version:
                return False
        return True

    return await wait_until(everyone, 30.0)


async def churn(cluster: BenchCluster, seconds: float) -> float:
    """Every node changes its load once a second, staggered; returns bytes/node/s."""
    stop = asyncio.Event()

    async def changer(s: ClusterService, offset: float) -> None:
        await asyncio.sleep(offset)
        while not stop.is_set():
            cur = cluster.loads[s.node_id]
            cluster.loads[s.node_id] = replace(
                cur, load=replace(cur.load, running_decode_batch=cur.load.running_decode_batch + 1)
            )
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass

    async with asyncio.TaskGroup() as tg:
        for s in cluster.services:
            tg.create_task(changer(s, cluster.rng.random()))
        await asyncio.sleep(1.0)  # let every changer start
        bps = await bandwidth(cluster, seconds)
        stop.set()
    return bps


async def run_size(n: int, trials: int, config: ClusterConfig) -> dict[str, float]:
    cluster = BenchCluster(n, config, seed=n)
    t0 = time.perf_counter()
    try:
        await cluster.start()
        joined = await wait_until(cluster.converged, 120.0, step=0.05)
        if joined is None:
            raise RuntimeError(f"{n} nodes did not converge within 120 s")
        join_s = time.perf_counter() - t0
        # Every join is news each node passes on; measure once it all went out.
        settled = await wait_until(
            lambda: sum(s.core.num_pending_broadcasts for s in cluster.services) == 0,
            120.0,
            step=0.1,
        )
        if settled is None:
            raise RuntimeError(f"{n} nodes still gossip join news after 120 s")
        settle_s = time.perf_counter() - t0 - join_s
        idle = await bandwidth(cluster, 3.0)
        times = []
        for _ in range(trials):
            t = await one_change(cluster)
            if t is None:
                raise RuntimeError(f"a change did not reach all {n} nodes within 30 s")
            times.append(t)
            await asyncio.sleep(0.3 + cluster.rng.random() * config.gossip_interval_s)
        drops_before = cluster.dropped_broadcasts()
        busy = await churn(cluster, 3.0)
        drops = cluster.dropped_broadcasts() - drops_before
    finally:
        await cluster.close()
    return {
        "n": n,
        "join_s": join_s,
        "settle_s": settle_s,
        "median_s": statistics.median(times),
        "max_s": max(times),
        "idle_bps": idle,
        "churn_bps": busy,
        "churn_drops": drops,
    }


def fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x; returns (a, b, R²)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    b = sxy / sxx if sxx else 0.0
    a = my - b * mx
    ss_res = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return a, b, (1.0 - ss_res / ss_tot) if ss_tot else 1.0


# ---------------------------------------------------------- simulated network


class SimCluster:
    """The same ``GossipCore`` protocol over an in-memory network on a virtual clock.

    Datagrams arrive instantly and timers fire exactly on time, so the result
    is the protocol's own convergence, free of one process's CPU limits; the
    membership is bootstrapped from one full member list (merged without
    being re-spread) so large sizes start converged without a join storm.
    """

    def __init__(self, n: int, config: ClusterConfig, seed: int) -> None:
        self.now = 1000.0
        self.rng = random.Random(seed)
        self.loads = {i: LocalState(model_id="bench") for i in range(n)}
        self.cores: list[GossipCore] = []
        self.by_addr: dict[tuple[str, int], int] = {}
        for i in range(n):
            core = GossipCore(
                config,
                f"s{i:04d}",
                SECRET,
                clock=lambda: self.now,
                wall_clock=lambda: int(self.now * 1000),
                rng=random.Random(seed * 100_003 + i),
                generation=1000 + i,
                local_state=lambda i=i: self.loads[i],
            )
            addr = ("127.0.0.1", 20000 + i)
            core.bind(addr)
            self.by_addr[addr] = i
            self.cores.append(core)
        entries = []
        for core in self.cores:
            _, frames = core.codec.open(core.sync_packet(), 1 << 30)
            entries.extend(wire.decode_msg(frames[0][1])["members"])
        listing = {"t": "sync_reply", "members": entries}
        for core in self.cores:
            core.merge_sync("bootstrap", listing)
            core.take_outbox()
        self.heap = [(c.next_deadline(), i) for i, c in enumerate(self.cores)]
        heapq.heapify(self.heap)

    def _deliver(self, src: int, touched: set[int]) -> None:
        pending = [(src, self.cores[src].take_outbox())]
        while pending:
            sender, out = pending.pop()
            addr = ("127.0.0.1", 20000 + sender)
            for dst_addr, packet in out:
                dst = self.by_addr[dst_addr]
                self.cores[dst].on_datagram(packet, addr)
                touched.add(dst)
                reply = self.cores[dst].take_outbox()
                if reply:
                    pending.append((dst, reply))
        for core in self.cores:
            # Syncs and pulls are TCP; a converged, quiet cluster needs neither.
            core.sync_requests.clear()

    def run_until(self, done: Callable[[set[int]], bool], limit: float) -> float | None:
        """Runs events until ``done(nodes touched by the last event)``; the virtual time it took."""
        start = self.now
        while True:
            t, i = heapq.heappop(self.heap)
            core = self.cores[i]
            if t != core.next_deadline():
                heapq.heappush(self.heap, (core.next_deadline(), i))
                continue
            if t - start > limit:
                heapq.heappush(self.heap, (t, i))
                return None
            self.now = max(self.now, t)
            core.on_timer()
            touched = {i}
            self._deliver(i, touched)
            for j in touched:
                heapq.heappush(self.heap, (self.cores[j].next_deadline(), j))
            if done(touched):
                return self.now - start

    def idle(self, seconds: float) -> None:
        self.run_until(lambda _touched: False, seconds)

    def one_change(self) -> float | None:
        i = self.rng.randrange(len(self.cores))
        cur = self.loads[i]
        self.loads[i] = replace(
            cur, load=replace(cur.load, queued_prefill_tokens=cur.load.queued_prefill_tokens + 1)
        )
        origin = self.cores[i]
        origin.refresh_local()
        st = origin.view.members[origin.node_id].state
        if st is None:
            raise RuntimeError("the origin has no state of its own")
        version, node_id = st.version, origin.node_id
        missing = set(range(len(self.cores))) - {i}

        def everyone(touched: set[int]) -> bool:
            for j in touched & missing:
                got = self.cores[j].view.members[node_id].state
                if got is not None and got.version >= version:
                    missing.discard(j)
            return not missing

        return self.run_until(everyone, 60.0)


def sim_part(sizes: list[int], trials: int) -> list[dict[str, float]]:
    config = ClusterConfig()
    print("simulated network (same protocol code, virtual clock, instant delivery):")
    print(f"{'nodes':>6} {'conv median s':>14} {'conv max s':>11}")
    rows = []
    for n in sizes:
        sim = SimCluster(n, config, seed=n)
        sim.idle(2.0)  # let the bootstrap news go out
        times = []
        for _ in range(trials):
            t = sim.one_change()
            if t is None:
                raise RuntimeError(f"a simulated change did not reach all {n} nodes")
            times.append(t)
            sim.idle(0.5 + sim.rng.random())
        rows.append({"n": n, "median_s": statistics.median(times), "max_s": max(times)})
        print(f"{n:>6} {rows[-1]['median_s']:>14.3f} {rows[-1]['max_s']:>11.3f}", flush=True)
    report_fit(rows)
    return rows


def report_fit(rows: list[dict[str, float]]) -> None:
    if len(rows) < 3:
        return
    ns = [r["n"] for r in rows]
    med = [r["median_s"] for r in rows]
    a, b, r2_log = fit([math.log(n) for n in ns], med)
    al, bl, r2_lin = fit([float(n) for n in ns], med)
    print(f"fit t = {a:.3f} + {b:.3f} ln N   R² = {r2_log:.3f}")
    print(f"fit t = {al:.3f} + {bl:.5f} N    R² = {r2_lin:.3f}  (linear, for comparison)")


# --------------------------------------------------------------- block index


def block_index_bench(num_events: int, batch: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    origin = BlockLog("origin", 1, NodeBlocks(1), max_log_entries=1 << 30)
    codec = wire.Codec(SECRET, "origin")
    live: list[bytes] = []
    packets: list[bytes] = []
    raw_events: list[tuple[bytes, int, bool]] = []
    t_publish = 0.0
    made = 0
    entries = 0
    while made < num_events:
        events: list[tuple[bytes, Tier, BlockOp]] = []
        for _ in range(batch):
            if live and rng.random() < 0.2:
                h = live.pop(rng.randrange(len(live)))
                events.append((h, Tier.DRAM, BlockOp.REMOVED))
                raw_events.append((h, 1, False))
            else:
                h = rng.randbytes(16)
                live.append(h)
                events.append((h, Tier.DRAM, BlockOp.STORED))
                raw_events.append((h, 1, True))
        made += len(events)
        t = time.process_time()
        origin.record(events)
        delta = origin.flush()
        t_publish += time.process_time() - t
        if delta is not None:
            entries += delta.num_entries
            packets.append(codec.seal([wire.blocks_frame(delta)]))

    receiver = wire.Codec(SECRET, "receiver")

    def batched() -> NodeBlocks:
        replica = NodeBlocks(1)
        for packet in packets:
            _, frames = receiver.open(packet, 1 << 30)
            replica.apply(wire.decode_blocks(frames[0][1]))
        return replica

    def per_event() -> NodeBlocks:
        # Baseline: the same packets, each event sliced out and applied by one
        # Python step, as an index without packed batches would.
        replica = NodeBlocks(1)
        masks = replica.masks
        for packet in packets:
            _, frames = receiver.open(packet, 1 << 30)
            d = wire.decode_blocks(frames[0][1])
            hashes, new_masks = d.hashes, d.masks
            for i in range(len(new_masks)):
                h = hashes[16 * i : 16 * i + 16]
                m = new_masks[i]
                if m:
                    masks[h] = m
                else:
                    masks.pop(h, None)
        return replica

    def timed(fn: Callable[[], NodeBlocks]) -> float:
        gc.collect()
        # CPU time of this process: on a shared machine wall time would also
        # count the time other processes held the core.
        t = time.process_time()
        replica = fn()
        dt = time.process_time() - t
        if replica.masks != origin.index.masks:
            raise RuntimeError("the replica does not match the origin after every delta")
        return dt

    # The first pass pays for fresh pages from the OS; later passes reuse the
    # allocator's memory, as a long-running node does. Alternate the two.
    t_cold = timed(batched)
    t_base = [timed(per_event), 0.0]
    t_warm = timed(batched)
    t_base[1] = timed(per_event)
    return {
        "events": float(num_events),
        "entries": float(entries),
        "publish_eps": num_events / t_publish,
        "apply_cold_eps": num_events / t_cold,
        "apply_eps": num_events / t_warm,
        "baseline_eps": num_events / min(t_base),
    }


def replica_memory(num_blocks: int, seed: int) -> float:
    """Bytes per block of a replica of ``num_blocks`` (dict + keys), via tracemalloc."""
    rng = random.Random(seed)
    packed = rng.randbytes(16 * num_blocks)
    masks = bytes([0b010]) * num_blocks
    from mooncaked.cluster.state import BlockDelta

    delta = BlockDelta("x", 1, 0, num_blocks, packed, masks, num_blocks)
    gc.collect()
    tracemalloc.start()
    replica = NodeBlocks(1)
    replica.apply(delta)
    current, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    if len(replica) != num_blocks:
        raise RuntimeError("replica lost blocks")
    return current / num_blocks


# ---------------------------------------------------------------------- main


async def gossip_part(sizes: list[int], trials: int) -> list[dict[str, float]]:
    config = ClusterConfig()
    print(
        f"defaults: probe {config.probe_interval_s}s, gossip {config.gossip_interval_s}s x "
        f"fanout {config.gossip_fanout}, retransmit x{config.retransmit_mult}, "
        f"sync {config.sync_interval_s}s, {config.max_message_bytes} B datagrams"
    )
    print(
        f"{'nodes':>6} {'join s':>7} {'settle s':>9} {'conv median s':>14} {'conv max s':>11} "
        f"{'idle B/node/s':>14} {'churn B/node/s':>15} {'churn drops':>12}"
    )
    rows = []
    for n in sizes:
        r = await run_size(n, trials, config)
        rows.append(r)
        print(
            f"{n:>6} {r['join_s']:>7.1f} {r['settle_s']:>9.1f} {r['median_s']:>14.3f} {r['max_s']:>11.3f} "
            f"{r['idle_bps']:>14.0f} {r['churn_bps']:>15.0f} {int(r['churn_drops']):>12}",
            flush=True,
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="10,25,50,100,128", help="cluster sizes, comma-separated")
    p.add_argument("--trials", type=int, default=5, help="state changes timed per size")
    p.add_argument("--events", type=int, default=1_000_000, help="block-index events")
    p.add_argument("--skip-gossip", action="store_true", help="only the block-index part")
    p.add_argument("--sim-sizes", default="10,30,100,300,1000", help="simulated sizes ('' to skip)")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    configure_logging(LogConfig(level="warning", format="console"), "bench")

    ok = True
    if not args.skip_gossip:
        try:
            import uvloop

            rows = uvloop.run(gossip_part(sizes, args.trials))
        except ImportError:
            rows = asyncio.run(gossip_part(sizes, args.trials))
        report_fit(rows)
        sim_sizes = [int(x) for x in args.sim_sizes.split(",") if x]
        if sim_sizes:
            sim_part(sim_sizes, args.trials)
        big = [r for r in rows if r["n"] >= 100]
        for r in big:
            hit = r["max_s"] <= 2.0
            ok &= hit
            print(
                f"goal: a change reaches {int(r['n'])} nodes within 2 s: "
                f"{'yes' if hit else 'NO'} (max {r['max_s']:.3f} s)"
            )

    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"block index: {args.events:,} events (80% stores, 20% removals), batches of 1,000")
    b = block_index_bench(args.events, 1000, seed=1)
    print(f"  delta entries after coalescing:  {int(b['entries']):,}")
    print(f"  publish (record + flush):        {b['publish_eps'] / 1e6:6.2f} M events/s")
    print(f"  apply, first pass (cold memory): {b['apply_cold_eps'] / 1e6:6.2f} M events/s")
    print(f"  apply (open + decode + apply):   {b['apply_eps'] / 1e6:6.2f} M events/s")
    print(f"  baseline, one step per event:    {b['baseline_eps'] / 1e6:6.2f} M events/s")
    print(f"  ratio apply / baseline:          {b['apply_eps'] / b['baseline_eps']:6.2f}x")
    hit = b["apply_eps"] >= 1e6
    ok &= hit
    print(f"goal: >= 1M block-index events/s applied: {'yes' if hit else 'NO'}")
    per_block = replica_memory(1_000_000, seed=2)
    print(f"memory: replica of 1M blocks = {per_block:.1f} MB ({per_block:.1f} B/block)")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
