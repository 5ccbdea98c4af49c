"""The SIGKILL stress of the SSD tier (``tools/ssd_crash_stress.py``), with a small count.

Writers are killed at random instants, compactions included, and after every
restart each acknowledged block that was not evicted must be served with its
bytes, and nothing corrupt may be served.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

# Many SIGKILL cycles; test_ssd_crash.py keeps a short one in the fast set.
pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
CYCLES = 25


@pytest.mark.timeout(240)
def test_sigkill_stress_loses_no_acknowledged_put(tmp_path: Path) -> None:
    seed = random.SystemRandom().randrange(2**32)
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "tools" / "ssd_crash_stress.py"),
            "--cycles",
            str(CYCLES),
            "--seed",
            str(seed),
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=230,
    )
    report = f"seed {seed}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, report
    summary = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert summary["result"] == "ok", report
    assert summary["cycles"] == str(CYCLES), report
    assert summary["lost"] == "0" and summary["corrupt served"] == "0", report
    assert summary["writer failures"] == "0", report
    # The run did what it is for: puts, compactions, and checks that found blocks.
    assert int(summary["puts acknowledged"]) > CYCLES, report
    assert int(summary["compactions seen by writers"]) > 0, report
    assert int(summary["acknowledged blocks checked"]) > 0, report
