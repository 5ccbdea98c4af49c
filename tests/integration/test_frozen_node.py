"""A frozen node (SIGSTOP: it neither answers nor closes a connection) costs its
requests the time gossip takes to declare it dead, not a timeout.

The grant time to live is set to 120 s here and every request must finish
within 60 s: without cutting in-flight calls on the membership change, the
calls to the frozen node would wait for the grant (or forever, for a
stream), and the requests would not finish in time.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_disagg_faults import (
    Cluster,
    burst,
    complete,
    decode_node_fault_mid_stream,
    reference,
    three_done,
)

# Clusters of daemon processes, one frozen mid-request: the router's resume
# loop has fast unit tests (tests/unit/test_router_resume.py).
pytestmark = pytest.mark.slow

GRANT_TTL_S = 120.0
# Far below the grant time to live; far above gossip's few seconds.
FINISH_S = 60.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with Cluster(tmp_path, grant_ttl_s=GRANT_TTL_S) as c:
        yield c


def test_frozen_prefill_node_requests_move_to_the_next(cluster: Cluster, tmp_path: Path) -> None:
    prompts = burst(16, seed=11)
    want = reference(tmp_path, prompts)
    d = cluster.start_all({"p1": "prefill", "p2": "prefill", "d1": "decode"})["d1"]

    async def run() -> tuple[list[tuple[str, dict[str, str]]], float]:
        tasks = [asyncio.ensure_future(complete(d.url, p)) for p in prompts]
        await three_done(tasks, FINISH_S)
        cluster.nodes["p1"].proc.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        got = await asyncio.wait_for(asyncio.gather(*tasks), FINISH_S)
        return list(got), time.monotonic() - frozen_at

    got, after_s = asyncio.run(run())
    print(f"all {len(got)} requests done {after_s:.1f} s after the freeze")
    assert [g[0] for g in got] == want
    assert {h["x-mooncaked-decode-node"] for _, h in got} == {"d1"}
    for nid in ("p2", "d1"):
        cluster.assert_clean(nid)
    cluster.nodes["p1"].proc.send_signal(signal.SIGCONT)


def test_frozen_decode_node_mid_stream_resumes_elsewhere(cluster: Cluster, tmp_path: Path) -> None:
    # The entry's stream from a frozen decode node would otherwise wait forever.
    victim = decode_node_fault_mid_stream(cluster, tmp_path, signal.SIGSTOP, 120, FINISH_S)
    cluster.nodes[victim].proc.send_signal(signal.SIGCONT)
