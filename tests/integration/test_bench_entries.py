"""``mooncakectl bench --entries``: one run's requests spread over several
nodes of a real loopback cluster, each node the entry of its share."""

from __future__ import annotations

import asyncio
import io
import json
import random
from pathlib import Path

from mooncakectl.cli import run
from mooncakectl.registry import Env, ExitStatus
from tests.integration.clusters import ClusterFactory


async def test_random_workload_enters_at_both_nodes_of_a_cluster(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    # 1P+1D: the prefill node is an entry too (any node serves the OpenAI API).
    cluster = await cluster_factory(["prefill", "decode"])
    prefill, decode = cluster.nodes
    urls = [prefill.url, decode.url]
    out = tmp_path / "result.json"
    env = Env(stdout=io.StringIO(), stderr=io.StringIO(), environ={}, stdout_isatty=False)
    argv = [
        "bench", "random",
        "--entries", ",".join(urls),
        "--num-prompts", "12",
        "--random-input-len", "24",
        "--random-output-len", "4",
        "--max-concurrency", "4",
        "--num-warmups", "2",
        "--seed", "5",
        "--result-json", str(out),
    ]  # fmt: skip
    status = await asyncio.to_thread(run, argv, env)
    assert status == ExitStatus.OK, env.stderr.getvalue()  # type: ignore[attr-defined]
    result = json.loads(out.read_text())
    timed = [r for r in result["requests"] if not r["warmup"]]
    warm = [r for r in result["requests"] if r["warmup"]]
    assert len(timed) == 12 and len(warm) == 2
    assert all(r["error_kind"] is None for r in result["requests"])
    # Each request went where random.Random(--seed) drew it, in index order,
    # the timed requests first, then the warm-ups.
    rng = random.Random(5)
    by_index = sorted(timed, key=lambda r: r["index"]) + sorted(warm, key=lambda r: -r["index"])
    assert [r["entry"] for r in by_index] == [rng.choice(urls) for _ in by_index]
    per_entry = {u: sum(1 for r in timed if r["entry"] == u) for u in urls}
    assert all(per_entry.values()), per_entry
    s = result["summary"]
    assert s["completed"] == 12 and s["nodes"]["entry"] == per_entry
    # Whichever node it entered at, every request was prefilled on the
    # prefill node and decoded on the decode node.
    assert s["nodes"]["prefill"] == {prefill.node_id: 12}
    assert s["nodes"]["decode"] == {decode.node_id: 12}
    assert result["config"]["entries"] == urls and result["config"]["url"] == urls[0]
    # Each node placed what entered at it: its share, the first one also
    # the probe's one request of token ids.
    for i, node in enumerate(cluster.nodes):
        sent = sum(1 for r in result["requests"] if r["entry"] == node.url) + (i == 0)
        assert node.router.num_local + node.router.num_forwarded == sent, node.node_id
    assert "Entry nodes" in env.stdout.getvalue()  # type: ignore[attr-defined]
    cluster.assert_clean()
