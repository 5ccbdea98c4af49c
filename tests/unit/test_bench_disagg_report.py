"""The figures ``mooncakectl bench disagg`` derives from its measurements."""

from __future__ import annotations

import pytest

from mooncakectl.bench.disagg_report import HandoffRow, InterferenceRow, Results, percentile
from mooncakectl.local.config import to_toml


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(10, 0, -1)]
    assert percentile(values, 50) == 5.0
    assert percentile(values, 99) == 10.0
    assert percentile(values, 0) == 1.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 99)


def results(*rows: tuple[int, bool, float]) -> Results:
    res = Results()
    for n, layerwise, exposed in rows:
        res.handoff.append(HandoffRow(n, layerwise, 2048.0 * n, 1.0, 2.0, exposed, 1, 1))
    return res


def test_exposed_ratio_against_the_after_step_run() -> None:
    res = results((16, True, 1.0), (16, False, 1.5), (1024, True, 3.0), (1024, False, 6.0))
    assert res.exposed_ratio(1024) == 0.5
    # Less each mode's 16-token floor: (3 - 1) / (6 - 1.5).
    assert res.exposed_ratio(1024, floor_of=16) == pytest.approx(2.0 / 4.5)
    assert res.exposed_ratio(4096) is None
    assert res.exposed_ratio(1024, floor_of=8) is None


def test_interference_ratio_and_hop() -> None:
    res = Results()
    res.interference.append(InterferenceRow("1P+1D", 100, 10.0, 40.0, 3, 100.0))
    assert res.interference_ratio() is None
    res.interference.append(InterferenceRow("2x both", 100, 10.0, 160.0, 3, 100.0))
    assert res.interference_ratio() == 0.25
    res.ttft_disagg[16] = 30.0
    assert res.hop_ms(16) is None
    res.ttft_colocated[16] = 20.0
    assert res.hop_ms(16) == 10.0


def test_toml_of_a_daemon_config() -> None:
    # The daemons' configs are written by the one TOML writer.
    text = to_toml(
        {"node": {"id": "p", "role": "prefill"}, "cluster": {"seeds": ["127.0.0.1:7"], "x": True}}
    )
    assert text == (
        '[node]\nid = "p"\nrole = "prefill"\n\n[cluster]\nseeds = ["127.0.0.1:7"]\nx = true\n'
    )
    with pytest.raises(ValueError, match="None"):
        to_toml({"a": {"b": None}})
