"""``node.data_dir`` is where a node keeps its files: a relative SSD tier path
is created under it, not under the directory the daemon started in."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.timeout(60)
async def test_the_ssd_tier_is_made_under_the_data_dir(
    node_factory: Callable[..., Awaitable[Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, cwd = tmp_path / "state", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    node = await node_factory(
        node={"data_dir": str(state)},
        store={"ssd_path": "kv-ssd", "ssd_bytes": 8 << 20, "dram_bytes": 4 << 20},
    )
    assert node.config.store.ssd_path == str(state / "kv-ssd")
    assert (state / "kv-ssd").is_dir() and os.listdir(state / "kv-ssd")
    assert os.listdir(cwd) == []
