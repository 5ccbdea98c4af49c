"""The shipped unit and its config agree: stop timeout, secret credential, SSD tier."""

from __future__ import annotations

from pathlib import Path

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
