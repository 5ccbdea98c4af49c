"""The run directory of ``up``/``down``: trusted only when this user alone controls it.

The default run directory sits in the shared temporary directory, where
another user can create it first and plant a ``nodes.json`` naming any pid,
or a world-readable file where ``up`` then writes the cluster secret. So:

- the run directory must belong to this user and be writable by no one else
  (``up`` creates it 0700);
- ``nodes.json`` and every file holding the secret must belong to this user,
  be a regular file (not a link to somewhere else) and be readable by no one
  else; they are written 0600;
- before ``down`` signals a pid, the process must still be the daemon ``up``
  started: this user's, running ``mooncaked`` with the config ``up`` wrote,
  and started when ``up`` recorded (a pid reused since is someone else).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_FILE = "nodes.json"


class UntrustedPath(ValueError):
    """A run directory or file that someone other than this user could have written."""


def _owner_problem(path: Path, st: os.stat_result, *, private: bool) -> str | None:
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    mask = 0o077 if private else 0o022
    if st.st_mode & mask:
        what = "readable or writable" if private else "writable"
        return f"{path} is {what} by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def open_run_dir(path: Path, *, create_mode: int = 0o700) -> Path:
    """``path``, created ``create_mode`` if missing; raises ``UntrustedPath``
    unless this user owns it and no one else may write into it."""
    try:
        path.mkdir(mode=create_mode, parents=True)
    except FileExistsError:
        pass
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedPath(f"run directory {path} is not a directory")
    problem = _owner_problem(path, st, private=False)
    if problem is not None:
        raise UntrustedPath(f"run directory not trusted: {problem}; pass --run-dir DIR")
    return path


def _check_opened(fd: int, path: Path, *, private: bool, refusal: str) -> None:
    """UntrustedPath unless the file open at ``fd`` is a regular file this user
    may trust (``_owner_problem``); ``refusal`` starts the message."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedPath(f"{path} is not a regular file")
    problem = _owner_problem(path, st, private=private)
    if problem is not None:
        raise UntrustedPath(f"{refusal} {path}: {problem}")


def write_private(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` readable by this user only.

    An existing file is reused only if it is this user's regular file and
    private already: a file planted by someone else, or one others can read,
    would hand them what is written (the cluster secret).
    """
    # Truncated only once trusted: a refused file keeps what it held.
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        # ELOOP: a symbolic link where the file should be.
        raise UntrustedPath(f"cannot write {path} safely: {exc}") from None
    try:
        _check_opened(fd, path, private=True, refusal="refusing to write a secret into")
        os.ftruncate(fd, 0)
        data = text.encode()
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
    finally:
        os.close(fd)


def read_private(path: Path) -> str | None:
    """The text of this user's private file at ``path``; None when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UntrustedPath(f"cannot read {path} safely: {exc}") from None
    try:
        _check_opened(fd, path, private=False, refusal="not trusting")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read().decode()
    finally:
        os.close(fd)


def read_state(run_dir: Path) -> list[dict[str, Any]]:
    """The daemons recorded in ``run_dir``; raises ``ValueError`` when it cannot be trusted."""
    path = run_dir / STATE_FILE
    text = read_private(path)
    if text is None:
        return []
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    nodes = data.get("nodes", []) if isinstance(data, dict) else None
    if not isinstance(nodes, list) or not all(
        isinstance(n, dict) and isinstance(n.get("pid"), int) and n["pid"] > 0 for n in nodes
    ):
        raise ValueError(f"cannot read {path}: not a list of nodes with positive pids")
    return nodes


def write_state(run_dir: Path, nodes: list[dict[str, Any]]) -> None:
    path = run_dir / STATE_FILE
    tmp = run_dir / f".{STATE_FILE}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    write_private(tmp, json.dumps({"nodes": nodes}, indent=2))
    # A reader sees the old list or the new one, never half of one.
    os.replace(tmp, path)


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    uid: int
    # Clock ticks after boot (field 22 of /proc/PID/stat): with the pid, it
    # names one process, since a pid is reused only by a later start.
    start_ticks: int
    argv: tuple[str, ...]


def process_info(pid: int) -> ProcessInfo | None:
    """What ``/proc`` says of ``pid``; None when it is gone or unreadable."""
    proc = Path(f"/proc/{pid}")
    try:
        uid = proc.stat().st_uid
        raw_stat = (proc / "stat").read_text()
        argv = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = raw_stat[raw_stat.rfind(")") + 2 :].split()
    try:
        start_ticks = int(fields[19])
    except (IndexError, ValueError):
        return None
    return ProcessInfo(uid, start_ticks, tuple(a.decode(errors="replace") for a in argv if a))


def identity(pid: int, config_path: str) -> dict[str, Any]:
    """What ``up`` records of a daemon it started, for ``down`` to check."""
    info = process_info(pid)
    return {"start_ticks": None if info is None else info.start_ticks, "config": config_path}


def not_our_daemon(node: dict[str, Any]) -> str | None:
    """Why the recorded ``node`` is not (any more) the daemon ``up`` started, or None."""
    pid = int(node["pid"])
    info = process_info(pid)
    if info is None:
        return "it is not running"
    if info.uid != os.getuid():
        return f"it belongs to uid {info.uid}"
    recorded = node.get("start_ticks")
    if recorded is None or info.start_ticks != recorded:
        return "it started after up recorded it (the pid was reused)"
    argv = info.argv
    config = node.get("config")
    is_daemon = "mooncaked" in argv and "-m" in argv
    if not is_daemon or not isinstance(config, str) or config not in argv:
        return f"it runs {' '.join(argv)[:120]!r}, not the mooncaked up started"
    return None
