"""The outside anchors the benchmarks measure against, as their scripts in
``tools/`` installed them: each script writes an ``anchor.env`` of shell
assignments saying where it put its anchor, and prints it with ``--print``.

Mooncake itself (``tools/mooncake_anchor.sh``) writes
``$MOONCAKE_ANCHOR_VENV/anchor.env``: the anchor's venv, its
``transfer_engine_bench`` binary (empty when the wheel ships none) and the
libraries its binaries and Python module load. llama.cpp's and vLLM's
anchors are read by ``engine_bench`` and ``vllm_bench`` through
``anchor_env``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

DEFAULT_VENV = Path.home() / ".cache/mooncaked-bench/mooncake-venv"


class AnchorError(ValueError):
    """An anchor is not there, or its file does not say where it is."""


def parse_env(text: str) -> dict[str, str]:
    """The ``KEY=value`` assignments of an anchor.env, values unquoted as the shell would."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = " ".join(shlex.split(value))
    return values


def anchor_env(spec: str, script: Path | None, *, flag: str, missing: str) -> dict[str, str]:
    """The assignments ``spec`` names: ``auto`` asks ``script --print``, else ``spec``
    is the anchor.env's path. Errors name ``flag`` and, for ``auto``, say ``missing``
    (what is not installed) and how to install it."""
    if spec == "auto":
        if script is None:
            raise AnchorError(f"{flag} auto: no anchor script to ask")
        done = subprocess.run(
            ["bash", str(script), "--print"], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise AnchorError(f"{flag} auto: {missing}; run {script} first\n{done.stderr.strip()}")
        return parse_env(done.stdout)
    try:
        return parse_env(Path(spec).expanduser().read_text())
    except OSError as e:
        raise AnchorError(f"{flag} {spec}: cannot read the anchor file: {e}") from None


def anchor_venv() -> Path:
    return Path(os.environ.get("MOONCAKE_ANCHOR_VENV", str(DEFAULT_VENV)))


def anchor_values() -> tuple[dict[str, str] | None, str]:
    """The assignments of the anchor's env file, or None and why there are none."""
    env_file = anchor_venv() / "anchor.env"
    if not env_file.exists():
        return None, f"{env_file} not found: run tools/mooncake_anchor.sh to install the anchor"
    return parse_env(env_file.read_text()), ""


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
