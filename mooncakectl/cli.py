"""Argument parsing and the one place exceptions become exit statuses."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence

from mooncakectl.client import DaemonError, DaemonUnreachable
from mooncakectl.registry import COMMANDS, Env, ExitStatus

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "MOONCAKED_URL"
TOKEN_ENV = "MOONCAKECTL_ADMIN_TOKEN"
DAEMON_TOKEN_ENV = "MOONCAKED_ADMIN_TOKEN"
# Modules whose import registers their commands.
_COMMAND_MODULES = (
    "mooncakectl.commands",
    "mooncakectl.cluster_cmds",
    "mooncakectl.cache_cmds",
    "mooncakectl.objects_cmds",
    "mooncakectl.local.commands",
    "mooncakectl.bench.command",
    "mooncakectl.simulate.command",
)

EPILOG = """\
exit status:
  0    success
  1    error
  2    bad command line
  3    cannot reach mooncaked (refused, unknown host, timed out)
  4    mooncaked answered with an error
  130  interrupted
"""


def load_commands() -> None:
    for name in _COMMAND_MODULES:
        importlib.import_module(name)


def build_parser(environ: dict[str, str] | os._Environ[str]) -> argparse.ArgumentParser:
    load_commands()
    default_url = environ.get(URL_ENV) or DEFAULT_URL
    default_token = environ.get(TOKEN_ENV) or environ.get(DAEMON_TOKEN_ENV) or ""

    def add_globals(p: argparse.ArgumentParser, defaults: bool) -> None:
        # Subcommands take the same options with SUPPRESS, so they may come
        # before or after the command without one resetting the other.
        d = (lambda v: v) if defaults else (lambda _v: argparse.SUPPRESS)
        p.add_argument(
            "--url",
            default=d(default_url),
            help=f"daemon URL (default: ${URL_ENV} or {DEFAULT_URL})",
        )
        p.add_argument(
            "--admin-token",
            dest="admin_token",
            default=d(default_token),
            help=f"the node's admin token (default: ${TOKEN_ENV} or ${DAEMON_TOKEN_ENV})",
        )
        p.add_argument(
            "--json", action="store_true", default=d(False), help="machine-readable output"
        )
        p.add_argument(
            "--timeout", type=float, default=d(30.0), help="seconds to wait for the daemon"
        )

    parser = argparse.ArgumentParser(
        prog="mooncakectl",
        description="Operate a mooncaked node.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_globals(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        add_globals(p, defaults=False)
        if cmd.configure is not None:
            cmd.configure(p)
    return parser


def run(argv: Sequence[str], env: Env) -> int:
    parser = build_parser(dict(env.environ))
    try:
        # argparse writes usage and --help to sys.stdout/stderr: point them at env's.
        with contextlib.redirect_stdout(env.stdout), contextlib.redirect_stderr(env.stderr):
            args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed its own message
        return int(exc.code) if isinstance(exc.code, int) else ExitStatus.USAGE
    cmd = COMMANDS[args.command]
    try:
        return int(cmd.run(args, env))
    except DaemonUnreachable as exc:
        env.stderr.write(f"mooncakectl: {exc}\n")
        return ExitStatus.UNREACHABLE
    except DaemonError as exc:
        env.stderr.write(f"mooncakectl: {exc}\n")
        return ExitStatus.HTTP_ERROR
    except ValueError as exc:  # a bad option value the parser could not see
        env.stderr.write(f"mooncakectl: {exc}\n")
        return ExitStatus.USAGE
    except KeyboardInterrupt:
        env.stderr.write("\n")
        return ExitStatus.INTERRUPTED
    except BrokenPipeError:
        # `mooncakectl ... | head`: the reader left; nothing to report.
        return ExitStatus.OK
    except Exception as exc:
        env.stderr.write(f"mooncakectl: error: {type(exc).__name__}: {exc}\n")
        return ExitStatus.ERROR


def main(argv: Sequence[str] | None = None) -> int:
    env = Env(
        stdout=sys.stdout,
        stderr=sys.stderr,
        environ=os.environ,
        stdout_isatty=sys.stdout.isatty(),
    )
    return run(sys.argv[1:] if argv is None else argv, env)
