"""The ZMQ PUB socket KV-event batches leave by, and the thread that feeds it.

``offer`` (on the event loop) only puts a batch on a bounded queue; the
thread takes each, encodes it (``wire``) and sends it. A PUB socket never
blocks its sender: past its high-water mark it drops messages for a slow
subscriber, which then sees a gap in the sequence numbers.

Bind or connect follows vLLM's publisher: an endpoint whose host is a
wildcard ("*", "::"), or an ipc:// or inproc:// one, is bound; any other is
connected (to a subscriber that binds, as llm-d's indexer can).

The constructor makes the socket and binds or connects it, ``close``
closes it, and the thread alone uses it in between (the thread's start and
join order the accesses, as ZMQ asks of a socket that changes threads).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import structlog
import zmq

from mooncaked.kv_events.events import EventBatch
from mooncaked.kv_events.wire import EventFormat, frames

log = structlog.get_logger(__name__)

# Batches waiting for the thread; one per loop turn with block events, so
# this is seconds of a busy engine's steps before any is dropped.
MAX_QUEUED_BATCHES = 4096
# Messages the PUB socket keeps for each slow subscriber (vLLM's default).
SEND_HWM = 100_000
# How long closing waits for queued messages to reach subscribers.
_LINGER_MS = 1000
_JOIN_TIMEOUT_S = 5.0


def binds(endpoint: str) -> bool:
    """Whether a PUB socket on ``endpoint`` binds it (else it connects)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(frozen=True, slots=True)
class PublisherStats:
    batches_sent: int
    events_sent: int
    bytes_sent: int
    send_errors: int
    queued: int
    # Why the thread died (a bug), if it did: nothing is sent any more.
    failure: str | None


class ZmqPublisher:
    """Sends ``EventBatch``es on one PUB socket from one owned thread."""

    __slots__ = (
        "_batches_sent",
        "_bytes_sent",
        "_events_sent",
        "_failure",
        "_queue",
        "_send_errors",
        "_socket",
        "_thread",
        "bound_endpoint",
        "endpoint",
        "fmt",
        "topic",
    )

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        fmt: EventFormat = "map",
        context: zmq.Context | None = None,
        max_queued: int = MAX_QUEUED_BATCHES,
    ) -> None:
        """Makes the socket and binds or connects it; OSError if it cannot."""
        if max_queued <= 0:
            raise ValueError(f"max_queued must be > 0, got {max_queued}")
        self.endpoint = endpoint
        self.topic = topic
        self.fmt: EventFormat = fmt
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(max_queued)
        self._socket = (context or zmq.Context.instance()).socket(zmq.PUB)
        try:
            self._socket.set_hwm(SEND_HWM)
            if binds(endpoint):
                self._socket.bind(endpoint)
            else:
                self._socket.connect(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            verb = "bind" if binds(endpoint) else "connect"
            raise OSError(exc.errno, f"cannot {verb} a PUB socket on {endpoint}: {exc}") from None
        last = self._socket.getsockopt(zmq.LAST_ENDPOINT)
        # As bound (a wildcard's port resolved); the configured one when connected.
        self.bound_endpoint = last.decode() if isinstance(last, bytes) and last else endpoint
        # Counters the thread writes and the loop reads (whole ints: no lock).
        self._batches_sent = 0
        self._events_sent = 0
        self._bytes_sent = 0
        self._send_errors = 0
        self._failure: str | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def offer(self, batch: EventBatch) -> bool:
        """Queue ``batch`` for sending; False, at once, when the queue is full."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            return False
        return True

    def close(self) -> None:
        """Send what is queued, stop the thread and close the socket. Blocks up
        to a few seconds: call it off the event loop."""
        if self._thread.is_alive():
            # Waits for room if the queue is full: the thread is draining it.
            self._queue.put(None)
            self._thread.join(_JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("the kv events thread did not stop in time; its socket stays open")
                return
        self._socket.close(linger=_LINGER_MS)

    def stats(self) -> PublisherStats:
        return PublisherStats(
            batches_sent=self._batches_sent,
            events_sent=self._events_sent,
            bytes_sent=self._bytes_sent,
            send_errors=self._send_errors,
            queued=self._queue.qsize(),
            failure=self._failure,
        )

    def _run(self) -> None:
        try:
            while (batch := self._queue.get()) is not None:
                self._send(batch)
        except Exception as exc:
            # A bug: no batch goes out any more, and the queue fills up (its
            # drops are counted); say so in the log and in the stats.
            self._failure = repr(exc)
            log.exception("the kv events thread died", endpoint=self.endpoint)

    def _send(self, batch: EventBatch) -> None:
        message = frames(self.topic, batch, self.fmt)
        try:
            self._socket.send_multipart(message, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # PUB drops rather than blocks; an error here is the socket's own
            # (closed under us, out of memory): count it, keep going.
            self._send_errors += 1
            if self._send_errors == 1 or self._send_errors % 1000 == 0:
                log.warning("kv events batch not sent", error=str(exc), errors=self._send_errors)
            return
        self._batches_sent += 1
        self._events_sent += len(batch.events)
        self._bytes_sent += sum(len(f) for f in message)
