"""The subcommand registry and what every command receives.

A command is a function ``(args, env) -> int`` (the exit status) registered
with ``@command``; it prints through ``env.stdout`` / ``env.stderr`` so tests
can read what it wrote, and raises ``DaemonUnreachable`` / ``DaemonError``
(from ``mooncakectl.client``) for the wrapper in ``cli`` to turn into a
message and an exit status.

    @command("nodes", "list the cluster's nodes", configure=lambda p: p.add_argument(...))
    def nodes(args: argparse.Namespace, env: Env) -> int: ...
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TextIO

from mooncakectl.client import Client


class ExitStatus(enum.IntEnum):
    OK = 0
    # Anything unexpected, or a command's own failure.
    ERROR = 1
    # Bad command line (argparse's own status).
    USAGE = 2
    # No answer from the daemon (refused, unknown host, timed out).
    UNREACHABLE = 3
    # The daemon answered with an HTTP error; its message is printed.
    HTTP_ERROR = 4
    INTERRUPTED = 130


@dataclass(slots=True)
class Env:
    stdout: TextIO
    stderr: TextIO
    environ: Mapping[str, str]
    # Humans get tables and colour; pipes get plain text.
    stdout_isatty: bool = False

    def client(self, args: argparse.Namespace) -> Client:
        return Client(args.url, timeout=args.timeout, token=getattr(args, "admin_token", ""))


CommandFn = Callable[[argparse.Namespace, Env], int]


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    help: str
    run: CommandFn
    configure: Callable[[argparse.ArgumentParser], None] | None = None


COMMANDS: dict[str, Command] = {}


def command(
    name: str, help: str, configure: Callable[[argparse.ArgumentParser], None] | None = None
) -> Callable[[CommandFn], CommandFn]:
    def register(fn: CommandFn) -> CommandFn:
        if name in COMMANDS:
            raise RuntimeError(f"mooncakectl command {name!r} is registered twice")
        COMMANDS[name] = Command(name, help, fn, configure)
        return fn

    return register
