from __future__ import annotations

import socket

import pytest

from mooncaked.api.services import Lifecycle
from mooncaked.config import NodeConfig
from mooncaked.identity import NodeIdentity


def test_a_named_node_keeps_its_name_and_an_unnamed_one_is_named_by_host_and_port() -> None:
    assert NodeConfig(id="n1").id_at(8000) == "n1"
    assert NodeConfig().id_at(8001) == f"{socket.gethostname()}-8001"


def test_identity_reads_the_secret_once_from_the_config() -> None:
    identity = NodeIdentity.of(NodeConfig(id="n1", cluster_secret="s" * 32), port=0, generation=7)
    assert identity == NodeIdentity("n1", b"s" * 32, 7)


def test_a_generation_must_be_positive() -> None:
    with pytest.raises(ValueError, match="generation must be > 0, got 0"):
        NodeIdentity("n1", b"s" * 32, 0)


async def test_a_drain_is_requested_once_and_stops_the_node_when_unsupervised() -> None:
    stops: list[str] = []

    async def stop() -> None:
        stops.append("stop")

    lifecycle = Lifecycle(lambda: 0.0, stop)
    assert lifecycle.request_drain() is True
    assert lifecycle.request_drain() is False
    await lifecycle.wait_stop()
    assert lifecycle._stop_task is not None
    await lifecycle._stop_task
    assert stops == ["stop"]


def test_the_first_failure_is_kept_and_the_node_is_no_longer_ready() -> None:
    async def stop() -> None:
        raise AssertionError("not under test")

    lifecycle = Lifecycle(lambda: 0.0, stop)
    lifecycle.set_serving(True)
    assert lifecycle.ready
    first, second = RuntimeError("first"), RuntimeError("second")
    assert lifecycle.fail(first) is True
    assert lifecycle.fail(second) is False
    assert lifecycle.failure is first and not lifecycle.ready and lifecycle.failed.is_set()
