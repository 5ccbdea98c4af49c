"""The cluster secret: where it comes from and when it is strong enough.

The secret authenticates transfer handshakes, gossip and internal calls.
Its default is published with the source, so it only protects a node that
nothing but loopback can reach. Sources, strongest first:
``node.cluster_secret_file`` (e.g. a systemd credential), the environment
variable ``MOONCAKED_CLUSTER_SECRET``, then ``node.cluster_secret``.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Mapping
from pathlib import Path

from mooncaked.config import Config, ConfigValueError, NodeConfig, with_overrides

ENV_CLUSTER_SECRET = "MOONCAKED_CLUSTER_SECRET"
DEFAULT_CLUSTER_SECRET = NodeConfig().cluster_secret
# A secret for a node others can reach: as long as a 256-bit key in bytes.
MIN_SECRET_BYTES = 32


def generate_secret() -> str:
    """A fresh secret of 32 random bytes, URL-safe text."""
    return secrets.token_urlsafe(MIN_SECRET_BYTES)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a hostname other than localhost, or a wildcard
        return False


def resolve_cluster_secret(config: Config, env: Mapping[str, str]) -> Config:
    """``config`` with the secret from its file or the environment, if given.

    Raises ``ConfigValueError`` naming the key when the file cannot be read
    or holds an empty secret.
    """
    path = config.node.cluster_secret_file
    if path:
        try:
            text = Path(path).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigValueError(
                "node.cluster_secret_file", f"cannot read {path!r}: {exc}"
            ) from None
        secret = text.rstrip("\r\n")
        if not secret:
            raise ConfigValueError("node.cluster_secret_file", f"{path!r} is empty")
        return with_overrides(config, node={"cluster_secret": secret})
    secret = env.get(ENV_CLUSTER_SECRET, "")
    if secret:
        return with_overrides(config, node={"cluster_secret": secret})
    return config


def check_cluster_secret(config: Config) -> None:
    """Refuses (``ConfigValueError``) a weak secret on a node others can reach:
    one listening beyond loopback or joining a cluster through seeds."""
    exposed = [
        f"{key}={host!r}"
        for key, host in (
            ("server.host", config.server.host),
            ("transfer.host", config.transfer.host),
            ("cluster.gossip_host", config.cluster.gossip_host),
        )
        if not is_loopback(host)
    ]
    if config.cluster.seeds:
        exposed.append("cluster.seeds is set")
    if not exposed:
        return
    secret = config.node.cluster_secret
    if secret == DEFAULT_CLUSTER_SECRET:
        problem = "is the published default"
    elif len(secret.encode("utf-8")) < MIN_SECRET_BYTES:
        problem = f"is shorter than {MIN_SECRET_BYTES} bytes"
    else:
        return
    raise ConfigValueError(
        "node.cluster_secret",
        f"{problem}, but this node is reachable by others ({', '.join(exposed)}); set "
        f"node.cluster_secret_file or {ENV_CLUSTER_SECRET} to a secret of at least "
        f"{MIN_SECRET_BYTES} bytes (`mooncakectl secret` prints one)",
    )
