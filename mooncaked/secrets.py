"""The cluster secret: where it comes from and when it is strong enough.

The secret authenticates transfer handshakes, gossip and internal calls.
Its default is published with the source, so it only protects a node that
nothing but loopback can reach. Sources, strongest first:
``node.cluster_secret_file`` (e.g. a systemd credential; refused when group
or others may open it), the environment variable ``MOONCAKED_CLUSTER_SECRET``,
then ``node.cluster_secret``.

A node others can reach refuses a weak secret (``secret_weakness``): the
default, one shorter than ``MIN_SECRET_BYTES``, one of fewer than
``MIN_DISTINCT_CHARS`` distinct characters, or one whose estimated strength
is under ``MIN_SECRET_BITS``. The estimate is the length times log2 of the
number of distinct characters: what the secret would carry were each of its
characters drawn at random from those it uses. It is an upper bound, so it
catches a repeated character or a tiny alphabet, not a pattern ("abcdefgh"
four times passes); ``generate_secret``'s output always passes.
"""

from __future__ import annotations

import ipaddress
import math
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from mooncaked.config import Config, ConfigValueError, NodeConfig, with_overrides

ENV_CLUSTER_SECRET = "MOONCAKED_CLUSTER_SECRET"
DEFAULT_CLUSTER_SECRET = NodeConfig().cluster_secret
# A secret for a node others can reach: as long as a 256-bit key in bytes.
MIN_SECRET_BYTES = 32
# ...of at least this many distinct characters...
MIN_DISTINCT_CHARS = 8
# ...and at least this strong by the estimate above (a 128-bit key's worth).
MIN_SECRET_BITS = 128.0


def estimated_bits(secret: str) -> float:
    """An upper bound on a secret's strength: length x log2(distinct characters)."""
    distinct = len(set(secret))
    return len(secret) * math.log2(distinct) if distinct > 1 else 0.0


def secret_weakness(secret: str) -> str | None:
    """Why ``secret`` is too weak for a node others can reach, or None."""
    if secret == DEFAULT_CLUSTER_SECRET:
        return "is the published default"
    if len(secret.encode("utf-8")) < MIN_SECRET_BYTES:
        return f"is shorter than {MIN_SECRET_BYTES} bytes"
    distinct = len(set(secret))
    if distinct < MIN_DISTINCT_CHARS:
        return f"uses only {distinct} distinct characters (at least {MIN_DISTINCT_CHARS} wanted)"
    bits = estimated_bits(secret)
    if bits < MIN_SECRET_BITS:
        return (
            f"carries at most about {bits:.0f} bits ({len(secret)} characters of {distinct} "
            f"distinct ones; at least {MIN_SECRET_BITS:.0f} bits wanted)"
        )
    return None


def generate_secret() -> str:
    """A fresh secret of 32 random bytes, URL-safe text; never one ``secret_weakness`` refuses."""
    while True:
        # 43 characters of 64: fewer than 8 distinct among them is too rare
        # to ever see, but drawn anew rather than printed if it happens.
        secret = secrets.token_urlsafe(MIN_SECRET_BYTES)
        if secret_weakness(secret) is None:
            return secret


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a hostname other than localhost, or a wildcard
        return False


def resolve_cluster_secret(config: Config, env: Mapping[str, str]) -> Config:
    """``config`` with the secret from its file or the environment, if given.

    Raises ``ConfigValueError`` naming the key when the file cannot be read,
    holds an empty secret, or grants group or others any access (whoever can
    read it can join the cluster).
    """
    path = config.node.cluster_secret_file
    if path:
        try:
            with Path(path).open("rb") as f:
                # The mode of the file read, not of whatever the path names later.
                mode = os.fstat(f.fileno()).st_mode
                if mode & 0o077:
                    raise ConfigValueError(
                        "node.cluster_secret_file",
                        f"{path!r} grants group or others access (mode "
                        f"{stat.filemode(mode)}); make it this user's alone: chmod 600 {path}",
                    )
                text = f.read().decode("utf-8")
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
    problem = secret_weakness(config.node.cluster_secret)
    if problem is None:
        return
    raise ConfigValueError(
        "node.cluster_secret",
        f"{problem}, but this node is reachable by others ({', '.join(exposed)}); set "
        f"node.cluster_secret_file or {ENV_CLUSTER_SECRET} to a random secret of at least "
        f"{MIN_SECRET_BYTES} bytes (`mooncakectl secret` prints one)",
    )
