"""Which nodes a local cluster has: their roles, ids and ports, the seed, the
pipelined prefill groups, the cores each may use."""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from mooncaked.config import ConfigValueError, PipelineConfig

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 8000
# The names of the pipelined groups of ``up --cpp``: cpp-0, cpp-1, ...
GROUP_PREFIX = "cpp-"
# Ports are drawn from here up to the OS's ephemeral range, where it leaves room.
_LOW_PORT = 20000
_PORT_TRIES = 200
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@dataclass(frozen=True, slots=True)
class NodePlan:
    """One node to start.

    ``node_id`` empty: the daemon's own default. ``port`` 0: any free port,
    read back from the line the daemon prints once it listens.
    ``gossip_port`` 0: any free port; only the seed, the node every other
    one joins through, needs one known before it starts. ``group`` (empty:
    none): the pipelined prefill group whose stage ``stage`` (of
    ``num_stages``) the node is, its ``[pipeline]`` section.
    """

    node_id: str
    role: str
    port: int
    gossip_port: int
    group: str = ""
    stage: int = 0
    num_stages: int = 0

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def name(self) -> str:
        return self.node_id or f"node-{self.port}"


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = LOOPBACK, *, udp: bool = False, rng: random.Random | None = None) -> int:
    """A port nothing listens on now, for TCP and with ``udp`` for UDP too (gossip
    uses both on one port), below the OS's ephemeral range where there is room.

    A port the OS hands out for port 0 can be handed out again, to any
    process's port-0 bind or outgoing connection (daemons make plenty), before
    the node that was meant to have it binds it; a port below the ephemeral
    range is only ever taken on purpose.
    """
    # System entropy unless a test injects a source: a seeded one would have
    # two runs on one machine draw the same ports.
    rng = rng or random.SystemRandom()
    low = _ephemeral_low()
    for _ in range(_PORT_TRIES):
        port = rng.randrange(_LOW_PORT, low) if low > _LOW_PORT + 1000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            try:
                tcp.bind((host, port))
            except OSError:
                continue
            port = int(tcp.getsockname()[1])
            if not udp:
                return port
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as dgram:
                try:
                    dgram.bind((host, port))
                except OSError:
                    continue
                return port
    raise RuntimeError(f"no free port found on {host}")


def plan_cluster(members: Sequence[tuple[str, str]], *, fixed_ports: bool) -> list[NodePlan]:
    """A plan for each (node id, role) of ``members``, in start order: the
    first is the seed (a gossip port of its own, fixed now); HTTP ports are
    fixed now with ``fixed_ports``, else 0 (each daemon reports its own)."""
    return [
        NodePlan(
            node_id,
            role,
            free_port() if fixed_ports else 0,
            free_port(udp=True) if i == 0 else 0,
        )
        for i, (node_id, role) in enumerate(members)
    ]


def plan_nodes(
    num_prefill: int | None,
    num_decode: int | None,
    port: int | None,
    *,
    num_stages: int | None = None,
    num_memory: int = 0,
) -> list[NodePlan]:
    """The nodes of ``up``. No count given: one ``both`` node on ``port``
    (default 8000). Otherwise prefill nodes, decode nodes (one ``both`` node
    when only ``num_memory`` is given), then memory nodes; the entry (the
    first decode node) gets ``port`` when given, every other port is free.
    ``num_stages`` (``--cpp``): the prefill nodes form pipelined groups of
    that many stages (``pipeline_groups``)."""
    if num_memory < 0:
        raise ValueError(f"--memory counts memory nodes, got {num_memory}")
    if num_prefill is None and num_decode is None:
        if num_stages is not None:
            raise ValueError(f"--cpp {num_stages} needs prefill nodes: add --prefill and --decode")
        if not num_memory:
            return [NodePlan("", "both", DEFAULT_PORT if port is None else port, 0)]
    num_prefill = num_prefill or 0
    num_decode = num_decode or 0
    if num_prefill < 0 or num_decode < 0:
        raise ValueError(f"--prefill and --decode count nodes, got {num_prefill} and {num_decode}")
    if num_decode == 0 and num_prefill:
        raise ValueError(
            f"a cluster needs a decode node to answer requests: --decode 0 with "
            f"--prefill {num_prefill}"
        )
    members = [(f"prefill-{i}", "prefill") for i in range(num_prefill)]
    members += [(f"decode-{i}", "decode") for i in range(num_decode)]
    if not members:
        # Memory nodes alone compute nothing: one node does the rest.
        members = [("compute-0", "both")]
    members += [(f"memory-{i}", "memory") for i in range(num_memory)]
    plans = plan_cluster(members, fixed_ports=True)
    if num_stages is not None:
        plans = pipeline_groups(plans, num_stages)
    if port is not None:
        entry = entry_index(plans)
        plans[entry] = replace(plans[entry], port=port)
    return plans


def check_num_stages(num_stages: int, flag: str) -> None:
    """ValueError naming ``flag`` unless a daemon takes a group of ``num_stages`` stages."""
    try:
        PipelineConfig(group=GROUP_PREFIX + "0", num_stages=num_stages)
    except ConfigValueError as exc:
        raise ValueError(f"{flag} {num_stages}: pipeline.{exc}") from None


def pipeline_groups(plans: Sequence[NodePlan], num_stages: int) -> list[NodePlan]:
    """``plans`` with their prefill nodes, in order, the stages of pipelined
    groups of ``num_stages`` each: ``cpp-0`` of the first ``num_stages``,
    ``cpp-1`` of the next... ValueError naming ``--cpp`` where the group size
    is not one a daemon takes or the prefill nodes do not divide into it."""
    check_num_stages(num_stages, "--cpp")
    prefill = [i for i, p in enumerate(plans) if p.role == "prefill"]
    if not prefill or len(prefill) % num_stages:
        raise ValueError(
            f"--cpp {num_stages} does not divide --prefill {len(prefill)}: every pipelined "
            f"group needs {num_stages} prefill nodes, one per stage"
        )
    out = list(plans)
    for k, i in enumerate(prefill):
        group = f"{GROUP_PREFIX}{k // num_stages}"
        out[i] = replace(plans[i], group=group, stage=k % num_stages, num_stages=num_stages)
    return out


def entry_index(plans: Sequence[NodePlan]) -> int:
    """Where clients go: the first decode node (it places every request), else
    the first that serves a model (a memory node serves none)."""
    for i, p in enumerate(plans):
        if p.role == "decode":
            return i
    for i, p in enumerate(plans):
        if p.role != "memory":
            return i
    return 0


def offload_sections(plan: NodePlan) -> dict[str, dict[str, object]]:
    """``up --memory``: the nodes that decode offload their attention to the
    memory node placement picks; a memory node's service takes a free port."""
    if plan.role in ("decode", "both"):
        return {"offload": {"memory_node": "auto"}}
    if plan.role == "memory":
        return {"offload": {"port": 0}}
    return {}


def is_cluster(plans: Sequence[NodePlan]) -> bool:
    """Whether the nodes gossip as a cluster: anything but one ``both`` node alone."""
    return len(plans) > 1 or plans[0].role != "both"


def node_cpus(num_nodes: int, allowed: Sequence[int]) -> list[str]:
    """``node.cpus`` of each of ``num_nodes`` for ``up --pin``: an equal share
    of ``allowed`` each, in order, so no node's steps wait on another's."""
    cpus = sorted(allowed)
    per = len(cpus) // num_nodes
    if per < 1:
        raise ValueError(
            f"--pin: {num_nodes} nodes need a core each, and this process may use {len(cpus)}"
        )
    return [",".join(str(c) for c in cpus[i * per : (i + 1) * per]) for i in range(num_nodes)]


def stage_cpus(num_prefill: int, num_decode: int, allowed: Sequence[int]) -> list[str]:
    """``node.cpus`` of prefill nodes (first) and decode nodes where each
    prefill node must have a core of its own: a stage of a pipelined group
    that waits for another's core stalls every stage after it, while a
    decode node is mostly idle until a prompt's KV has arrived. One core to
    each prefill node, in order; the decode nodes take the cores left in
    turn, or share the last prefill node's when none is left. ValueError
    where the prefill nodes outnumber the cores."""
    cpus = sorted(allowed)
    if num_prefill > len(cpus):
        raise ValueError(
            f"--pin: {num_prefill} prefill nodes need a core each, and this process "
            f"may use {len(cpus)}"
        )
    left = cpus[num_prefill:] or cpus[num_prefill - 1 : num_prefill]
    own = [str(c) for c in cpus[:num_prefill]]
    return own + [str(left[i % len(left)]) for i in range(num_decode)]


def pool_cpus(prefill: int, decode: int, cpus: Sequence[int]) -> list[str]:
    """``node.cpus`` of each node (prefill ones first) for ``bench policies --pin``.

    The prefill and decode pools get disjoint cores, split by their sizes
    (at least one each), so neither pool's work slows the other's steps, as
    on machines of their own; within a pool, nodes take its cores in turn.
    """
    cpus = sorted(cpus)
    if len(cpus) < 2:
        raise ValueError(f"--pin needs two CPUs or more, this process may use {len(cpus)}")
    n_pre = min(len(cpus) - 1, max(1, round(len(cpus) * prefill / (prefill + decode))))
    pools = (cpus[:n_pre], cpus[n_pre:])
    out = []
    for pool, count in zip(pools, (prefill, decode), strict=True):
        per = max(1, len(pool) // count)
        for i in range(count):
            start = (i * per) % len(pool)
            out.append(",".join(str(c) for c in pool[start : start + per]))
    return out
