"""The shipped unit and its config agree: stop timeout, secret credential, SSD tier."""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mooncaked.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def unit_settings() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (ROOT / "systemd" / "mooncaked.service").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_unit_matches_its_config() -> None:
    unit = unit_settings()
    config = load_config(str(ROOT / "config" / "systemd.toml"))
    assert unit["Type"] == ["notify"] and "WatchdogSec" in unit
    # The drain must end before systemd's SIGKILL: drain_timeout_s + 15 s.
    assert float(unit["TimeoutStopSec"][0]) == config.server.drain_timeout_s + 15
    state = "/var/lib/" + unit["StateDirectory"][0]
    assert config.node.data_dir == state
    assert config.store.ssd_path.startswith(state + "/") and config.store.ssd_bytes > 0
    cred_name = unit["LoadCredential"][0].split(":", 1)[0]
    assert config.node.cluster_secret_file == f"/run/credentials/mooncaked.service/{cred_name}"
    assert unit["ExecStart"][0].split()[0] == "/opt/mooncaked/bin/mooncaked"


# ----------------------------------------------------------- syscall filter

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
LIBSECCOMP = ctypes.util.find_library("seccomp")


def expand(items: list[str]) -> set[str]:
    """Syscall names of unit filter items, groups (``@name``) expanded by systemd itself."""
    out: set[str] = set()
    for item in items:
        if not item.startswith("@"):
            out.add(item)
            continue
        assert SYSTEMD_ANALYZE is not None
        listing = subprocess.run(
            [SYSTEMD_ANALYZE, "syscall-filter", "--no-pager", item],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        lines = [ln.strip() for ln in listing.splitlines()[1:]]
        out |= expand([ln for ln in lines if ln and not ln.startswith("#")])
    return out


def denied_by_unit() -> set[str]:
    """What the unit's SystemCallFilter= lines deny, of the syscalls they name.

    systemd's rule: the first line decides the kind (an allow list here); a
    later ``~`` line removes from it, a later plain line adds back.
    """
    lines = unit_settings()["SystemCallFilter"]
    assert not lines[0].startswith("~"), "the unit's filter starts with an allow list"
    allowed = expand(lines[0].split())
    named = set(allowed)
    for line in lines[1:]:
        deny = line.startswith("~")
        names = expand(line.lstrip("~").split())
        named |= names
        allowed = allowed - names if deny else allowed | names
    return named - allowed


SECCOMP_SCRIPT = """
import ctypes, errno, sys
lib = ctypes.CDLL(sys.argv[1])
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
ctx = lib.seccomp_init(0x7FFF0000)  # allow what the unit does not name
for name in sys.argv[2].split(","):
    nr = lib.seccomp_syscall_resolve_name(name.encode())
    if nr >= 0:
        # systemd's SystemCallErrorNumber=EPERM
        assert lib.seccomp_rule_add(ctx, 0x00050000 | errno.EPERM, nr, 0) == 0, name
assert lib.seccomp_load(ctx) == 0
from mooncaked.config import ConfigError
from mooncaked.process import pin_cpus
import os
cpu = min(os.sched_getaffinity(0))
try:
    pin_cpus(str(cpu))
except ConfigError as exc:
    print("config error:", exc)
    sys.exit(2)
print("pinned to", sorted(os.sched_getaffinity(0)))
"""


def run_under_filter(denied: set[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SECCOMP_SCRIPT, str(LIBSECCOMP), ",".join(sorted(denied))],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
    )


needs_seccomp = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None or LIBSECCOMP is None,
    reason="needs systemd-analyze (to expand the unit's syscall groups) and libseccomp",
)


@needs_seccomp
@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs to mean a change"
)
def test_node_cpus_works_under_the_units_syscall_filter() -> None:
    denied = denied_by_unit()
    assert "setrlimit" in denied  # the filter is really there
    result = run_under_filter(denied)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("pinned to [")


@needs_seccomp
@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs to mean a change"
)
def test_node_cpus_denied_is_a_config_error_not_a_restart_loop() -> None:
    # Exit status 2 is in the unit's RestartPreventExitStatus: no restart loop.
    result = run_under_filter({"sched_setaffinity"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "node.cpus" in result.stdout and "SystemCallFilter=sched_setaffinity" in result.stdout
    assert unit_settings()["RestartPreventExitStatus"] == ["2"]
