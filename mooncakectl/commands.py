"""Node commands: ``status`` and ``generate``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from mooncakectl.registry import Env, ExitStatus, command
from mooncaked.wire.headers import DECODE_NODE_HEADER, PREFILL_NODE_HEADER


def print_json(env: Env, data: Any) -> None:
    env.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")


def print_fields(env: Env, title: str, rows: list[tuple[str, str]]) -> None:
    """Key/value rows: a rich table on a terminal, ``key: value`` lines otherwise."""
    if env.stdout_isatty:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, show_header=False, box=None, pad_edge=False)
        table.add_column(style="bold")
        table.add_column()
        for key, value in rows:
            table.add_row(key, value)
        Console(file=env.stdout, force_terminal=True).print(table)
        return
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        env.stdout.write(f"{key + ':':<{width + 1}} {value}\n")


def print_table(
    env: Env, title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]
) -> None:
    """Rows under column headers: a rich table on a terminal, aligned plain text otherwise."""
    if env.stdout_isatty:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for i, col in enumerate(columns):
            table.add_column(col, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        Console(file=env.stdout, force_terminal=True).print(table)
        return
    widths = [max(len(col), *(len(r[i]) for r in rows)) for i, col in enumerate(columns)]
    env.stdout.write(
        "  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip() + "\n"
    )
    for row in rows:
        env.stdout.write(
            "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() + "\n"
        )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100.0 * x:.1f}%"


def _duration(seconds: float) -> str:
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m {s}s"
    if minutes:
        return f"{minutes}m {s}s"
    return f"{seconds:.1f}s"


def _offload_row(o: dict[str, Any]) -> str:
    """Attention offloading, from either side: what went out, or what was served."""
    mib = 2**20
    if o.get("side") == "memory":
        pool = o.get("pool") or {}
        return (
            f"memory node at {o.get('attention_addr')}: {int(pool.get('num_seqs', 0))} "
            f"sequences of {int(pool.get('num_peers', 0))} compute nodes, "
            f"{int(pool.get('num_free_blocks', 0))}/{int(pool.get('num_blocks', 0))} blocks free; "
            f"{o.get('layers', 0)} layers served, {o.get('bytes_in', 0) / mib:.1f} MiB in"
        )
    where = o.get("connected_to") or "-"
    return (
        f"to {o.get('memory_node')} (now {where}): {o.get('steps', 0)} steps, "
        f"{o.get('layers', 0)} layers, {o.get('bytes_sent', 0) / mib:.1f} MiB out, "
        f"{o.get('failures', 0)} failures, {o.get('local_fallbacks', 0)} steps local"
    )


def status_rows(st: dict[str, Any]) -> list[tuple[str, str]]:
    state = "draining" if st.get("draining") else ("ready" if st.get("ready") else "loading")
    load = st.get("load") or {}
    kv = st.get("kv")
    prefix = st.get("prefix_cache")
    rows = [
        ("node", str(st.get("node_id"))),
        ("state", state),
        ("model", str(st.get("model") or "-")),
        ("role", str(st.get("role"))),
        ("version", str(st.get("version"))),
        ("uptime", _duration(float(st.get("uptime_s", 0.0)))),
        ("load", f"{load.get('running', 0)} running, {load.get('waiting', 0)} waiting"),
    ]
    if kv:
        rows.append(
            ("kv cache", f"{kv['blocks_used']}/{kv['blocks_total']} blocks ({_pct(kv['usage'])})")
        )
    else:
        rows.append(("kv cache", "-"))
    rows.append(("prefix hit rate", _pct(prefix["hit_rate"]) if prefix else "-"))
    compute = st.get("compute")
    if compute:
        quant = compute.get("quantization")
        threads = compute.get("cpu_threads")
        kernel = compute["linear_kernel"]
        if kernel == "packed" and compute.get("packed_layout_rows"):
            kernel += f" ({compute['packed_layout_rows']}-row layout)"
        if compute.get("single_row_gemv"):
            extra = compute.get("gemv_extra_bytes", 0) / 2**20
            kernel += f" + one-row GEMV ({extra:.0f} MiB dense copy)"
        sizes = compute.get("cuda_graphs") or []
        graphs = f"decode in CUDA graphs (batch {sizes[0]}..{sizes[-1]}), " if sizes else ""
        rows.append(
            (
                "compute",
                f"{compute['device']} {compute['dtype']}, "
                f"{quant if quant and quant != 'none' else 'unquantized'}, "
                f"{kernel} linears, {graphs}"
                + (f"{threads} threads" if threads else "torch's default threads"),
            )
        )
    offload = st.get("offload")
    if offload:
        rows.append(("offload", _offload_row(offload)))
    cond = st.get("conductor")
    if cond:
        rows.append(("placement", f"{cond['policy']}, early rejection {cond['early_reject']}"))
        slo = cond.get("slo") or {}
        targets = [
            f"TTFT {slo['ttft_s']:g} s" if slo.get("ttft_s") else "",
            f"TBT {slo['tbt_s'] * 1e3:g} ms" if slo.get("tbt_s") else "",
        ]
        shown = ", ".join(t for t in targets if t)
        if shown and slo.get("target"):
            shown += f", {_pct(slo['target'])} of admitted meant to meet them"
        rows.append(("slo", shown or "none"))
        # How this entry corrects its forecasts by what it measured, and the
        # margin admission allows for their error: why requests are rejected.
        for name in ("ttft", "tbt"):
            c = (cond.get("calibration") or {}).get(name)
            if c and c.get("samples"):
                rows.append(
                    (
                        f"{name} forecast",
                        f"x{c['scale']:g} + {c['offset_s'] * 1e3:.1f} ms, admission margin "
                        f"x{c.get('margin', 1.0):g} ({c['samples']} requests measured)",
                    )
                )
        if cond.get("probes"):
            rows.append(
                (
                    "probes",
                    f"{cond['probes']} admitted that only the margins rejected, after a second "
                    "with nothing admitted",
                )
            )
    return rows


@command("status", "show the node: model, role, load, KV usage, prefix hit rate")
def status(args: argparse.Namespace, env: Env) -> int:
    st = env.client(args).get_json("/admin/status")
    if args.json:
        print_json(env, st)
    else:
        print_fields(env, "mooncaked", status_rows(st))
    return ExitStatus.OK


def _configure_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt (with --chat: the user message)")
    p.add_argument("--max-tokens", type=int, dest="max_tokens", help="tokens to generate at most")
    p.add_argument("--temperature", type=float, help="0 for greedy; the daemon's default is 1")
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat user message")
    p.add_argument("--model", help="model name (default: the one the node serves)")


@command("generate", "stream a completion to the terminal", configure=_configure_generate)
def generate(args: argparse.Namespace, env: Env, served: dict[str, str] | None = None) -> int:
    """Streams the completion; ``served`` (when given) gets the nodes that ran
    its prefill and decode, from the response headers."""
    body: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
    if args.chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = args.prompt
    for key in ("max_tokens", "temperature", "model"):
        value = getattr(args, key)
        if value is not None:
            body[key] = value

    text: list[str] = []
    finish_reason = None
    usage = None
    request_id = None
    nodes: dict[str, str] = {}

    def on_headers(headers: Mapping[str, str]) -> None:
        for key, header in (
            ("prefill_node", PREFILL_NODE_HEADER),
            ("decode_node", DECODE_NODE_HEADER),
        ):
            if headers.get(header):
                nodes[key] = headers[header]

    for chunk in env.client(args).stream(path, body, on_headers=on_headers):
        request_id = chunk.get("id", request_id)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            piece = choice.get("text") if not args.chat else choice.get("delta", {}).get("content")
            if piece:
                text.append(piece)
                if not args.json:
                    # Token by token, as it arrives.
                    env.stdout.write(piece)
                    env.stdout.flush()
            finish_reason = choice.get("finish_reason") or finish_reason
    if args.json:
        print_json(
            env,
            {
                "id": request_id,
                "text": "".join(text),
                "finish_reason": finish_reason,
                "usage": usage,
                **nodes,
            },
        )
    else:
        env.stdout.write("\n")
    if served is not None:
        served.update(nodes)
    return ExitStatus.OK


@command("secret", "print a fresh cluster secret (for node.cluster_secret_file)")
def secret(args: argparse.Namespace, env: Env) -> int:
    from mooncaked.secrets import generate_secret

    print(generate_secret(), file=env.stdout)
    return ExitStatus.OK
