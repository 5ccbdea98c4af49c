"""Settings only start-up can check exit 2 with one line, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mooncaked.config import ConfigValueError, StoreConfig
from tests.conftest import TEST_TOML, _env


@pytest.mark.parametrize(
    "model, expect",
    [
        ('path = "/nonexistent/model"', "neither builtin"),
        ('path = "builtin:tiny"\nmax_model_len = 10000000', "exceeds the model's limit"),
    ],
)
def test_bad_model_setting_exits_2_with_one_line(tmp_path: Path, model: str, expect: str) -> None:
    last = _config_error(tmp_path, f"[model]\n{model}\n")
    assert expect in last, last


def _config_error(tmp_path: Path, sections: str) -> str:
    """Start a daemon on the test config plus ``sections``: it must exit 2,
    no traceback; the last line of its stderr."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(TEST_TOML + "\n" + sections)
    proc = subprocess.run(
        [sys.executable, "-m", "mooncaked", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mooncaked: config error:"), last
    return last


def test_ssd_path_with_zero_bytes_is_refused() -> None:
    with pytest.raises(ConfigValueError, match="ssd_bytes"):
        StoreConfig(ssd_path="/tmp/x", ssd_bytes=0)


def test_cpus_the_daemon_may_not_use_exit_2_naming_them(tmp_path: Path) -> None:
    beyond = max(os.sched_getaffinity(0)) + 1
    last = _config_error(tmp_path, f'[node]\ncpus = "{beyond}"\n')
    assert last.startswith("mooncaked: config error: node.cpus:"), last
    assert f"({beyond})" in last and "it may use" in last, last
