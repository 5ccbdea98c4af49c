"""Cluster commands: ``nodes`` (one row per member) and ``cluster`` (a summary).

Both read ``/admin/cluster``, the asked node's own gossip view: on a healthy
cluster every node answers the same, during a partition each side its own.
"""

from __future__ import annotations

import argparse
from typing import Any

from mooncakectl.commands import print_fields, print_json
from mooncakectl.registry import Env, ExitStatus, command

NODE_COLUMNS = ("node", "role", "state", "load", "kv usage", "cached blocks", "last heard")


def _state(node: dict[str, Any]) -> str:
    status = str(node.get("status", "?"))
    st = node.get("state") or {}
    if status == "alive" and st.get("draining"):
        return "draining"
    return status


def _load(st: dict[str, Any]) -> str:
    load = st.get("load") or {}
    # Queued prefill tokens, then the running decode batch.
    return f"{load.get('queued_prefill_tokens', 0)} tok, {load.get('running_decode_batch', 0)} dec"


def _ago(seconds: float) -> str:
    if seconds < 1.0:
        return f"{seconds * 1000:.0f}ms ago"
    if seconds < 120:
        return f"{seconds:.1f}s ago"
    return f"{seconds / 60:.0f}m ago"


def node_rows(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per member, in NODE_COLUMNS order; the answering node is marked ``*``."""
    rows = []
    for node in doc.get("nodes", []):
        st = node.get("state") or {}
        name = str(node.get("node_id"))
        if node.get("self"):
            name += " *"
        kv = st.get("load", {}).get("kv_usage") if st else None
        rows.append(
            (
                name,
                str(st.get("role", "-")) if st else "-",
                _state(node),
                _load(st) if st else "-",
                "-" if kv is None else f"{100.0 * float(kv):.1f}%",
                str(node.get("cached_blocks", 0)),
                "-" if node.get("self") else _ago(float(node.get("last_heard_s", 0.0))),
            )
        )
    return rows


def _print_table(env: Env, title: str, rows: list[tuple[str, ...]]) -> None:
    if env.stdout_isatty:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for col in NODE_COLUMNS:
            table.add_column(
                col, justify="right" if col in ("kv usage", "cached blocks") else "left"
            )
        for row in rows:
            style = None if row[2] in ("alive", "draining") else "red"
            table.add_row(*row, style=style)
        Console(file=env.stdout, force_terminal=True).print(table)
        return
    widths = [max(len(col), *(len(r[i]) for r in rows)) for i, col in enumerate(NODE_COLUMNS)]
    env.stdout.write(
        "  ".join(c.upper().ljust(w) for c, w in zip(NODE_COLUMNS, widths, strict=True)).rstrip()
        + "\n"
    )
    for row in rows:
        env.stdout.write(
            "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() + "\n"
        )


@command("nodes", "list the cluster's nodes: role, state, load, KV usage, cached blocks")
def nodes(args: argparse.Namespace, env: Env) -> int:
    doc = env.client(args).get_json("/admin/cluster")
    if args.json:
        print_json(env, doc.get("nodes", []))
        return ExitStatus.OK
    _print_table(env, f"cluster as seen by {doc.get('self')}", node_rows(doc))
    return ExitStatus.OK


def cluster_rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    summary = doc.get("summary") or {}
    by_status = summary.get("by_status") or {}
    by_role = summary.get("by_role") or {}
    counters = doc.get("counters") or {}
    drops = sum(
        int(counters.get(k, 0))
        for k in ("dropped_bad_mac", "dropped_malformed", "dropped_oversize")
    )
    return [
        ("seen by", str(doc.get("self"))),
        ("members", str(summary.get("members", 0))),
        ("status", ", ".join(f"{n} {s}" for s, n in by_status.items() if n) or "-"),
        ("roles (up)", ", ".join(f"{n} {r}" for r, n in sorted(by_role.items())) or "-"),
        ("cached blocks", str(summary.get("cached_blocks", 0))),
        ("queued prefill", f"{summary.get('queued_prefill_tokens', 0)} tokens"),
        ("decoding", f"{summary.get('running_decode_batch', 0)} requests"),
        (
            "gossip",
            f"{counters.get('packets_sent', 0)} packets / {counters.get('bytes_sent', 0)} bytes sent, "
            f"{drops} bad packets dropped",
        ),
    ]


@command("cluster", "summarise the cluster: members by status and role, load, cached blocks")
def cluster(args: argparse.Namespace, env: Env) -> int:
    doc = env.client(args).get_json("/admin/cluster")
    if args.json:
        print_json(env, {k: doc.get(k) for k in ("self", "summary", "counters")})
        return ExitStatus.OK
    print_fields(env, "cluster", cluster_rows(doc))
    return ExitStatus.OK
