"""Shared fixtures: real daemons on loopback, as a subprocess or in-process.

- ``daemon``: one ``python -m mooncaked`` subprocess per test module, on an
  ephemeral port (read back from the line it prints once the model is loaded).
- ``daemon_factory(toml=..., *args)``: a fresh subprocess for a test that
  signals or kills it; stopped at teardown.
- ``serving(app)``: an aiohttp app of the test's own on an ephemeral loopback
  port, for as long as the block runs.
- ``node``: a ``Node`` running in the test's event loop on an ephemeral port,
  so a test can reach into its engine (a second Node in one process starts in
  well under a second); ``node_factory(**sections)`` for one with other
  settings.

Everything uses the builtin model with a small KV pool so start-up is quick.
"""

from __future__ import annotations

import asyncio
import time
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from mooncakectl.local.config import to_toml
from mooncakectl.local.process import (
    NodeProcess,
    daemon_argv,
    daemon_env,
    read_announced_url,
    spawn,
    wait_ready,
)
from mooncaked.config import Config, with_overrides
from mooncaked.daemon import Node

REPO_ROOT = Path(__file__).resolve().parent.parent


# A small pool: 512 blocks x 16 tokens is plenty for the tests and allocates fast.
TEST_SECTIONS: dict[str, dict[str, Any]] = {
    "server": {"host": "127.0.0.1", "port": 0, "drain_timeout_s": 20.0},
    "kv": {"num_blocks": 512},
    # The start-up cost profile costs seconds a daemon; tests that need the
    # cost model turn it back on.
    "conductor": {"profile": False},
    "log": {"level": "info", "format": "json"},
}
TEST_TOML = to_toml(TEST_SECTIONS)

_START_TIMEOUT_S = 60.0


def make_config(**sections: dict[str, Any]) -> Config:
    """Defaults for an in-process Node: ephemeral port, small KV pool, no
    start-up cost profile (seconds a node; tests of the cost model ask for it)."""
    base = with_overrides(Config(), **{k: TEST_SECTIONS[k] for k in ("server", "kv", "conductor")})
    return with_overrides(base, **sections) if sections else base


class DaemonProcess(NodeProcess):
    """A daemon a test started; its log holds what it wrote to stderr (its
    stdout only carried the line announcing its URL)."""

    __slots__ = ()

    def stderr(self) -> str:
        return self.log_text()


def _env() -> dict[str, str]:
    env = daemon_env()
    env.pop("MOONCAKED_URL", None)
    return env


def spawn_daemon(
    workdir: Path, toml: str = TEST_TOML, *extra_args: str, wrap: Sequence[str] = ()
) -> DaemonProcess:
    """``python -m mooncaked`` on ``toml``, once it answers /ready. ``wrap``: a
    command the daemon runs under, such as ``ip netns exec NS``; it must exec
    the daemon in place, so that signals sent to the process reach it."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "mooncaked.toml"
    cfg.write_text(toml)
    log = workdir / "mooncaked.stderr"
    argv = [*wrap, *daemon_argv(cfg, *extra_args)]
    proc = spawn(argv, log, announce=True, cwd=workdir, env=_env())
    try:
        url = read_announced_url(proc, _START_TIMEOUT_S)
    except RuntimeError as exc:
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{exc}; stderr:\n{tail}") from None
    node = tomllib.loads(toml).get("node", {})
    node_id, role = node.get("id", ""), node.get("role", "both")
    name = node_id or f"node-{url.rsplit(':', 1)[1]}"
    daemon = DaemonProcess(node_id, role, name, proc.pid, proc, url, cfg, log)
    wait_ready(url, time.monotonic() + _START_TIMEOUT_S, proc=proc, log_path=log)
    return daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = spawn_daemon(tmp_path_factory.mktemp("daemon"))
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    spawned: list[DaemonProcess] = []

    def spawn(toml: str = TEST_TOML, *args: str) -> DaemonProcess:
        d = spawn_daemon(tmp_path / f"daemon{len(spawned)}", toml, *args)
        spawned.append(d)
        return d

    try:
        yield spawn
    finally:
        for d in spawned:
            d.stop()


@pytest_asyncio.fixture
async def node_factory() -> AsyncIterator[Callable[..., Awaitable[Node]]]:
    started: list[Node] = []

    async def start(**sections: dict[str, Any]) -> Node:
        n = Node(make_config(**sections))
        await n.start()
        started.append(n)
        return n

    try:
        yield start
    finally:
        for n in reversed(started):
            await n.stop()


@pytest_asyncio.fixture
async def node() -> AsyncIterator[Node]:
    n = Node(make_config())
    await n.start()
    try:
        yield n
    finally:
        await n.stop()


class ManualClock:
    """A clock the test moves by hand (``now``), for code that takes a clock."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def wait_until_sync(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """``wait_until`` for a test outside an event loop (one that drives daemon
    subprocesses), checking every 50 ms."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


async def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Until ``cond()`` holds (checked every 10 ms); AssertionError naming ``what`` after
    ``timeout_s``. For state with no event to await; never a fixed sleep."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@asynccontextmanager
async def serving(app: web.Application, **runner_kwargs: Any) -> AsyncIterator[int]:
    """``app`` served on 127.0.0.1 until the block ends; yields its port.
    ``runner_kwargs`` go to its ``AppRunner`` (timeouts, handler cancellation)."""
    runner = web.AppRunner(app, **runner_kwargs)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
