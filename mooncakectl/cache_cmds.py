"""``cache stats | lookup | clear | pin | unpin | replicas``: the node's KV cache.

- ``stats``: one row per tier (device, DRAM, SSD): blocks used of total, hit
  ratio, bytes read and written, evictions; then peer fetches, transfers,
  pins, replicas and the watermark.
- ``lookup PROMPT`` (or ``--token-ids 1,2,3``): how many prompt tokens would
  be served from each tier and how many computed.
- ``clear``: drop the device prefix cache (blocks no request uses), DRAM and SSD.
- ``pin PROMPT --ttl 600 [--hard]``: keep the prompt's blocks through
  eviction (soft: evicted last, for ``--ttl`` seconds; hard: never, for
  ``--ttl`` or until unpinned). ``unpin PROMPT`` ends their pins.
- ``replicas PROMPT --replicas N``: copy the prompt's blocks until N nodes
  hold each, or drop copies down to N (never the last one).

The blocks of pin, unpin and replicas are a prompt's full blocks (text, or
``--token-ids``) or ``--hashes HEX,HEX`` (block hashes).
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
        *store_rows(doc),
    ]


def store_rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """Pins, replicas and the watermark (absent from an older node's stats)."""
    rows: list[tuple[str, str]] = []
    pins = doc.get("pins")
    if pins:
        rows.append(
            (
                "pins",
                f"{pins['soft_blocks']} soft, {pins['hard_blocks']} hard of a budget of "
                f"{pins['budget_blocks']} blocks ({_bytes(float(pins['pinned_bytes']))} of "
                f"{_bytes(float(pins['budget_bytes']))}, max_pinned_ratio "
                f"{pins['max_pinned_ratio']:g}); {pins['in_dram']} in DRAM, "
                f"{pins['on_ssd']} on SSD; {pins['refused_budget']} refused, "
                f"{pins['expired']} expired",
            )
        )
    replicas = doc.get("replicas") or {}
    put, received = replicas.get("put"), replicas.get("received")
    if put:
        rows.append(
            (
                "replicas put",
                f"{put['blocks_stored']} blocks stored on others, {put['blocks_refused']} "
                f"refused (checksum), {put['blocks_dropped']} dropped; "
                f"{put['retained']} prompts retained",
            )
        )
    if received:
        rows.append(
            (
                "replicas taken",
                f"{received['stored']} stored, {received['corrupt']} refused (checksum), "
                f"{received['no_slot']} without a slot; inbox "
                f"{received['rows_free']}/{received['rows_total']} rows free",
            )
        )
    mark = doc.get("watermark")
    if mark:
        rows.append(
            (
                "watermark",
                f"evicts from {_pct(float(mark['high']))} to {_pct(float(mark['low']))} "
                f"of DRAM: {mark['evictions']} blocks in {mark['runs']} runs",
            )
        )
    return rows


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


def blocks_arg(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """What pin, unpin and replicas act on: a prompt, or ``--hashes``."""
    if args.hashes:
        if args.prompt is not None or args.token_ids:
            raise ValueError("give the blocks as a prompt or as --hashes, not both")
        hashes = [h for h in args.hashes.replace(" ", "").split(",") if h]
        if not hashes:
            raise ValueError("--hashes is empty")
        return {"hashes": hashes}
    return {"prompt": prompt_arg(args, command)}


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=("stats", "lookup", "clear", "pin", "unpin", "replicas"),
        help="what to do",
    )
    p.add_argument("prompt", nargs="?", help="lookup, pin, unpin, replicas: the prompt text")
    p.add_argument("--token-ids", metavar="IDS", help="the prompt as comma-separated token ids")
    p.add_argument(
        "--hashes", metavar="HEX", help="pin, unpin, replicas: comma-separated block hashes"
    )
    p.add_argument(
        "--ttl", type=float, metavar="SECONDS", help="pin: how long (a soft pin needs it)"
    )
    p.add_argument("--hard", action="store_true", help="pin: never evicted while pinned")
    p.add_argument("--replicas", type=int, metavar="N", help="replicas: holders wanted")


@command(
    "cache",
    "the KV cache: 'stats', 'lookup PROMPT' (tokens cached per tier), 'clear', "
    "'pin PROMPT --ttl S [--hard]', 'unpin PROMPT', 'replicas PROMPT --replicas N'",
    configure=_configure,
)
def cache(args: argparse.Namespace, env: Env) -> int:
    if args.action in STORE_ACTIONS:
        return STORE_ACTIONS[args.action](args, env)
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


def _pin(args: argparse.Namespace, env: Env) -> int:
    body = {**blocks_arg(args, "cache pin"), "hard": args.hard}
    if args.ttl is not None:
        body["ttl_s"] = args.ttl
    doc = env.client(args).post_json("/admin/cache/pin", body)
    if args.json:
        print_json(env, doc)
        return ExitStatus.OK
    pins = doc["pins"]
    missing = len(doc["missing"])
    kind = f"{doc['kind']}, for {doc['ttl_s']:g} s" if doc["ttl_s"] else f"{doc['kind']}"
    env.stdout.write(
        f"pinned {doc['pinned']} of {doc['num_blocks']} blocks ({kind})"
        + (f"; {missing} not held by this node" if missing else "")
        + f"; pins now {pins['soft_blocks']} soft, {pins['hard_blocks']} hard "
        f"of {pins['budget_blocks']}\n"
    )
    return ExitStatus.OK


def _unpin(args: argparse.Namespace, env: Env) -> int:
    doc = env.client(args).post_json("/admin/cache/unpin", blocks_arg(args, "cache unpin"))
    if args.json:
        print_json(env, doc)
        return ExitStatus.OK
    env.stdout.write(f"unpinned {doc['unpinned']} of {doc['num_blocks']} blocks\n")
    return ExitStatus.OK


def _replicas(args: argparse.Namespace, env: Env) -> int:
    if args.replicas is None:
        raise ValueError("'cache replicas' needs --replicas N")
    body = {**blocks_arg(args, "cache replicas"), "replicas": args.replicas}
    doc = env.client(args).post_json("/admin/cache/replicas", body)
    if args.json:
        print_json(env, doc)
        return ExitStatus.OK
    rows = [
        ("blocks", f"{doc['num_blocks']} ({doc['missing']} not on this node)"),
        ("holders before", _spread(doc["holders_before"])),
        ("holders after", _spread(doc["holders_after"])),
        ("short", f"{doc['short']} blocks below {doc['replicas']} holders"),
    ]
    for node, r in doc["nodes"].items():
        what = (
            f"{r['stored']} stored, {r['held']} held, {r['corrupt']} refused, "
            f"{r['failed']} failed, {r['dropped']} dropped, {r['kept_pinned']} kept (pinned)"
        )
        rows.append((node, what + (f"; {r['error']}" if r["error"] else "")))
    print_fields(env, f"replicas: {doc['replicas']}", rows)
    return ExitStatus.OK


def _spread(counts: list[int]) -> str:
    """Holders per block, as "n blocks on k nodes" groups."""
    if not counts:
        return "-"
    groups: dict[int, int] = {}
    for n in counts:
        groups[n] = groups.get(n, 0) + 1
    return ", ".join(f"{blocks} on {n}" for n, blocks in sorted(groups.items()))


# The store's own operations, each a function of its own.
STORE_ACTIONS = {"pin": _pin, "unpin": _unpin, "replicas": _replicas}
