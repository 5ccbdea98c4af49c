from __future__ import annotations

import re

from mooncaked.api.handoff_status import (
    HANDOFF_METRICS,
    HandoffSnapshot,
    HandoffStatus,
    StepHistograms,
)
from mooncaked.api.metrics import ApiMetrics, SnapshotMetrics
from mooncaked.api.services import Lifecycle, Services
from mooncaked.config import Config
from mooncaked.engine.handoff import HandoffStats, StepSend
from mooncaked.identity import NodeIdentity
from mooncaked.transfer.batch import TransferMetrics


def snapshot() -> HandoffSnapshot:
    return HandoffSnapshot(
        layerwise=True,
        received=HandoffStats(ok=5, retried=2, fell_back=1, cancelled=3),
        sent=HandoffStats(
            sent_bytes=4_000_000,
            send_failures=1,
            send_seconds=0.002,
            exposed_seconds=0.0005,
            blocked_seconds=0.0002,
            num_steps_sent=4,
        ),
        transfer=TransferMetrics(bytes_written=4_000_000, ops_done=32, batches=16),
    )


def sample(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    if m is None:
        raise AssertionError(f"{name}{labels} not in:\n{text}")
    return float(m.group(1))


def test_status_section_figures() -> None:
    st = snapshot().status()
    assert st["layerwise"] is True
    assert st["handoffs"] == {
        "ok": 5,
        "retried": 2,
        "passed_on": 0,
        "fell_back": 1,
        "cancelled": 3,
    }
    sent = st["sent"]
    assert sent["bytes"] == 4_000_000 and sent["steps"] == 4 and sent["failures"] == 1
    assert sent["mean_exposed_ms"] == 0.125
    assert sent["mean_blocked_ms"] == 0.05
    assert sent["window_gb_per_s"] == 2.0
    assert st["transfer"]["bytes_written"] == 4_000_000
    assert st["transfer"]["batches"] == 16


def test_status_section_before_any_send_has_no_rates() -> None:
    snap = HandoffSnapshot(False, HandoffStats(), HandoffStats(), None)
    st = snap.status()
    assert st["sent"]["mean_exposed_ms"] is None
    assert st["sent"]["mean_blocked_ms"] is None
    assert st["sent"]["window_gb_per_s"] is None
    assert "transfer" not in st


def test_prometheus_families() -> None:
    metrics = ApiMetrics()
    metrics.register(SnapshotMetrics(snapshot, HANDOFF_METRICS))
    text = metrics.render().decode()
    assert sample(text, "mooncaked_handoffs_total", '{outcome="ok"}') == 5
    assert sample(text, "mooncaked_handoffs_total", '{outcome="retried"}') == 2
    assert sample(text, "mooncaked_handoffs_total", '{outcome="fell_back"}') == 1
    assert sample(text, "mooncaked_handoffs_total", '{outcome="cancelled"}') == 3
    assert sample(text, "mooncaked_handoff_sent_bytes_total") == 4_000_000
    assert sample(text, "mooncaked_handoff_send_failures_total") == 1
    assert sample(text, "mooncaked_handoff_send_seconds_total") == 0.002
    assert sample(text, "mooncaked_handoff_exposed_seconds_total") == 0.0005
    assert sample(text, "mooncaked_handoff_blocked_seconds_total") == 0.0002
    assert sample(text, "mooncaked_handoff_steps_total") == 4


async def _never() -> None:
    raise AssertionError("nothing stops this node")


def test_nothing_while_the_engine_is_not_serving() -> None:
    services = Services.build(
        Config(), NodeIdentity("n1", b"s" * 32, 1), Lifecycle(lambda: 0.0, _never), lambda: 0.0
    )
    status = HandoffStatus(services)
    assert status.snapshot() is None
    assert status.status_section() is None
    metrics = services.metrics
    metrics.register(status.metrics_source())
    assert "mooncaked_handoff" not in metrics.render().decode()


def test_step_histograms_observe_ok_steps_only() -> None:
    metrics = ApiMetrics()
    steps = StepHistograms()
    metrics.register(steps)
    steps.observe(
        StepSend(num_bytes=2_000_000, send_seconds=0.004, exposed_seconds=0.0003, ok=True)
    )
    steps.observe(StepSend(num_bytes=8_000_000, send_seconds=0.5, exposed_seconds=0.2, ok=False))
    text = metrics.render().decode()
    assert sample(text, "mooncaked_handoff_step_bytes_count") == 1
    assert sample(text, "mooncaked_handoff_step_bytes_sum") == 2_000_000
    assert sample(text, "mooncaked_handoff_step_send_seconds_sum") == 0.004
    assert sample(text, "mooncaked_handoff_step_exposed_seconds_sum") == 0.0003
    # 2 MB over 4 ms: 0.5 GB/s, in the 0.5 bucket and not the 0.25 one.
    assert sample(text, "mooncaked_handoff_step_gb_per_second_sum") == 0.5
    assert sample(text, "mooncaked_handoff_step_gb_per_second_bucket", '{le="0.5"}') == 1
    assert sample(text, "mooncaked_handoff_step_gb_per_second_bucket", '{le="0.25"}') == 0
    assert sample(text, "mooncaked_handoff_step_exposed_seconds_bucket", '{le="0.0005"}') == 1
    assert sample(text, "mooncaked_handoff_step_exposed_seconds_bucket", '{le="0.00025"}') == 0
