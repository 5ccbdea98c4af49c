"""KV events as a node runs them: off by default, the extra imported only when on,
and a clear error naming the key when it cannot run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mooncaked.config import ClusterConfig, ConfigError
from mooncaked.engine.kv_pool import BlockPool
from mooncaked.kv_events.service import publishing


async def test_off_by_default_imports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "mooncaked.kv_events.publisher", raising=False)
    pool = BlockPool(4)
    async with publishing(ClusterConfig(), pool, block_size=16) as events:
        assert events is None
        assert pool.listeners == [] and pool.run_listeners == []
    assert "mooncaked.kv_events.publisher" not in sys.modules


async def test_a_missing_extra_names_the_key_and_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delitem(sys.modules, "mooncaked.kv_events.publisher", raising=False)
    monkeypatch.setitem(sys.modules, "zmq", None)  # as if pyzmq were not installed
    config = ClusterConfig(kv_events_endpoint=f"ipc://{tmp_path}/kv.sock")
    with pytest.raises(ConfigError) as exc:
        async with publishing(config, BlockPool(4), block_size=16):
            pass
    msg = str(exc.value)
    assert "'cluster.kv_events_endpoint'" in msg
    assert "zmq" in msg and "mooncaked[events]" in msg


async def test_an_endpoint_that_cannot_be_bound_names_the_key(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/missing-dir/kv.sock"
    config = ClusterConfig(kv_events_endpoint=endpoint)
    pool = BlockPool(4)
    with pytest.raises(ConfigError, match=r"'cluster.kv_events_endpoint' = 'ipc://.*cannot bind"):
        async with publishing(config, pool, block_size=16):
            pass
    assert pool.listeners == [] and pool.run_listeners == []


async def test_running_it_attaches_and_counts(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv.sock"
    config = ClusterConfig(
        kv_events_endpoint=endpoint, kv_events_topic="kv", kv_events_format="array"
    )
    pool = BlockPool(4)
    async with publishing(config, pool, block_size=2) as events:
        assert events is not None
        assert len(pool.run_listeners) == 1 and len(pool.listeners) == 1
        ids = pool.allocate(1)
        assert ids is not None
        pool.cache_blocks(ids, [bytes(16)], parent=None, token_ids=[1, 2])
        events.source.flush()
        status = events.status_section()
        assert status["endpoint"] == endpoint
        assert (status["topic"], status["format"]) == ("kv", "array")
        assert status["announced_blocks"] == 1
        assert status["events_dropped"] == 0
    assert pool.listeners == [] and pool.run_listeners == []
    # Sent with no subscriber: PUB drops them, which is no error.
    stats = events.stats()
    assert stats.batches_sent == 2 and stats.send_errors == 0
