"""``cache stats | lookup PROMPT | clear``: the node's KV cache tiers.

- ``stats``: one row per tier (device, DRAM, SSD): blocks used of total, hit
  ratio, bytes read and written, evictions; then peer fetches and transfers.
- ``lookup PROMPT`` (or ``--token-ids 1,2,3``): how many prompt tokens would
  be served from each tier and how many computed.
- ``clear``: drop the device prefix cache (blocks no request uses), DRAM and SSD.
"""

from __future__ import annotations

import argparse
from typing import Any

from mooncakectl.commands import print_fields, print_json, print_table
from mooncakectl.registry import Env, ExitStatus, command

TIER_COLUMNS = ("tier", "blocks", "hit ratio", "read", "written", "evictions")


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise RuntimeError("unreachable")


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def tier_rows(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per tier in TIER_COLUMNS order; a tier the node lacks is left out."""
    rows: list[tuple[str, ...]] = []
    device = doc.get("device")
    if device:
        rows.append(
            (
                "device",
                f"{device['blocks_cached']} cached, {device['blocks_used']}/"
                f"{device['blocks_total']} used",
                "-",
                "-",
                "-",
                "-",
            )
        )
    for name in ("dram", "ssd"):
        t = doc.get(name)
        if not t:
            continue
        rows.append(
            (
                name,
                f"{t['used_blocks']}/{t['capacity_blocks']}",
                _pct(float(t["hit_ratio"])),
                _bytes(float(t["bytes_read"])),
                _bytes(float(t["bytes_written"])),
                str(t["evictions"]),
            )
        )
    return rows


def summary_rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    peer = doc.get("peer") or {}
    leases = doc.get("leases") or {}
    transfer = doc.get("transfer") or {}
    store = doc.get("store") or {}
    layout = doc.get("layout") or {}
    by_transport = transfer.get("bytes_by_transport") or {}
    return [
        (
            "block",
            f"{layout.get('block_size', '?')} tokens, {_bytes(float(layout.get('block_bytes', 0)))}"
            f" ({layout.get('num_layers', '?')} layers, {layout.get('dtype', '?')})",
        ),
        (
            "peer fetches",
            f"{peer.get('ok', 0)} ok, {peer.get('failed', 0)} failed, "
            f"{peer.get('missed', 0)} missed, {peer.get('timed_out', 0)} timed out; "
            f"{peer.get('blocks', 0)} blocks, {_bytes(float(peer.get('bytes', 0)))}",
        ),
        (
            "leases to peers",
            f"{leases.get('active', 0)} active, {leases.get('granted', 0)} granted, "
            f"{leases.get('lapsed', 0)} lapsed",
        ),
        (
            "transfer",
            f"{transfer.get('address') or '-'}: read {_bytes(float(transfer.get('bytes_read', 0)))}"
            + (
                " ("
                + ", ".join(f"{k} {_bytes(float(v))}" for k, v in sorted(by_transport.items()))
                + ")"
                if by_transport
                else ""
            )
            + f", served {_bytes(float(transfer.get('served_bytes_read', 0)))}",
        ),
        (
            "dropped",
            f"{store.get('offloads_dropped', 0)} offloads, "
            f"{store.get('ssd_writes_dropped', 0)} SSD writes, "
            f"{store.get('ssd_corrupt_dropped', 0)} corrupt SSD blocks",
        ),
    ]


def lookup_rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    tokens = doc["hit_tokens"]
    total = int(doc["num_prompt_tokens"])

    def share(n: int) -> str:
        return f"{n} tokens ({_pct(n / total) if total else '-'})"

    return [
        ("prompt", f"{total} tokens, {doc['block_size']} per block"),
        ("device", share(int(tokens["device"]))),
        ("dram", share(int(tokens["dram"]))),
        ("ssd", share(int(tokens["ssd"]))),
        ("cached", share(int(tokens["total"]))),
        ("computed", share(int(doc["computed_tokens"]))),
    ]


def prompt_arg(args: argparse.Namespace, command: str) -> str | list[int]:
    """The prompt a command was given: its text, or ``--token-ids``; not both, not neither."""
    if args.token_ids:
        if args.prompt is not None:
            raise ValueError("give the prompt as text or as --token-ids, not both")
        return parse_token_ids(args.token_ids)
    if args.prompt:
        return str(args.prompt)
    raise ValueError(f"'{command}' needs a prompt (text, or --token-ids)")


def parse_token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--token-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--token-ids is empty")
    return ids


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("stats", "lookup", "clear"), help="what to do")
    p.add_argument("prompt", nargs="?", help="lookup: the prompt text")
    p.add_argument(
        "--token-ids", metavar="IDS", help="lookup: the prompt as comma-separated token ids"
    )


@command(
    "cache",
    "the KV cache tiers: 'stats', 'lookup PROMPT' (tokens cached per tier), 'clear'",
    configure=_configure,
)
def cache(args: argparse.Namespace, env: Env) -> int:
    client = env.client(args)
    if args.action != "lookup" and (args.prompt is not None or args.token_ids):
        raise ValueError(f"'cache {args.action}' takes no prompt")
    if args.action == "stats":
        doc = client.get_json("/admin/cache/stats")
        if args.json:
            print_json(env, doc)
            return ExitStatus.OK
        print_table(env, "KV cache tiers", TIER_COLUMNS, tier_rows(doc))
        env.stdout.write("\n")
        print_fields(env, "peers and transfers", summary_rows(doc))
        return ExitStatus.OK
    if args.action == "lookup":
        doc = client.post_json("/admin/cache/lookup", {"prompt": prompt_arg(args, "cache lookup")})
        if args.json:
            print_json(env, doc)
            return ExitStatus.OK
        print_fields(env, "cache lookup", lookup_rows(doc))
        return ExitStatus.OK
    doc = client.post_json("/admin/cache/clear", {})
    if args.json:
        print_json(env, doc)
        return ExitStatus.OK
    env.stdout.write(
        f"cleared {doc['device_blocks']} device blocks and {doc['store_blocks']} DRAM/SSD blocks\n"
    )
    return ExitStatus.OK
