"""``mooncaked``: run one node.

    mooncaked [--config FILE] [--host H] [--port N] [--model PATH] [--role R] [--log-format F]
              [--gossip-host H] [--transfer-host H]

Flags override the file: a value that differs per host (the address peers
reach it at, where one file serves many nodes, as a Kubernetes ConfigMap
does) can come from the command line. Exit status: 0 after a clean drain, 1 when start-up
fails or a subsystem dies while serving (systemd restarts it), 2 for a bad
command line or configuration, 3 when a second signal cut the drain short.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

import structlog

from mooncaked.api.auth import resolve_auth
from mooncaked.config import (
    Config,
    ConfigError,
    ConfigValueError,
    apply_flags,
    load_config,
    with_overrides,
)
from mooncaked.process import EXIT_CONFIG, EXIT_FAILED
from mooncaked.secrets import check_cluster_secret, resolve_cluster_secret


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mooncaked",
        description="KVCache-centric LLM serving daemon (OpenAI-compatible HTTP API).",
    )
    p.add_argument("--config", metavar="FILE", help="TOML config file (default: built-in defaults)")
    p.add_argument("--host", help="server.host: address to listen on")
    p.add_argument("--port", type=int, help="server.port: port to listen on (0: any free port)")
    p.add_argument(
        "--model", metavar="PATH", help="model.path: HF model directory, .gguf file or builtin:tiny"
    )
    p.add_argument("--role", help="node.role: both, prefill or decode")
    p.add_argument(
        "--gossip-host",
        dest="gossip_host",
        help="cluster.gossip_host: address gossip listens on and peers reach it at",
    )
    p.add_argument(
        "--transfer-host",
        dest="transfer_host",
        help="transfer.host: address the transfer engine listens on and peers reach it at",
    )
    p.add_argument(
        "--api-key",
        dest="api_key",
        help="an API key /v1 requires (added to server.api_keys; also $MOONCAKED_API_KEY)",
    )
    p.add_argument("--log-format", dest="log_format", help="log.format: auto, json or console")
    return p


def build_config(args: argparse.Namespace) -> Config:
    """The file's config with the flags applied; raises ConfigError."""
    config = apply_flags(
        load_config(args.config),
        vars(args),
        {
            "host": ("server", "host"),
            "port": ("server", "port"),
            "model": ("model", "path"),
            "role": ("node", "role"),
            "gossip_host": ("cluster", "gossip_host"),
            "transfer_host": ("transfer", "host"),
            "log_format": ("log", "format"),
        },
    )
    if args.api_key:
        keys = (*config.server.api_keys, args.api_key)
        config = with_overrides(config, server={"api_keys": list(keys)})
    return config


def _run_loop(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # platforms without uvloop
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = resolve_auth(resolve_cluster_secret(build_config(args), os.environ), os.environ)
        check_cluster_secret(config)
    except (ConfigError, ConfigValueError) as exc:
        print(f"mooncaked: config error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG

    from mooncaked.process import pin_cpus

    try:
        # Before the engine starts its threads, which inherit the CPUs.
        pin_cpus(config.node.cpus)
    except ConfigError as exc:
        print(f"mooncaked: config error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG

    # Imported after the config is known good: the engine pulls in torch.
    from mooncaked.daemon import Node
    from mooncaked.log import configure_logging
    from mooncaked.process import tune_process

    log = structlog.get_logger("mooncaked")

    def on_ready(ready: Node) -> None:
        log.info("mooncaked listening", url=ready.url)
        print(f"mooncaked listening on {ready.url}", flush=True)

    node: Node | None = None

    def node_id() -> str:
        # The bound port (with port 0) is part of the default id.
        return node.node_id if node is not None else config.node_id

    # Before any logger is bound: a bound logger keeps the config it saw.
    configure_logging(config.log, node_id)
    tune_process(config.model)

    async def serve() -> int:
        nonlocal node
        node = Node(config)
        try:
            return await node.run(on_ready=on_ready)
        except ConfigError as exc:
            # A setting only start-up could check (the model's own limits): one line.
            print(f"mooncaked: config error: {exc}", file=sys.stderr, flush=True)
            return EXIT_CONFIG
        except Exception as exc:
            log.exception("start-up failed", error=str(exc))
            return EXIT_FAILED

    return _run_loop(serve())


if __name__ == "__main__":
    sys.exit(main())
