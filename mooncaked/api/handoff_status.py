"""The KV handoff seen from outside: a "handoff" section of /admin/status and
its Prometheus families.

Both read one ``HandoffSnapshot``, taken at request or scrape time from the
decode side's ``KVReceiver`` (handoffs by outcome), the prefill side's
``KVSender`` (bytes, send and exposed time) and the transfer engine's
counters. A node of any role has both sides, so every node reports both.
``StepHistograms`` adds per-step distributions (bytes, send window, exposed
tail, rate) that the sender reports as each step's KV lands. Both reach
/metrics as ``MetricsSource``s (``metrics_source`` and the histograms themselves).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric

from mooncaked.api.metrics import SnapshotMetrics, Spec, histograms
from mooncaked.api.services import Services, TransferCounters
from mooncaked.engine.handoff import HandoffStats, StepSend

__all__ = ["HANDOFF_METRICS", "HandoffSnapshot", "HandoffStatus", "StepHistograms"]

OUTCOMES = ("ok", "retried", "passed_on", "fell_back", "cancelled")
# Seconds: a layer's tail on loopback (sub-millisecond) to a slow link.
_STEP_SECONDS_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
# Bytes: one block of a small model (KiB) to a long prompt of a large one (GiB).
_STEP_BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(0, 12))
_GBPS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0)
# (name, help, buckets) of ``StepHistograms``' bytes, send, exposed and rate.
_STEP_HISTOGRAMS = (
    (
        "mooncaked_handoff_step_bytes",
        "KV bytes one engine step sent to decode nodes.",
        _STEP_BYTES_BUCKETS,
    ),
    (
        "mooncaked_handoff_step_send_seconds",
        "One step's send window: its first layer finishing to its KV writes complete.",
        _STEP_SECONDS_BUCKETS,
    ),
    (
        "mooncaked_handoff_step_exposed_seconds",
        "One step's exposed tail: its last layer finishing to its KV writes complete.",
        _STEP_SECONDS_BUCKETS,
    ),
    (
        "mooncaked_handoff_step_gb_per_second",
        "One step's KV bytes over its send window, in GB/s (a lower bound of the "
        "link's rate when layer-wise sends wait for compute).",
        _GBPS_BUCKETS,
    ),
)


@dataclass(frozen=True, slots=True)
class HandoffSnapshot:
    layerwise: bool
    # Decode side: handoffs this node asked prefill nodes for, by outcome.
    received: HandoffStats
    # Prefill side: KV this node wrote into decode nodes.
    sent: HandoffStats
    transfer: TransferCounters | None

    def status(self) -> dict[str, Any]:
        sent = self.sent
        steps = sent.num_steps_sent
        out: dict[str, Any] = {
            "layerwise": self.layerwise,
            "handoffs": {k: getattr(self.received, k) for k in OUTCOMES},
            "sent": {
                "bytes": sent.sent_bytes,
                "steps": steps,
                "failures": sent.send_failures,
                "send_seconds": sent.send_seconds,
                "exposed_seconds": sent.exposed_seconds,
                # Per step: the tail after its last layer until its KV was written.
                "mean_exposed_ms": 1e3 * sent.exposed_seconds / steps if steps else None,
                # Per step: of that tail, what its head and sampling did not cover.
                "blocked_seconds": sent.blocked_seconds,
                "mean_blocked_ms": 1e3 * sent.blocked_seconds / steps if steps else None,
                # Over the send windows, which overlap compute when layerwise.
                "window_gb_per_s": (
                    sent.sent_bytes / sent.send_seconds / 1e9 if sent.send_seconds > 0 else None
                ),
            },
        }
        if self.transfer is not None:
            t = self.transfer
            out["transfer"] = {
                "bytes_written": t.bytes_written,
                "bytes_read": t.bytes_read,
                "ops_done": t.ops_done,
                "ops_failed": t.ops_failed,
                "batches": t.batches,
                "queued_slices": t.queued_slices,
            }
        return out


class HandoffStatus:
    """Snapshots of a node's handoff sides; None while the engine is not serving."""

    def __init__(self, services: Services) -> None:
        self._services = services

    def snapshot(self) -> HandoffSnapshot | None:
        s = self._services
        receiver, sender = s.receiver, s.sender
        if receiver is None or sender is None:
            return None
        transfer = s.transfer
        # Copies: the counters go on moving while the snapshot is read.
        return HandoffSnapshot(
            layerwise=sender.layerwise,
            received=dataclasses.replace(receiver.stats),
            sent=dataclasses.replace(sender.stats),
            transfer=transfer.metrics() if transfer is not None else None,
        )

    def status_section(self) -> dict[str, Any] | None:
        snap = self.snapshot()
        return None if snap is None else snap.status()

    def metrics_source(self) -> SnapshotMetrics:
        return SnapshotMetrics(self.snapshot, HANDOFF_METRICS)


def _sent(attr: str) -> Callable[[Any], float]:
    return lambda snap: getattr(snap.sent, attr)


# Read off ``HandoffSnapshot``.
HANDOFF_METRICS: tuple[Spec, ...] = (
    Spec(
        "mooncaked_handoffs",
        "Prompt KV handoffs this node (decoding) asked prefill nodes for, by outcome: "
        "ok, retried (a prefill node failed, the next was asked), passed_on (a prefill "
        "node's queue was longer than the entry allowed, the next was asked), fell_back "
        "(computed here), cancelled.",
        lambda snap: {k: getattr(snap.received, k) for k in OUTCOMES},
        counter=True,
        label="outcome",
    ),
    Spec(
        "mooncaked_handoff_sent_bytes",
        "KV bytes this node (prefilling) wrote into decode nodes.",
        _sent("sent_bytes"),
        counter=True,
    ),
    Spec(
        "mooncaked_handoff_send_failures",
        "Batches of KV writes into a decode node that failed.",
        _sent("send_failures"),
        counter=True,
    ),
    Spec(
        "mooncaked_handoff_send_seconds",
        "Sum over steps of the send window: from a step's first layer finishing to its "
        "KV writes being complete.",
        _sent("send_seconds"),
        counter=True,
    ),
    Spec(
        "mooncaked_handoff_exposed_seconds",
        "Sum over steps of the exposed tail: from a step's last layer finishing to its "
        "KV writes being complete.",
        _sent("exposed_seconds"),
        counter=True,
    ),
    Spec(
        "mooncaked_handoff_blocked_seconds",
        "Sum over steps of the time a step waited for its KV writes after its head and "
        "sampling (what the handoff added to the step).",
        _sent("blocked_seconds"),
        counter=True,
    ),
    Spec(
        "mooncaked_handoff_steps",
        "Engine steps that sent KV to a decode node.",
        _sent("num_steps_sent"),
        counter=True,
    ),
)


class StepHistograms:
    """Per-step KV transfer distributions; ``observe`` is the sender's step observer
    (called on the event loop as each step's report is applied). A
    ``MetricsSource``: register it with the node's ``ApiMetrics``."""

    def __init__(self) -> None:
        self.bytes, self.send, self.exposed, self.rate = histograms(_STEP_HISTOGRAMS, None)

    def collect(self) -> Iterator[Metric]:
        for histogram in (self.bytes, self.send, self.exposed, self.rate):
            yield from histogram.collect()

    def observe(self, step: StepSend) -> None:
        if not step.ok:
            return  # a failed step's times say nothing about the transfer
        self.bytes.observe(step.num_bytes)
        self.send.observe(step.send_seconds)
        self.exposed.observe(step.exposed_seconds)
        if step.send_seconds > 0:
            self.rate.observe(step.num_bytes / step.send_seconds / 1e9)
