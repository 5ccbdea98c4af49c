"""One ``mooncaked`` process of a local cluster: spawned, its URL read back,
waited for until ready and joined, stopped.

A daemon's log file gets its stderr, and its stdout too unless the caller
reads the URL the daemon announces there (``announce``: a node on port 0).
A detached daemon runs in a session of its own, so it outlives the command
that started it and that command's terminal (``up``).

No event crosses the process boundary to say a daemon is ready or has met
its peers, so those waits ask it over HTTP until it says so; they block,
and ``LocalCluster`` runs them in threads.
"""

from __future__ import annotations

import importlib.util
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from mooncakectl.client import Client, DaemonError, DaemonUnreachable
from mooncakectl.rundir import identity, not_our_daemon

ANNOUNCE_PREFIX = "mooncaked listening on "
# A daemon that did not drain within the wait gets this long after SIGKILL.
KILL_WAIT_S = 10.0
_POLL_S = 0.05
# Between two questions to a daemon that is not there yet.
_ASK_AGAIN_S = 0.2
_ASK_TIMEOUT_S = 2.0


class StartFailed(RuntimeError):
    """A node exited while starting, or was not ready (or joined) in time; the
    message names it and where its log is."""


def daemon_argv(config_path: Path, *extra_args: str) -> list[str]:
    """``python -m mooncaked`` on ``config_path``, with this interpreter."""
    return [sys.executable, "-m", "mooncaked", "--config", str(config_path), *extra_args]


def daemon_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a daemon runs in: ``environ`` (this process's by default)
    with the folder this process imports ``mooncaked`` from first on
    PYTHONPATH, so a daemon started from a checkout runs the same code."""
    env = dict(os.environ if environ is None else environ)
    spec = importlib.util.find_spec("mooncaked")
    if spec is not None and spec.origin is not None:
        root = str(Path(spec.origin).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def open_log(path: Path) -> int:
    """``path`` opened for appending, readable by this user only; a link where
    the log should be is refused (it may point anywhere)."""
    return os.open(
        path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )


def spawn(
    argv: Sequence[str],
    log_path: Path,
    *,
    announce: bool = False,
    detach: bool = False,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """``argv`` running with its output in ``log_path``; with ``announce`` its
    stdout is a pipe for ``read_announced_url``."""
    with os.fdopen(open_log(log_path), "ab") as log:
        return subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE if announce else log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=daemon_env() if env is None else dict(env),
            start_new_session=detach,
        )


def read_announced_url(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The URL of the line a daemon started with ``announce`` prints once it
    listens; RuntimeError when it exits, says something else or stays silent."""
    if proc.stdout is None:
        raise RuntimeError("the daemon's stdout is not a pipe: start it with announce")
    deadline = time.monotonic() + timeout_s
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                break
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
    line = buf.decode(errors="replace")
    if not line.startswith(ANNOUNCE_PREFIX) or not line.endswith("\n"):
        if proc.poll() is None:
            proc.kill()
        proc.wait(KILL_WAIT_S)
        raise RuntimeError(f"mooncaked did not start (exit {proc.returncode}); stdout {line!r}")
    return line[len(ANNOUNCE_PREFIX) :].strip()


@dataclass(slots=True)
class NodeProcess:
    """A started daemon: its node id and role (empty id: the daemon's default),
    a name for messages, its process, URL, config and log."""

    node_id: str
    role: str
    name: str
    pid: int
    proc: subprocess.Popen[bytes]
    url: str
    config_path: Path
    log_path: Path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (the daemon drains), wait; SIGKILL if it does not exit. The exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(KILL_WAIT_S)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def record(self) -> dict[str, Any]:
        """What the run directory keeps of it, for ``down`` (``rundir.not_our_daemon``)."""
        facts = {key: getattr(self, key) for key in ("pid", "url", "node_id", "role")}
        return facts | {"log": str(self.log_path)} | identity(self.pid, str(self.config_path))


def wait_ready(
    url: str,
    deadline: float,
    *,
    proc: subprocess.Popen[bytes] | None = None,
    name: str = "",
    log_path: Path | None = None,
    given_up: threading.Event | None = None,
) -> None:
    """Until the daemon at ``url`` answers ``/ready`` with 200; StartFailed when
    ``proc`` exits first, the monotonic ``deadline`` passes or the caller sets
    ``given_up``. ``name`` and ``log_path`` go into the message."""
    client = Client(url, timeout=_ASK_TIMEOUT_S)
    who = f"{name}: " if name else ""
    see = f"; see {log_path}" if log_path is not None else ""
    while True:
        if proc is not None and proc.poll() is not None:
            raise StartFailed(
                f"{who}mooncaked exited with status {proc.returncode} while starting{see}"
            )
        try:
            if client.get_json("/ready").get("ready"):
                return
        except (DaemonUnreachable, DaemonError):
            pass
        if time.monotonic() > deadline or (given_up is not None and given_up.is_set()):
            raise StartFailed(f"{who}mooncaked at {url} was not ready in time{see}")
        time.sleep(_ASK_AGAIN_S)


def sees_all(url: str, node_ids: set[str], *, admin_token: str = "") -> bool:
    """Whether the node at ``url`` sees every one of ``node_ids`` alive with its
    API address and model known (what placement needs to pick it); a memory
    node, which loads no model, once its attention service is known."""
    try:
        doc = Client(url, timeout=_ASK_TIMEOUT_S, token=admin_token).get_json("/admin/cluster")
    except (DaemonUnreachable, DaemonError):
        return False
    alive = {
        n.get("node_id")
        for n in doc.get("nodes", [])
        if n.get("status") == "alive" and _serves(n.get("state") or {})
    }
    return node_ids <= alive


def _serves(state: dict[str, Any]) -> bool:
    """Whether a gossiped state says what placement needs to pick the node."""
    if not state.get("api_addr"):
        return False
    if state.get("role") == "memory":
        return bool((state.get("memory") or {}).get("attention_addr"))
    return bool(state.get("model_id"))


def stages_seen(url: str, *, admin_token: str = "") -> dict[str, dict[str, Any]]:
    """The stages of pipelined groups that the node at ``url`` sees, by node
    id: each one's ``/admin/cluster`` stage (group, index, num_stages, its
    layers ``layer_lo`` to ``layer_hi`` of ``num_layers``); empty when the
    node cannot say."""
    try:
        doc = Client(url, timeout=_ASK_TIMEOUT_S, token=admin_token).get_json("/admin/cluster")
    except (DaemonUnreachable, DaemonError):
        return {}
    out = {}
    for n in doc.get("nodes", []):
        stage = (n.get("state") or {}).get("stage")
        if isinstance(stage, dict):
            out[str(n.get("node_id"))] = stage
    return out


def describe_stage(stage: Mapping[str, Any]) -> str:
    """``cpp-0 stage 1/2, layers 15-29 of 30`` (layers counted from 0, both
    ends in; ``layer 3 of 4`` for one)."""
    text = f"{stage['group']} stage {stage['index']}/{stage['num_stages']}"
    if "layer_lo" in stage:
        lo, last = stage["layer_lo"], stage["layer_hi"] - 1
        layers = f"layer {lo}" if lo == last else f"layers {lo}-{last}"
        text += f", {layers} of {stage['num_layers']}"
    return text


def wait_joined(
    members: Sequence[tuple[str, str]],
    deadline: float,
    *,
    given_up: threading.Event | None = None,
) -> None:
    """Until each of ``members`` (node id, URL) sees all of them alive;
    StartFailed naming those that do not once the monotonic ``deadline``
    passes or the caller sets ``given_up``."""
    ids = {node_id for node_id, _ in members}
    waiting = list(members)
    while True:
        waiting = [(node_id, url) for node_id, url in waiting if not sees_all(url, ids)]
        if not waiting:
            return
        if time.monotonic() > deadline or (given_up is not None and given_up.is_set()):
            names = ", ".join(node_id for node_id, _ in waiting)
            raise StartFailed(f"{names} did not see all {len(members)} nodes alive in time")
        time.sleep(_ASK_AGAIN_S)


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _gone(proc: subprocess.Popen[bytes] | None, pid: int) -> bool:
    """True once ``pid`` is gone (our own child is reaped so it is not a zombie)."""
    if proc is not None:
        return proc.poll() is not None
    return not is_running(pid)


def label(node: Mapping[str, Any]) -> str:
    if node.get("node_id"):
        return f"{node['node_id']} {node['url']}"
    return str(node["url"])


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop_nodes(
    nodes: Sequence[Mapping[str, Any]],
    wait_s: float,
    procs: Mapping[int, subprocess.Popen[bytes]] | None = None,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> tuple[int, int]:
    """SIGTERM every live node of ``nodes`` (records as ``NodeProcess.record``
    writes them) at once, each drains; wait up to ``wait_s``, then SIGKILL the
    ones still running. A pid not in ``procs`` (our children) is signalled only
    while it is still the daemon recorded. Returns (drained, killed)."""
    procs = procs or {}
    live = []
    for node in nodes:
        pid = int(node["pid"])
        why = None if pid in procs else not_our_daemon(dict(node))
        if why is None:
            live.append(node)
        elif why != "it is not running" and err is not None:
            err.write(f"mooncakectl: not signalling pid {pid} ({label(node)}): {why}\n")
    for node in live:
        _signal(int(node["pid"]), signal.SIGTERM)
    drained = 0
    deadline = time.monotonic() + wait_s
    pending = list(live)
    while pending:
        still = []
        for node in pending:
            pid = int(node["pid"])
            if _gone(procs.get(pid), pid):
                drained += 1
                if out is not None:
                    out.write(f"stopped {label(node)} (pid {pid})\n")
            else:
                still.append(node)
        pending = still
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(_POLL_S)
    for node in pending:
        _kill(node, wait_s, procs.get(int(node["pid"])), err)
    return drained, len(pending)


def _kill(
    node: Mapping[str, Any], wait_s: float, proc: subprocess.Popen[bytes] | None, err: TextIO | None
) -> None:
    pid = int(node["pid"])
    if err is not None:
        err.write(
            f"mooncakectl: {label(node)} (pid {pid}) still draining after {wait_s}s; killing it\n"
        )
    _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while not _gone(proc, pid) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
