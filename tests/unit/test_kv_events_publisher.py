"""The ZMQ publisher: vLLM's framing on a real PUB socket, bound or connected."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from mooncaked.kv_events.events import BlockRemoved, EventBatch
from mooncaked.kv_events.publisher import ZmqPublisher, binds
from mooncaked.kv_events.wire import encode_batch

TOPIC = "kv@node-a@tiny"
# Sequence numbers of the probes sent until a subscription is through; the
# batches under test stay below.
PROBE = 1 << 32


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def await_subscription(pub: ZmqPublisher, sub: zmq.Socket) -> None:
    """Probes until the subscriber gets one: a PUB socket drops what it sends
    before a subscription reaches it (ZMQ's slow joiner)."""
    deadline = time.monotonic() + 10.0
    seq = PROBE
    while not sub.poll(20):
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
        pub.offer(EventBatch(seq, 0.0, ()))
        seq += 1


def received(sub: zmq.Socket, count: int) -> list[list[bytes]]:
    """The next ``count`` messages that are not probes."""
    out: list[list[bytes]] = []
    while len(out) < count:
        assert sub.poll(5000), f"got {len(out)} of {count} messages"
        message = sub.recv_multipart()
        if int.from_bytes(message[1], "big") < PROBE:
            out.append(message)
    return out


def batch(seq: int) -> EventBatch:
    return EventBatch(seq, 100.0 + seq, (BlockRemoved((seq.to_bytes(16, "big"),)),))


def test_bind_or_connect_as_vllm_decides() -> None:
    assert binds("tcp://*:5557")
    assert binds("tcp://[::]:5557")
    assert binds("ipc:///run/kv.sock")
    assert binds("inproc://kv")
    assert not binds("tcp://127.0.0.1:5557")
    assert not binds("tcp://indexer.example:5557")


def test_a_bound_publisher_sends_topic_sequence_payload(ctx: zmq.Context, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv.sock"
    pub = ZmqPublisher(endpoint, topic=TOPIC, fmt="array", context=ctx)
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(endpoint)
        sub.setsockopt_string(zmq.SUBSCRIBE, "kv@node-a")
        await_subscription(pub, sub)
        for seq in (0, 1, 3):
            assert pub.offer(batch(seq))
        messages = received(sub, 3)
        assert [m[0] for m in messages] == [TOPIC.encode()] * 3
        assert [m[1] for m in messages] == [s.to_bytes(8, "big") for s in (0, 1, 3)]
        assert messages[2][2] == encode_batch(batch(3), "array")
        ts, events, rank = msgpack.unpackb(messages[0][2])
        assert (ts, events, rank) == (100.0, [["BlockRemoved", [0], "GPU"]], 0)
    finally:
        sub.close(linger=0)
        pub.close()
    stats = pub.stats()
    assert stats.send_errors == 0 and stats.failure is None
    assert stats.batches_sent >= 3 and stats.events_sent >= 3


def test_a_connecting_publisher_reaches_a_subscriber_that_binds(ctx: zmq.Context) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = ctx.socket(zmq.SUB)
    sub.bind(endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    pub = ZmqPublisher(endpoint, context=ctx)
    try:
        await_subscription(pub, sub)
        assert pub.offer(batch(0))
        [message] = received(sub, 1)
        assert message == [b"", bytes(8), encode_batch(batch(0), "map")]
    finally:
        sub.close(linger=0)
        pub.close()


def test_close_sends_what_was_queued(ctx: zmq.Context, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv.sock"
    pub = ZmqPublisher(endpoint, context=ctx)
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(endpoint)
        sub.setsockopt_string(zmq.SUBSCRIBE, "")
        await_subscription(pub, sub)
        for seq in range(50):
            assert pub.offer(batch(seq))
        pub.close()
        messages = received(sub, 50)
        assert [int.from_bytes(m[1], "big") for m in messages] == list(range(50))
        assert pub.stats().queued == 0
    finally:
        sub.close(linger=0)


class HeldPublisher(ZmqPublisher):
    """A publisher whose thread, once it took a batch, waits for ``go``."""

    def __init__(self, endpoint: str, **kw: Any) -> None:
        self.taken = threading.Event()
        self.go = threading.Event()
        super().__init__(endpoint, **kw)

    def _send(self, batch: EventBatch) -> None:
        self.taken.set()
        self.go.wait()
        super()._send(batch)


def test_a_full_queue_refuses_at_once(ctx: zmq.Context) -> None:
    pub = HeldPublisher("inproc://kv-full", context=ctx, max_queued=1)
    try:
        assert pub.offer(batch(0))
        assert pub.taken.wait(10)
        assert pub.offer(batch(1))  # the one place in the queue
        assert not pub.offer(batch(2))
        assert pub.stats().queued == 1
    finally:
        pub.go.set()
        pub.close()
    assert pub.stats().batches_sent == 2


def test_an_endpoint_that_cannot_be_bound_is_an_os_error(ctx: zmq.Context, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/missing-dir/kv.sock"
    with pytest.raises(OSError, match="cannot bind a PUB socket on ipc://"):
        ZmqPublisher(endpoint, context=ctx)


def test_refuses_a_queue_of_no_room(ctx: zmq.Context) -> None:
    with pytest.raises(ValueError, match="max_queued must be > 0, got 0"):
        ZmqPublisher("inproc://kv-none", context=ctx, max_queued=0)
