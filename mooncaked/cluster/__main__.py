"""``python -m mooncaked.cluster``: a gossip-only node (no engine, no cache).

    python -m mooncaked.cluster [--config FILE] [--node-id ID] [--port N]
        [--gossip-port N] [--seed HOST:PORT ...] [--role R] [--model-id M] [--test-hooks]

It reads the ``[node]``, ``[server]``, ``[cluster]`` and ``[log]`` sections of
the daemon's config (flags override them), runs a ``ClusterService`` and
serves ``/admin/cluster`` on ``server.host:server.port``. It is how the
cluster layer is exercised and benchmarked with real processes before (and
besides) the full daemon; ``--test-hooks`` (or ``cluster.test_hooks``) adds
the fake-block and packet-drop routes of ``mooncaked.cluster.routes``.

On start it prints one JSON line to stdout:
``{"node_id": ..., "gossip_port": ..., "http_port": ...}``. The first
SIGTERM/SIGINT leaves the cluster gracefully and exits 0; a second one exits
at once with status 3, as the daemon does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Sequence

import orjson
import structlog
from aiohttp import web

from mooncaked.cluster.gossip.service import ClusterService
from mooncaked.cluster.routes import cluster_routes
from mooncaked.cluster.state import LocalState
from mooncaked.config import Config, ConfigError, apply_flags, load_config
from mooncaked.process import EXIT_CONFIG, EXIT_FAILED, EXIT_FORCED, EXIT_OK


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mooncaked.cluster",
        description="A gossip-only mooncaked node: membership, state and block index.",
    )
    p.add_argument("--config", metavar="FILE", help="TOML config file")
    p.add_argument("--node-id", dest="node_id", help="node.id")
    p.add_argument("--host", help="server.host for /admin/cluster")
    p.add_argument("--port", type=int, help="server.port for /admin/cluster (0: any)")
    p.add_argument("--gossip-port", dest="gossip_port", type=int, help="cluster.gossip_port")
    p.add_argument("--seed", dest="seeds", action="append", help="cluster.seeds (repeatable)")
    p.add_argument("--role", help="node.role announced to the cluster")
    p.add_argument("--model-id", dest="model_id", default="", help="model id announced")
    p.add_argument(
        "--test-hooks",
        dest="test_hooks",
        action="store_true",
        help="serve /admin/test/* (fake blocks, packet drops); tests only",
    )
    return p


def build_config(args: argparse.Namespace) -> Config:
    return apply_flags(
        load_config(args.config),
        vars(args),
        {
            "node_id": ("node", "id"),
            "host": ("server", "host"),
            "port": ("server", "port"),
            "gossip_port": ("cluster", "gossip_port"),
            "seeds": ("cluster", "seeds"),
            "role": ("node", "role"),
        },
    )


async def serve(config: Config, *, model_id: str, test_hooks: bool) -> int:
    log = structlog.get_logger("mooncaked.cluster")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            # Whatever holds up the departure, the operator asked twice.
            log.warning("second signal: exiting at once", signal=signal.Signals(signum).name)
            sys.stderr.flush()
            os._exit(EXIT_FORCED)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    api_addr = ""

    def local_state() -> LocalState:
        return LocalState(role=config.node.role, model_id=model_id, api_addr=api_addr)

    service = ClusterService(
        config.cluster,
        config.node_id,
        config.node.cluster_secret.encode("utf-8"),
        local_state=local_state,
    )
    app = web.Application()
    app.add_routes(cluster_routes(service, test_hooks=test_hooks))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.server.host, config.server.port, reuse_address=True)
        await site.start()
        http_port = next(
            int(a[1]) for a in runner.addresses if isinstance(a, tuple) and len(a) >= 2
        )
        api_addr = f"{config.server.host}:{http_port}"
        await service.start()
        print(
            orjson.dumps(
                {
                    "node_id": config.node_id,
                    "gossip_port": service.gossip_port,
                    "http_port": http_port,
                }
            ).decode(),
            flush=True,
        )
        await stop.wait()
        log.info("signal: leaving the cluster")
        await service.leave()
        return EXIT_OK
    except OSError as exc:
        log.error("start-up failed", error=str(exc))
        return EXIT_FAILED
    finally:
        await service.close()
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"mooncaked.cluster: config error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG

    from mooncaked.log import configure_logging

    configure_logging(config.log, config.node_id)
    test_hooks = args.test_hooks or config.cluster.test_hooks
    coro = serve(config, model_id=args.model_id, test_hooks=test_hooks)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    sys.exit(main())
