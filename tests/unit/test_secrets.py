"""The cluster secret: its sources, the refusal of a weak one on a reachable
node, and of a secret file others may read."""

from __future__ import annotations

import os
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
    estimated_bits,
    generate_secret,
    resolve_cluster_secret,
    secret_weakness,
)

# A generate_secret() output, fixed.
STRONG = "q3X9vK_m2Lr8TzPw0aYcN-4hJdEuB7sGfR1kWxVoi6U"
EXPOSED = {"server": {"host": "0.0.0.0"}}


def secret_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


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
    short = cfg(**sections, node={"cluster_secret": STRONG[: MIN_SECRET_BYTES - 1]})
    with pytest.raises(ConfigValueError, match="shorter than 32 bytes"):
        check_cluster_secret(short)
    check_cluster_secret(cfg(**sections, node={"cluster_secret": STRONG}))


@pytest.mark.parametrize(
    ("secret", "problem"),
    [
        ("a" * 32, "uses only 1 distinct characters"),
        ("a" * 200, "uses only 1 distinct characters"),
        ("abcd" * 16, "uses only 4 distinct characters"),
        # 10 distinct characters: 32 x log2(10) = 106 bits at most.
        ("0123456789" * 3 + "01", "carries at most about 106 bits"),
    ],
)
def test_reachable_node_refuses_a_secret_of_too_little_variety(secret: str, problem: str) -> None:
    with pytest.raises(ConfigValueError, match=problem) as exc:
        check_cluster_secret(cfg(**EXPOSED, node={"cluster_secret": secret}))
    assert exc.value.key == "node.cluster_secret"
    assert "mooncakectl secret" in str(exc.value)
    # A node only loopback reaches takes it.
    check_cluster_secret(cfg(node={"cluster_secret": secret}))


def test_the_estimate_and_what_passes_it() -> None:
    assert estimated_bits("a" * 64) == 0.0
    assert estimated_bits("0123456789abcdef" * 2) == 128.0
    assert secret_weakness("0123456789abcdef" * 2) is None
    # A 32-byte hex key (64 hex characters) and a base64 one pass.
    assert secret_weakness(os.urandom(32).hex()) is None
    assert secret_weakness(STRONG) is None
    assert all(secret_weakness(generate_secret()) is None for _ in range(1000))


def test_generate_secret_draws_again_rather_than_print_a_weak_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    draws = iter(["A" * 43, "AB" * 22, STRONG])
    monkeypatch.setattr("mooncaked.secrets.secrets.token_urlsafe", lambda n: next(draws))
    assert generate_secret() == STRONG


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o601, 0o610])
def test_a_secret_file_group_or_others_may_open_is_refused(tmp_path: Path, mode: int) -> None:
    f = secret_file(tmp_path / "secret", STRONG + "\n", mode)
    with pytest.raises(ConfigValueError) as exc:
        resolve_cluster_secret(cfg(node={"cluster_secret_file": str(f)}), {})
    assert exc.value.key == "node.cluster_secret_file"
    assert f"chmod 600 {f}" in str(exc.value) and "group or others" in str(exc.value)


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_secret_file_of_this_user_alone_is_read(tmp_path: Path, mode: int) -> None:
    # 0400 is what systemd gives a LoadCredential= file, owned by the service's user.
    f = secret_file(tmp_path / "secret", STRONG + "\n", mode)
    out = resolve_cluster_secret(cfg(node={"cluster_secret_file": str(f)}), {})
    assert out.node.cluster_secret == STRONG


def test_secret_file_wins_and_loses_its_newline(tmp_path: Path) -> None:
    f = secret_file(tmp_path / "secret", STRONG + "\n")
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
    empty = secret_file(tmp_path / "empty", "\n")
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
