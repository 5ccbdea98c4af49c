"""tools/bench_simcheck.py's real-side figures from requests of known timing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    spec = importlib.util.spec_from_file_location(
        "bench_simcheck", REPO_ROOT / "tools/bench_simcheck.py"
    )
    if spec is None or spec.loader is None:
        raise RuntimeError("cannot load tools/bench_simcheck.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sc = _load()


def rec(start: float, chunks: list[float], **kw: Any) -> dict[str, Any]:
    return {"start_s": start, "chunk_s": chunks, "end_s": chunks[-1], **kw}


def test_real_figures_as_the_simulator_measures() -> None:
    result = {
        "requests": [
            rec(-1.0, [-0.5, -0.4], warmup=True),  # left out
            # TTFT 0.2 s; ten gaps, one of 100 ms: the slowest tenth is it.
            rec(
                0.0,
                [0.2 + 0.01 * i for i in range(10)] + [0.39],
                prompt_tokens=100,
                cached_tokens=50,
                output_tokens=11,
            ),
            # TTFT 0.6 s, one gap of 40 ms.
            rec(1.0, [1.6, 1.64], prompt_tokens=100, cached_tokens=0, output_tokens=2),
            {"start_s": 1.5, "chunk_s": [], "end_s": 1.6, "error_kind": "rejected"},
        ]
    }
    f = sc.real_figures(result)
    assert (f["sent"], f["completed"]) == (3, 2)
    # From the first start (0) to the last token (1.64 s).
    assert f["req_s"] == pytest.approx(2 / 1.64)
    assert f["tok_s"] == pytest.approx(13 / 1.64)
    assert f["ttft_mean"] == pytest.approx(400.0)
    assert f["tbt_mean"] == pytest.approx((100.0 + 40.0) / 2)
    assert f["hit"] == pytest.approx(50 / 200)
