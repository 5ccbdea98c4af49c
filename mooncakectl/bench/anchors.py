"""Mooncake itself, as ``tools/mooncake_anchor.sh`` installed it: what the
benchmarks that measure against it need to find and run it.

The script writes ``$MOONCAKE_ANCHOR_VENV/anchor.env``, shell assignments of
the anchor's venv, its ``transfer_engine_bench`` binary (empty when the wheel
ships none) and the libraries its binaries and Python module load.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

DEFAULT_VENV = Path.home() / ".cache/mooncaked-bench/mooncake-venv"


def anchor_venv() -> Path:
    return Path(os.environ.get("MOONCAKE_ANCHOR_VENV", str(DEFAULT_VENV)))


def anchor_values() -> tuple[dict[str, str] | None, str]:
    """The assignments of the anchor's env file, or None and why there are none."""
    env_file = anchor_venv() / "anchor.env"
    if not env_file.exists():
        return None, f"{env_file} not found: run tools/mooncake_anchor.sh to install the anchor"
    values: dict[str, str] = {}
    for line in env_file.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = shlex.split(value)[0] if value.strip() else ""
    return values, ""


def anchor_process_env(values: dict[str, str]) -> dict[str, str]:
    """This process's environment with the anchor's libraries first on the loader's path."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(
        x for x in (values.get("MOONCAKE_LD_LIBRARY_PATH", ""), env.get("LD_LIBRARY_PATH", "")) if x
    )
    return env


def stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``; reaped either way."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
