"""Cluster commands: ``nodes`` (one row per member), ``cluster`` (a summary),
``requests`` (what one node has in flight) and ``drain`` (stop one node).

``nodes`` and ``cluster`` read ``/admin/cluster``, the asked node's own gossip
view: on a healthy cluster every node answers the same, during a partition
each side its own. ``drain`` resolves a node id through that view to the
node's API address and asks the node itself to drain.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from mooncakectl.client import Client, DaemonUnreachable
from mooncakectl.commands import print_fields, print_json
from mooncakectl.registry import Env, ExitStatus, command

NODE_COLUMNS = (
    "node",
    "role",
    "state",
    "load",
    "kv usage",
    "cached blocks",
    "last heard",
    "queue",
    "cost model",
)


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
        memory = st.get("memory") if st else None
        rows.append(
            (
                name,
                str(st.get("role", "-")) if st else "-",
                _state(node),
                _memory_load(memory) if memory else (_load(st) if st else "-"),
                "-" if kv is None else f"{100.0 * float(kv):.1f}%",
                str(node.get("cached_blocks", 0)),
                "-" if node.get("self") else _ago(float(node.get("last_heard_s", 0.0))),
                _queue(st) if st else "-",
                _memory_rate(memory) if memory else (_cost_model(st) if st else "-"),
            )
        )
    return rows


def _memory_load(m: dict[str, Any]) -> str:
    """A memory node's load: the sequences it holds, its pool's free room."""
    gib = 2**30
    return (
        f"{m.get('num_seqs', 0)} seq, {m.get('free_bytes', 0) / gib:.2f}/"
        f"{m.get('total_bytes', 0) / gib:.2f} GiB free"
    )


def _memory_rate(m: dict[str, Any]) -> str:
    """What prices a memory node's attention: its KV read bandwidth, and where it listens."""
    return f"KV read {float(m.get('kv_read_bps', 0.0)) / 1e9:.2f} GB/s at {m.get('attention_addr')}"


def memory_summary(doc: dict[str, Any]) -> str:
    """The memory nodes up: how many, their room and the sequences they hold."""
    mems = [
        (n.get("state") or {}).get("memory") or {}
        for n in doc.get("nodes", [])
        if n.get("status") in ("alive", "suspect") and (n.get("state") or {}).get("memory")
    ]
    if not mems:
        return "-"
    gib = 2**30
    free = sum(int(m.get("free_bytes", 0)) for m in mems) / gib
    total = sum(int(m.get("total_bytes", 0)) for m in mems) / gib
    seqs = sum(int(m.get("num_seqs", 0)) for m in mems)
    return f"{len(mems)} up, {free:.2f}/{total:.2f} GiB free, {seqs} sequences"


def _queue(st: dict[str, Any]) -> str:
    """The node's own forecast of a new prefill's wait."""
    q = (st.get("load") or {}).get("predicted_queue_s")
    return "-" if q is None else f"{float(q) * 1e3:.0f}ms"


def _cost_model(st: dict[str, Any]) -> str:
    """The fitted step model in two figures an operator can judge: a 1k-token
    prefill and one decode step at batch 8 with 1k tokens of context each."""
    step = (st.get("costs") or {}).get("step") or {}
    base = float(step.get("base_s", 0.0))
    if not base and not float(step.get("token_s", 0.0)):
        return "not measured"
    n = 1024
    prefill = (
        base
        + n * float(step.get("token_s", 0.0))
        + float(step.get("pair_s", 0.0)) * (n * (n + 1) / 2)
    )
    decode = base + 8 * float(step.get("seq_s", 0.0)) + 8 * n * float(step.get("ctx_s", 0.0))
    return f"prefill 1k {prefill * 1e3:.0f}ms, decode@8 {decode * 1e3:.1f}ms"


def _print_table(env: Env, title: str, rows: list[tuple[str, ...]]) -> None:
    if env.stdout_isatty:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for col in NODE_COLUMNS:
            table.add_column(
                col, justify="right" if col in ("kv usage", "cached blocks", "queue") else "left"
            )
        for row in rows:
            style = None if row[2] in ("alive", "draining") else "red"
            table.add_row(*row, style=style)
        Console(file=env.stdout, force_terminal=True).print(table)
        return
    _print_plain(env, NODE_COLUMNS, rows)


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
        ("memory nodes", memory_summary(doc)),
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
        out = {k: doc.get(k) for k in ("self", "summary", "counters")}
        out["memory_nodes"] = {
            str(n.get("node_id")): (n.get("state") or {}).get("memory")
            for n in doc.get("nodes", [])
            if (n.get("state") or {}).get("memory")
        }
        print_json(env, out)
        return ExitStatus.OK
    print_fields(env, "cluster", cluster_rows(doc))
    return ExitStatus.OK


REQUEST_COLUMNS = ("id", "role", "phase", "prefill", "decode", "prompt", "output", "age")


def request_rows(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per request of ``/admin/requests``, in REQUEST_COLUMNS order, oldest first."""
    rows = []
    reqs = sorted(doc.get("requests", []), key=lambda r: -float(r.get("age_s", 0.0)))
    for r in reqs:
        rows.append(
            (
                str(r.get("id")),
                str(r.get("role", "-")),
                str(r.get("phase", "-")),
                str(r.get("prefill_node") or "-"),
                str(r.get("decode_node") or "-"),
                str(r.get("prompt_tokens", 0)),
                str(r.get("output_tokens", 0)),
                _age(float(r.get("age_s", 0.0))),
            )
        )
    return rows


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.0f}m"


def _print_plain(env: Env, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max([len(col), *(len(r[i]) for r in rows)]) for i, col in enumerate(columns)]
    env.stdout.write(
        "  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip() + "\n"
    )
    for row in rows:
        env.stdout.write(
            "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() + "\n"
        )


@command(
    "requests",
    "list the requests in flight on a node: phase, prefill and decode nodes, age",
)
def requests(args: argparse.Namespace, env: Env) -> int:
    doc = env.client(args).get_json("/admin/requests")
    if args.json:
        print_json(env, doc)
        return ExitStatus.OK
    rows = request_rows(doc)
    if not rows:
        env.stdout.write(f"no requests in flight on {doc.get('node_id')}\n")
        return ExitStatus.OK
    if env.stdout_isatty:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"requests in flight on {doc.get('node_id')}")
        for col in REQUEST_COLUMNS:
            table.add_column(col, justify="right" if col in ("prompt", "output", "age") else "left")
        for row in rows:
            table.add_row(*row)
        Console(file=env.stdout, force_terminal=True).print(table)
        return ExitStatus.OK
    _print_plain(env, REQUEST_COLUMNS, rows)
    return ExitStatus.OK


def resolve_node(doc: dict[str, Any], node: str) -> tuple[str, str]:
    """(node id, API URL) of the member ``node`` of the ``/admin/cluster``
    document ``doc``; ValueError naming it when it is unknown or unreachable."""
    members = {str(n.get("node_id")): n for n in doc.get("nodes", [])}
    member = members.get(node)
    if member is None:
        known = ", ".join(sorted(members)) or "none"
        raise ValueError(
            f"unknown node {node!r}: the cluster seen by {doc.get('self')} has {known}"
        )
    api_addr = (member.get("state") or {}).get("api_addr")
    if member.get("status") != "alive" or not api_addr:
        raise ValueError(
            f"node {node!r} is {member.get('status')}, not an alive node with an API address"
        )
    return node, f"http://{api_addr}"


def _configure_drain(p: argparse.ArgumentParser) -> None:
    p.add_argument("node", help="node id (looked up in the cluster of --url) or the node's URL")
    p.add_argument(
        "--wait",
        type=float,
        nargs="?",
        const=90.0,
        metavar="SECONDS",
        help="return once the node has stopped (at most SECONDS, default 90: its "
        "drain may take server.drain_timeout_s)",
    )


@command(
    "drain",
    "drain one node and stop it: new requests go elsewhere, those in flight finish",
    configure=_configure_drain,
)
def drain(args: argparse.Namespace, env: Env) -> int:
    if "://" in args.node:
        url = args.node
    else:
        _, url = resolve_node(env.client(args).get_json("/admin/cluster"), args.node)
    target = Client(url, timeout=args.timeout, token=getattr(args, "admin_token", ""))
    answer = target.post_json("/admin/drain", {})
    node_id = answer.get("node_id", args.node)
    if args.json and args.wait is None:
        print_json(env, {**answer, "url": url})
        return ExitStatus.OK
    if not args.json:
        if answer.get("started"):
            env.stdout.write(f"draining {node_id} at {url}: it stops once its requests finish\n")
        else:
            env.stdout.write(f"{node_id} at {url} was already draining\n")
    if args.wait is None:
        return ExitStatus.OK
    deadline = time.monotonic() + args.wait
    while True:
        try:
            target.get_json("/health")
        except DaemonUnreachable:
            break
        if time.monotonic() > deadline:
            env.stderr.write(f"mooncakectl: {node_id} still draining after {args.wait}s\n")
            return ExitStatus.ERROR
        time.sleep(0.2)
    if args.json:
        print_json(env, {**answer, "url": url, "stopped": True})
    else:
        env.stdout.write(f"{node_id} stopped\n")
    return ExitStatus.OK


# -- explain ------------------------------------------------------------------------

PREFILL_COLUMNS = ("node", "cached", "remote", "queue", "transfer", "prefill", "ttft", "note")
DECODE_COLUMNS = ("node", "batch now", "batch at join", "tbt", "within slo", "memory node")


def _ms(v: Any) -> str:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return "-"
    return "inf" if f != f or f == float("inf") else f"{f * 1e3:.1f}ms"


def explain_rows(doc: dict[str, Any]) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    chosen = doc.get("placement") or {}
    first = (chosen.get("prefill") or [chosen.get("decode")])[0]
    pre = []
    for s in doc.get("prefill_candidates", []):
        mark = " *" if s.get("node_id") == first else ""
        remote = f"{s.get('remote_blocks')} on {s.get('holder')}" if s.get("holder") else "-"
        pre.append(
            (
                f"{s.get('node_id')}{mark}",
                f"{s.get('local_blocks')} blk",
                remote,
                _ms(s.get("queue_s")),
                _ms(s.get("transfer_s")) if s.get("fetch") else "-",
                _ms(s.get("prefill_s")),
                _ms(s.get("ttft_s")),
                ("fetch; " if s.get("fetch") else "")
                + (s.get("note") or "")
                + ("" if s.get("costs_known") else "costs not measured yet"),
            )
        )
    dec = []
    for s in doc.get("decode_candidates", []):
        mark = " *" if s.get("node_id") == chosen.get("decode") else ""
        dec.append(
            (
                f"{s.get('node_id')}{mark}",
                str(s.get("batch_now")),
                str(s.get("batch_at_join")),
                _ms(s.get("tbt_s")) if s.get("costs_known") else "-",
                "yes" if s.get("within_slo") else "no",
                str(s.get("memory") or "-"),
            )
        )
    return pre, dec


def _configure_explain(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="the prompt text")
    p.add_argument("--token-ids", metavar="IDS", help="the prompt as comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens asked (default 16)")
    p.add_argument("--ttft-ms", type=float, help="judge against this TTFT SLO (ms)")
    p.add_argument("--tbt-ms", type=float, help="judge against this TBT SLO (ms)")


@command(
    "explain",
    "where the Conductor would run a prompt now, and why: every candidate's cached "
    "prefix, TTFT terms and predicted TBT",
    configure=_configure_explain,
)
def explain(args: argparse.Namespace, env: Env) -> int:
    from mooncakectl.cache_cmds import prompt_arg

    prompt = prompt_arg(args, "explain")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": args.max_tokens}
    if args.ttft_ms is not None or args.tbt_ms is not None:
        for flag, v in (("--ttft-ms", args.ttft_ms), ("--tbt-ms", args.tbt_ms)):
            if v is not None and not 0 <= v <= 3_600_000:
                raise ValueError(f"{flag} must be in [0, 3600000], got {v:g}")
        body["slo"] = {"ttft_ms": args.ttft_ms or 0, "tbt_ms": args.tbt_ms or 0}
    doc = env.client(args).post_json("/admin/explain", body)
    if args.json:
        print_json(env, doc)
        return ExitStatus.OK
    env.stdout.write(
        f"entry {doc.get('entry_node')}, policy {doc.get('policy')}, "
        f"prompt {doc.get('prompt_tokens')} tokens ({doc.get('prompt_blocks')} blocks)\n"
    )
    pre, dec = explain_rows(doc)
    if pre:
        env.stdout.write("\nprefill candidates (* chosen)\n")
        _print_plain(env, PREFILL_COLUMNS, pre)
    if dec:
        env.stdout.write("\ndecode candidates (* chosen)\n")
        _print_plain(env, DECODE_COLUMNS, dec)
    rejected = doc.get("rejected")
    if rejected:
        env.stdout.write(f"\nrejected ({rejected.get('status')}): {rejected.get('reason')}\n")
    else:
        env.stdout.write(f"\n{doc.get('why')}\n")
    return ExitStatus.OK
