"""``tools/profile_step.py`` run as a user runs it, on the builtin model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "profile_step.py"
SMALL = ["--prompt-len", "16", "--max-tokens", "8", "--profile-steps", "1"]


def test_profile_step_times_and_profiles_decode_steps_of_the_batch() -> None:
    done = subprocess.run(
        [sys.executable, str(TOOL), "--model", "builtin:tiny", "--batch", "2", *SMALL],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "batch 2, prompts of 16" in lines[0]
    step = re.fullmatch(
        r"decode step: median ([\d.]+) ms, fastest ([\d.]+) ms over (\d+) steps", lines[1]
    )
    assert step is not None, lines[1]
    # 8 tokens each: the first comes with the prefill, one step is profiled.
    assert int(step.group(3)) == 6
    assert float(step.group(2)) <= float(step.group(1))
    assert re.fullmatch(r"engine per token: median [\d.]+ ms", lines[2]), lines[2]
    assert lines[3] == "CPU time by operator over 1 profiled steps:"
    shares = [float(m.group(1)) for m in (re.search(r"([\d.]+)%$", x) for x in lines[4:]) if m]
    assert shares and sum(shares) <= 100.5


def test_profile_step_names_a_bad_batch() -> None:
    done = subprocess.run(
        [sys.executable, str(TOOL), "--batch", "0"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 2
    assert "--batch must be at least 1, not 0" in done.stderr
