"""The cluster secret: its sources and the refusal of a weak one on a reachable node."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mooncaked.config import Config, ConfigValueError, with_overrides
from mooncaked.secrets import (
    DEFAULT_CLUSTER_SECRET,
    ENV_CLUSTER_SECRET,
    MIN_SECRET_BYTES,
    check_cluster_secret,
    generate_secret,
    resolve_cluster_secret,
)

STRONG = "s" * MIN_SECRET_BYTES


def cfg(**sections: dict[str, object]) -> Config:
    return with_overrides(Config(), **sections)


def test_loopback_only_node_accepts_the_default() -> None:
    check_cluster_secret(Config())


@pytest.mark.parametrize(
    "sections",
    [
        {"server": {"host": "0.0.0.0"}},
        {"transfer": {"host": "10.0.0.5"}},
        {"cluster": {"gossip_host": "::"}},
        {"cluster": {"seeds": ["127.0.0.1:7000"]}},
    ],
)
def test_reachable_node_refuses_default_and_short_secrets(sections: dict) -> None:
    with pytest.raises(ConfigValueError, match="published default") as exc:
        check_cluster_secret(cfg(**sections))
    assert exc.value.key == "node.cluster_secret"
    short = cfg(**sections, node={"cluster_secret": "x" * (MIN_SECRET_BYTES - 1)})
    with pytest.raises(ConfigValueError, match="shorter than 32 bytes"):
        check_cluster_secret(short)
    check_cluster_secret(cfg(**sections, node={"cluster_secret": STRONG}))


def test_secret_file_wins_and_loses_its_newline(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_text(STRONG + "\n")
    c = cfg(node={"cluster_secret_file": str(f)})
    out = resolve_cluster_secret(c, {ENV_CLUSTER_SECRET: "from-env" * 5})
    assert out.node.cluster_secret == STRONG


def test_secret_from_environment() -> None:
    out = resolve_cluster_secret(Config(), {ENV_CLUSTER_SECRET: STRONG})
    assert out.node.cluster_secret == STRONG
    assert resolve_cluster_secret(Config(), {}).node.cluster_secret == DEFAULT_CLUSTER_SECRET


def test_unreadable_or_empty_secret_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigValueError, match="cannot read"):
        resolve_cluster_secret(cfg(node={"cluster_secret_file": str(tmp_path / "no")}), {})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigValueError, match="is empty"):
        resolve_cluster_secret(cfg(node={"cluster_secret_file": str(empty)}), {})


def test_generated_secrets_are_long_and_distinct() -> None:
    a, b = generate_secret(), generate_secret()
    assert a != b and len(a.encode()) >= MIN_SECRET_BYTES


def test_daemon_with_seeds_and_default_secret_exits_2_with_one_line(tmp_path: Path) -> None:
    toml = tmp_path / "n.toml"
    toml.write_text('[cluster]\nseeds = ["127.0.0.1:9"]\n')
    proc = subprocess.run(
        [sys.executable, "-m", "mooncaked", "--config", str(toml)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "node.cluster_secret" in lines[0], lines
