"""tools/bench_peer_read.py (section 5 of tools/bench_cache.py) runs its cases:
one holder, and a first holder whose lease lapses so the standby reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_peer_read


@pytest.mark.parametrize("failover", [False, True])
async def test_a_prefix_is_read_whole_call_by_call(failover: bool) -> None:
    # Raises when a fetch brings fewer than the 16 blocks.
    out = await bench_peer_read._measure("tcp", 2, failover)
    assert set(out) == {"lease", "read", "release", "fetch"}
    assert all(v > 0 for v in out.values())
