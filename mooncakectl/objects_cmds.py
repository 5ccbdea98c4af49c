"""``objects put | ls | get | rm``: named objects shared peer to peer.

- ``put NAME PATH``: register the file or directory at PATH (on the node;
  made absolute here) under NAME. Metadata only: nothing is copied.
- ``ls [NAME]``: the cluster's objects as the node sees them: size, shards,
  origin, who holds how many shards, and the node's own copy.
- ``get NAME``: fetch NAME onto the node, showing its progress; with
  ``--output PATH`` also download the node's copy to PATH here (a file, or a
  directory for an object that is one), each shard checked against the
  manifest as it arrives.
- ``rm NAME``: unregister NAME on the node (if it registered it) and drop the
  node's copies of it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

from mooncakectl.client import Client
from mooncakectl.commands import print_fields, print_json, print_table
from mooncakectl.registry import Env, ExitStatus, command
from mooncaked.objects.manifest import Manifest, StreamChecker

LS_COLUMNS = ("name", "version", "size", "shards", "origin", "holders", "here")


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise RuntimeError("unreachable")


def ls_rows(objects: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """One row per object version, in LS_COLUMNS order."""
    rows = []
    for o in objects:
        n = int(o["num_shards"])
        holders = ", ".join(f"{node} {h['shards']}/{n}" for node, h in o["holders"].items())
        local = o.get("local") or {}
        here = str(local.get("state", "-"))
        progress = local.get("progress")
        if progress:
            here += f" {progress['shards_done']}/{n}"
        rows.append(
            (
                str(o["name"]),
                str(o["version"]),
                _bytes(float(o["size"])),
                f"{n} x {_bytes(float(o['shard_bytes']))}",
                str(o["origin"]),
                holders or "-",
                here,
            )
        )
    return rows


def progress_line(p: dict[str, Any]) -> str:
    n, done = int(p["num_shards"]), int(p["shards_done"])
    pct = 100.0 * done / n if n else 100.0
    sources = ", ".join(f"{k} {_bytes(float(v))}" for k, v in sorted(p["bytes_from"].items()))
    extra = ""
    if p.get("corrupt") or p.get("failed_reads"):
        extra = f"; {p['corrupt']} bad shards, {p['failed_reads']} failed reads refetched"
    return (
        f"{p['name']}: {done}/{n} shards ({pct:.0f}%), {_bytes(float(p['bytes_done']))} "
        f"of {_bytes(float(p['size']))} in {float(p['elapsed_s']):.1f}s"
        + (f" from {sources}" if sources else "")
        + extra
    )


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("put", "ls", "get", "rm"), help="what to do")
    p.add_argument("name", nargs="?", help="the object's name")
    p.add_argument("path", nargs="?", help="put: the file or directory to register, on the node")
    p.add_argument(
        "-o",
        "--output",
        help="get: also download the node's copy to this path here (a file, or a directory)",
    )


@command(
    "objects",
    "named objects shared peer to peer: 'put NAME PATH', 'ls', 'get NAME [-o PATH]', 'rm NAME'",
    configure=_configure,
)
def objects(args: argparse.Namespace, env: Env) -> int:
    client = env.client(args)
    if args.action != "ls" and not args.name:
        raise ValueError(f"'objects {args.action}' needs the object's name")
    if args.path is not None and args.action != "put":
        raise ValueError(f"'objects {args.action}' takes no path")
    if args.output is not None and args.action != "get":
        raise ValueError("only 'objects get' takes --output")
    if args.action == "put":
        if not args.path:
            raise ValueError("'objects put' needs the path of a file or directory")
        doc = client.post_json(
            "/admin/objects/put", {"name": args.name, "path": os.path.abspath(args.path)}
        )
        if args.json:
            print_json(env, doc)
            return ExitStatus.OK
        env.stdout.write(
            f"registered {doc['name']} version {doc['version']}: {_bytes(float(doc['size']))} "
            f"in {doc['num_shards']} shards of {_bytes(float(doc['shard_bytes']))} "
            f"({doc['algorithm']} {doc['digest'][:16]}...)\n"
        )
        return ExitStatus.OK
    if args.action == "ls":
        found = client.get_json("/admin/objects")["objects"]
        if args.name:
            found = [o for o in found if o["name"] == args.name]
        if args.json:
            print_json(env, found)
        elif not found:
            env.stdout.write("no objects\n")
        else:
            print_table(env, "objects", LS_COLUMNS, ls_rows(found))
        return ExitStatus.OK
    if args.action == "rm":
        doc = client.post_json("/admin/objects/rm", {"name": args.name})
        if args.json:
            print_json(env, doc)
            return ExitStatus.OK
        done = []
        if doc["unregistered"] is not None:
            done.append(f"unregistered version {doc['unregistered']}")
        if doc["dropped"]:
            done.append(f"dropped copies of version {', '.join(map(str, doc['dropped']))}")
        env.stdout.write(f"{args.name}: {'; '.join(done)}\n")
        return ExitStatus.OK
    return _get(client, args, env)


def _get(client: Client, args: argparse.Namespace, env: Env) -> int:
    last: dict[str, Any] = {}
    shown = -1
    for event in client.stream("/admin/objects/get", {"name": args.name, "stream": True}):
        last = event
        if args.json:
            continue
        line = progress_line(event)
        if env.stdout_isatty:
            env.stderr.write("\r" + line + "\x1b[K")
            env.stderr.flush()
            continue
        tenth = 10 * int(event["shards_done"]) // max(1, int(event["num_shards"]))
        if tenth != shown or "path" in event:
            shown = tenth
            env.stderr.write(line + "\n")
    if env.stdout_isatty and not args.json:
        env.stderr.write("\n")
    if args.output:
        last["downloaded"] = download(client, args.name, Path(args.output))
    if args.json:
        print_json(env, last)
    else:
        rows = [("on the node", str(last.get("path")))]
        if args.output:
            rows.append(("downloaded to", str(last["downloaded"])))
        print_fields(env, args.name, rows)
    return ExitStatus.OK


def download(client: Client, name: str, output: Path) -> str:
    """The node's whole copy of ``name`` to ``output``, checked shard by shard
    against its manifest; what was written (a file or a directory)."""
    info = client.get_json(f"/admin/objects/info?name={quote(name)}")
    manifest = Manifest.from_dict(info["manifest"])
    if output.is_dir():
        output = output / manifest.root
    paths = [output / f.path if manifest.is_dir else output for f in manifest.files]
    checker = StreamChecker(manifest)
    for i, path in enumerate(paths):
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed once whole: a cut download leaves nothing at ``path``.
        tmp = path.with_name(path.name + ".part")
        try:
            with open(tmp, "wb") as fh:
                client.download(
                    f"/admin/objects/data?name={quote(name)}&file={i}", _Tee(fh, checker)
                )
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        tmp.replace(path)
    checker.finish()
    return str(output)


class _Tee:
    __slots__ = ("_checker", "_out")

    def __init__(self, out: BinaryIO, checker: StreamChecker) -> None:
        self._out = out
        self._checker = checker

    def write(self, data: bytes) -> int:
        self._checker.update(data)
        return self._out.write(data)
