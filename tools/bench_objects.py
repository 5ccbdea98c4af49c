"""Objects fetched peer to peer: nodes that fetch together against origin-only fetching.

One command; it starts every daemon itself (``mooncakectl.local``: real
``mooncaked`` processes on loopback, builtin model):

    python tools/bench_objects.py [--size-mib 256] [--shard-mib 16] [--fetchers 3]
                                  [--transports tcp,shm] [--rounds 1]

For each transport, two clusters of one origin and ``--fetchers`` fetchers:

- ``peers``: the default; each fetcher serves every shard as soon as it is
  checked, and the origin hands out each shard once where it can;
- ``origin-only``: ``objects.serve_fetched = false`` on the fetchers, so every
  shard of every copy comes from the origin (the flag that disables peer
  serving).

The origin registers one random file; then every fetcher is asked for it at
the same moment (``POST /admin/objects/get``), and the run ends when the
last copy is whole. Printed per run: the wall time until all copies are
whole, the bytes the origin served (the sum over fetchers of what each read
from it, from their own accounts) as a multiple of the object's size, and
each fetcher's own time; then per transport the ratios peers / origin-only.
Each copy is checked byte for byte against the file.

On one machine every node shares the same cores, memory bandwidth and page
cache, so the origin's "uplink" is no narrower than a peer's: peers save the
origin its bytes, not wall time. Where the origin's network link is the
bottleneck, its bytes are the time.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncakectl.local.cluster import LocalCluster
from mooncakectl.local.plan import NodePlan, plan_cluster
from mooncaked.objects.client import ObjectsClient

MIB = 1 << 20
NAME = "bench/blob"


@dataclass(slots=True)
class Run:
    transport: str
    mode: str
    seconds: float
    origin_bytes: int
    size: int
    per_node_s: list[float]

    @property
    def origin_x(self) -> float:
        return self.origin_bytes / self.size


def write_object(path: Path, size: int) -> str:
    """A file of ``size`` random bytes; its sha256."""
    h = hashlib.sha256()
    with open(path, "wb") as fh:
        left = size
        while left:
            chunk = os.urandom(min(left, 16 * MIB))
            h.update(chunk)
            fh.write(chunk)
            left -= len(chunk)
    return h.hexdigest()


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(16 * MIB):
            h.update(chunk)
    return h.hexdigest()


def sections(args: argparse.Namespace, transport: str, serve: bool, origin: NodePlan) -> Any:
    transports = ["shm", "tcp"] if transport == "shm" else ["tcp"]

    def of(plan: NodePlan) -> dict[str, dict[str, Any]]:
        objects: dict[str, Any] = {
            "shard_bytes": args.shard_mib * MIB,
            "max_fetches": args.max_fetches,
        }
        if plan != origin:
            objects["serve_fetched"] = serve
            # Found at once, before gossip would have spread the manifest.
            objects["peers"] = [f"http://127.0.0.1:{origin.port}"]
        return {
            "transfer": {"transports": transports},
            "objects": objects,
            "kv": {"num_blocks": 64},
            "store": {"dram_bytes": 16 * MIB},
            "conductor": {"profile": False},
            "model": {"cpu_threads": 1},
        }

    return of


def one_run(
    args: argparse.Namespace, work: Path, src: Path, want: str, transport: str, mode: str
) -> Run:
    members = [("origin", "both")] + [(f"fetcher-{i}", "both") for i in range(args.fetchers)]
    plans = plan_cluster(members, fixed_ports=True)
    run_dir = work / f"{transport}-{mode}"
    cluster = LocalCluster(
        plans,
        run_dir,
        sections=sections(args, transport, mode == "peers", plans[0]),
        model="builtin:tiny",
        start_timeout_s=300.0,
    )
    asyncio.run(cluster.start())
    try:
        origin = cluster.node("origin")
        put = ObjectsClient(origin.url).put(NAME, src)
        size = int(put["size"])
        fetchers = [n for n in cluster.nodes if n.node_id != "origin"]
        results: dict[str, dict[str, Any]] = {}
        start = threading.Barrier(len(fetchers) + 1)

        def fetch(url: str, node: str) -> None:
            last: dict[str, Any] = {}
            client = ObjectsClient(url, timeout=600.0)
            start.wait()
            path = client.get(NAME, on_progress=last.update)
            results[node] = {**last, "path": path}

        threads = [
            threading.Thread(target=fetch, args=(n.url, n.node_id), daemon=True) for n in fetchers
        ]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
        if len(results) != len(fetchers):
            raise RuntimeError(f"only {sorted(results)} of the fetchers finished")
        for node, r in results.items():
            if sha256_of(r["path"]) != want:
                raise RuntimeError(f"{node}'s copy differs from the file")
        return Run(
            transport,
            mode,
            seconds,
            sum(int(r["bytes_from"].get("origin", 0)) for r in results.values()),
            size,
            [float(results[n.node_id]["elapsed_s"]) for n in fetchers],
        )
    finally:
        asyncio.run(cluster.stop())
        shutil.rmtree(run_dir, ignore_errors=True)


def report(runs: list[Run], args: argparse.Namespace) -> None:
    size = runs[0].size
    print(
        f"object: {size / MIB:.1f} MiB in shards of {args.shard_mib} MiB; "
        f"{args.fetchers} nodes fetch it at once from 1 origin; {args.rounds} round(s), medians"
    )
    print(
        f"{'transport':<10} {'mode':<12} {'time_s':>7} {'origin served':>14} "
        f"{'x object':>9}  per-fetcher s"
    )
    by: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        by.setdefault((r.transport, r.mode), []).append(r)
    medians: dict[tuple[str, str], tuple[float, float]] = {}
    for (transport, mode), rs in by.items():
        t = statistics.median(r.seconds for r in rs)
        x = statistics.median(r.origin_x for r in rs)
        medians[(transport, mode)] = (t, x)
        per = " ".join(f"{s:.2f}" for s in rs[len(rs) // 2].per_node_s)
        print(f"{transport:<10} {mode:<12} {t:>7.2f} {x * size / MIB:>10.0f} MiB {x:>8.2f}x  {per}")
    for transport in dict.fromkeys(r.transport for r in runs):
        p, o = medians.get((transport, "peers")), medians.get((transport, "origin-only"))
        if p and o:
            print(
                f"{transport}: peers / origin-only: time {p[0] / o[0]:.2f}x, "
                f"origin bytes {p[1] / o[1]:.2f}x ({p[1]:.2f}x vs {o[1]:.2f}x the object)"
            )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--shard-mib", type=int, default=16)
    p.add_argument("--fetchers", type=int, default=3)
    p.add_argument("--max-fetches", type=int, default=4, help="objects.max_fetches of each node")
    p.add_argument("--transports", default="tcp,shm", help="comma-separated: tcp, shm")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    transports = [t for t in args.transports.split(",") if t]
    bad = [t for t in transports if t not in ("tcp", "shm")]
    if bad:
        p.error(f"unknown transport(s) {bad}; use tcp, shm")
    work = Path(tempfile.mkdtemp(prefix="bench-objects-"))
    try:
        src = work / "blob.bin"
        want = write_object(src, args.size_mib * MIB)
        runs = []
        for _ in range(args.rounds):
            for transport in transports:
                for mode in ("peers", "origin-only"):
                    runs.append(one_run(args, work, src, want, transport, mode))
                    r = runs[-1]
                    print(
                        f"  {transport} {mode}: {r.seconds:.2f} s, origin served {r.origin_x:.2f}x",
                        flush=True,
                    )
        report(runs, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
