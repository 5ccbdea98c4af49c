"""The simulated cluster: trace arrivals, gossip snapshots, and entry nodes
placing each request with the daemon's own admission policy
(``admission.Admission`` around ``conductor.decide``).

Gossip: every ``gossip_s`` the nodes' states (what ``work.gossiped_load``
makes of each node's work, as in the daemon: ``NodeLoad`` with its
``predicted_queue_s``, and the decode forecast; its ``NodeCosts``) and
block-index changes are published to one shared view; an entry node
deciding at time t sees what was published at the last tick at or before
t, so its view is up to ``gossip_s`` old. Ticks are taken only where a
request arrives (a tick nobody reads changes nothing).

With ``shape.cpp`` the prefill nodes form pipelined groups of that many
stages (``pipeline``): each stage publishes its place in its group, the
Conductor places on whole groups, and a group runs what it is given chunk
by chunk through its stages.

Each request enters at a node drawn at random (seeded): every node can act
as the Conductor, each with its own ``Admission`` (ledger, calibrations,
margins, probes, output lengths, random source), fed back the first token
and the end of every request it placed, as the router feeds its own.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from mooncakectl.bench.trace import TraceRecord
from mooncakectl.bench.workloads import TraceScale
from mooncakectl.simulate.costs import NodeSpec, StageModel, stage_spec
from mooncakectl.simulate.events import EventQueue
from mooncakectl.simulate.host import SharedHost
from mooncakectl.simulate.network import Flow, Network
from mooncakectl.simulate.node import SimNode, SimRequest
from mooncakectl.simulate.pipeline import PipelineGroup, StageNode
from mooncaked.cluster.admission import Admission
from mooncaked.cluster.conductor import admits_decode
from mooncaked.cluster.costs import MAX_LINKS, NodeCosts
from mooncaked.cluster.placement import (
    ConductorParams,
    EarlyReject,
    Placement,
    PlacementRequest,
)
from mooncaked.cluster.ranking import PrefillScore
from mooncaked.cluster.slo import Slo
from mooncaked.cluster.state import (
    ClusterView,
    Member,
    MemberStatus,
    NodeBlocks,
    NodeState,
    StageInfo,
)
from mooncaked.engine.late_binding import PrefillWalk
from mooncaked.handoff import LayerSpan, split_layers

MODEL_ID = "simulated"


@dataclass(frozen=True, slots=True)
class Shape:
    """How many nodes of each role, and the prefill nodes' pipelined groups."""

    num_prefill: int = 0
    num_decode: int = 0
    num_both: int = 0
    # Stages a pipelined prefill group has (0: no groups); every prefill node is one.
    cpp: int = 0
    # Memory nodes serving the decode nodes' attention (``memory``): priced
    # into the decode nodes' steps, not simulated as nodes of their own.
    num_memory: int = 0

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode", "num_both"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_nodes == 0:
            raise ValueError("the cluster has no node: give --prefill and --decode, or --both")
        if self.num_prefill and not (self.num_decode or self.num_both):
            raise ValueError(f"{self.num_prefill} prefill node(s) and none that can decode")
        if self.num_memory < 0 or (self.num_memory and not self.num_decode):
            raise ValueError(
                f"--memory {self.num_memory}: memory nodes serve decode nodes' attention; "
                "give --decode >= 1 and a count >= 0"
            )
        if self.cpp == 0:
            return
        # The daemon's [pipeline] num_stages bounds.
        if not 2 <= self.cpp <= 16:
            raise ValueError(f"--cpp must be 0 (no groups) or 2..16 stages, got {self.cpp}")
        if self.num_prefill == 0:
            raise ValueError(
                f"--cpp {self.cpp} forms the prefill nodes into groups, and there are none: "
                f"give --prefill, a multiple of {self.cpp}"
            )
        if self.num_prefill % self.cpp:
            raise ValueError(
                f"--cpp {self.cpp} does not divide --prefill {self.num_prefill} into groups "
                f"of {self.cpp} stages: give a multiple of {self.cpp} prefill nodes"
            )

    @property
    def num_nodes(self) -> int:
        return self.num_prefill + self.num_decode + self.num_both

    def label(self) -> str:
        parts = []
        if self.cpp:
            parts.append(f"{self.num_prefill // self.cpp}x{self.cpp}P+{self.num_decode}D")
        elif self.num_prefill or self.num_decode:
            parts.append(f"{self.num_prefill}P+{self.num_decode}D")
        if self.num_both:
            parts.append(f"{self.num_both}B")
        if self.num_memory:
            parts.append(f"{self.num_memory}M")
        return "+".join(parts)

    def node_ids(self) -> list[tuple[str, str]]:
        return (
            [(f"p{i}", "prefill") for i in range(self.num_prefill)]
            + [(f"d{i}", "decode") for i in range(self.num_decode)]
            + [(f"b{i}", "both") for i in range(self.num_both)]
        )

    def groups(self) -> list[list[str]]:
        """The pipelined groups' stage nodes, head first: consecutive prefill nodes."""
        if not self.cpp:
            return []
        n = self.cpp
        return [[f"p{g * n + s}" for s in range(n)] for g in range(self.num_prefill // n)]


@dataclass(frozen=True, slots=True)
class SimConfig:
    shape: Shape
    node: NodeSpec
    # Decode nodes' own costs where they differ (a profile of a real decode node).
    decode_node: NodeSpec | None = None
    params: ConductorParams = field(default_factory=ConductorParams)
    slo: Slo = field(default_factory=Slo)
    # The share of admitted requests meant to meet the SLOs ([slo] target).
    slo_target: float = 0.95
    # How old an entry node's view of the others may be.
    gossip_s: float = 0.2
    # Tokens per hash id, prompt and output scales, arrival gaps (as the bench scales them).
    scale: TraceScale = field(default_factory=TraceScale)
    # Prompt + output clipped to this as the bench clips them (None: no limit).
    max_model_len: int | None = None
    seed: int = 0
    # Decode-only steps simulated as runs, one event each (False: an event a step).
    coalesce_decode: bool = True
    # Every node on one machine of this many cores, each step keeping
    # ``node_threads`` of them busy, as a loopback cluster runs (0: a
    # machine per node, as a real cluster runs).
    host_cores: float = 0.0
    node_threads: int = 1
    # Nodes requests enter at, at random (0: every node, as in the daemon).
    entries: int = 0
    # Pipelined groups (``shape.cpp``): how the model splits into stages,
    # and the head's first chunk ([pipeline] chunk_tokens; 0: the budget).
    stage_model: StageModel | None = None
    cpp_chunk_tokens: int = 512

    def spec_for(self, role: str) -> NodeSpec:
        if role == "decode" and self.decode_node is not None:
            return self.decode_node
        return self.node

    @property
    def speed(self) -> float:
        return 1.0 / self.scale.time_scale if self.scale.time_scale > 0 else math.inf

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.gossip_s < 0 or not math.isfinite(self.gossip_s):
            raise ValueError(f"--gossip-ms must be >= 0, got {self.gossip_s * 1e3}")
        if self.host_cores < 0 or not math.isfinite(self.host_cores):
            raise ValueError(f"--host-cores must be >= 0, got {self.host_cores}")
        if self.node_threads < 1:
            raise ValueError(f"--node-threads must be >= 1, got {self.node_threads}")
        if self.entries < 0:
            raise ValueError(f"--entries must be >= 0 (0: every node), got {self.entries}")
        if self.cpp_chunk_tokens < 0:
            raise ValueError(f"--cpp-chunk must be >= 0 tokens, got {self.cpp_chunk_tokens}")
        model, cpp = self.stage_model, self.shape.cpp
        if cpp and model is None:
            raise ValueError(
                "--cpp splits the model's layers among stages: it needs a --preset "
                "(a measured --profile does not say the model's layers)"
            )
        if cpp and model is not None and cpp > model.num_layers:
            raise ValueError(f"--cpp {cpp}: more stages than the model's {model.num_layers} layers")


@dataclass(slots=True)
class SimResult:
    config: SimConfig
    requests: list[SimRequest]
    nodes: list[SimNode | StageNode]
    bytes_moved: dict[str, float]
    num_events: int
    wall_s: float


def _hash_bytes(ids: Sequence[int], memo: dict[int, bytes]) -> tuple[bytes, ...]:
    out = []
    for i in ids:
        b = memo.get(i)
        if b is None:
            b = memo[i] = i.to_bytes(8, "little", signed=True)
        out.append(b)
    return tuple(out)


def trace_requests(
    records: Sequence[TraceRecord],
    scale: TraceScale | None = None,
    max_model_len: int | None = None,
) -> list[SimRequest]:
    """Records as simulated requests, sized, timed and clipped as
    ``mooncakectl bench trace`` sizes, times and clips them."""
    if not records:
        raise ValueError("the trace slice holds no request")
    scale = scale or TraceScale()
    bs = scale.block_tokens
    t0 = records[0].timestamp_ms
    memo: dict[int, bytes] = {}
    out = []
    for i, rec in enumerate(records):
        length = max(1, math.ceil(rec.input_length * scale.effective_input_scale))
        # Every request produces at least its first token.
        out_len = max(1, round(rec.output_length * scale.output_scale))
        if max_model_len is not None and length + out_len > max_model_len:
            keep = min(length, max(max_model_len - out_len, max_model_len // 2))
            out_len = max(1, min(out_len, max_model_len - keep))
            length = keep
        ids = rec.hash_ids[: math.ceil(length / bs)]
        arrival = max(0.0, rec.timestamp_ms - t0) / 1000.0 * scale.time_scale
        out.append(SimRequest(i, arrival, length, out_len, _hash_bytes(ids, memo)))
    out.sort(key=lambda r: (r.arrival_s, r.index))
    return out


class Simulation:
    def __init__(self, config: SimConfig, requests: Sequence[SimRequest]) -> None:
        self.config = config
        # The trace's blocks are the simulator's: cache, index and Conductor count them.
        self.block_tokens = config.scale.block_tokens
        self.params = replace(config.params, block_size=self.block_tokens)
        self.requests = list(requests)
        self.events = EventQueue()
        ids = config.shape.node_ids()
        self.node_ids = [node_id for node_id, _ in ids]
        self.host = SharedHost(config.host_cores) if config.host_cores > 0 else None
        self._stage_info = self._stage_infos()
        specs = {n: self._spec(n, role) for n, role in ids}
        self.network = Network(self.events, {n: spec.nic_bps for n, spec in specs.items()})
        # Whole-model nodes; stages of pipelined groups (``groups``, by head) apart.
        self.nodes = {
            node_id: SimNode(
                node_id,
                role,
                specs[node_id],
                self.events,
                block_tokens=self.block_tokens,
                on_prefill_start=self._prefill_started,
                on_prefilled=self._prefilled,
                on_done=self._done,
                coalesce=config.coalesce_decode,
                host=self.host,
                threads=config.node_threads,
            )
            for node_id, role in ids
            if node_id not in self._stage_info
        }
        self.groups = {
            stages[0]: self._group([(n, specs[n], self._stage_info[n]) for n in stages])
            for stages in config.shape.groups()
        }
        stage_nodes = {s.node_id: s for g in self.groups.values() for s in g.stages}
        self.all_nodes: dict[str, SimNode | StageNode] = {
            n: self.nodes[n] if n in self.nodes else stage_nodes[n] for n in self.node_ids
        }
        # Where requests enter: every node, or ``entries`` spread over the list.
        n = len(self.node_ids)
        k = config.entries if 0 < config.entries < n else n
        self.entry_ids = [self.node_ids[i * n // k] for i in range(k)]
        self._entry_rng = random.Random(config.seed)
        self._policy_rng = random.Random(config.seed + 1)
        self._gossip_views(specs)
        # Every node is an entry with its own admission policy, as in the daemon.
        self.admissions = {
            n: Admission(
                self.params,
                config.slo,
                rng=random.Random(f"{config.seed}:{n}"),
                target=config.slo_target,
            )
            for n in self.node_ids
        }
        self._forecasts = self.params.early_reject is EarlyReject.PREDICTED

    def _stage_infos(self) -> dict[str, StageInfo]:
        """Each stage node's place in its group: layers split as the daemon splits them."""
        cfg = self.config
        model = cfg.stage_model
        out: dict[str, StageInfo] = {}
        if model is None:
            return out
        for g, stages in enumerate(cfg.shape.groups()):
            spans = split_layers(model.num_layers, len(stages))
            for i, (node_id, span) in enumerate(zip(stages, spans, strict=True)):
                out[node_id] = StageInfo(
                    f"g{g}",
                    i,
                    len(stages),
                    span.lo,
                    span.hi,
                    span.num_layers,
                    model.act_bytes_per_token,
                    cfg.cpp_chunk_tokens,
                )
        return out

    def _spec(self, node_id: str, role: str) -> NodeSpec:
        info = self._stage_info.get(node_id)
        model = self.config.stage_model
        if info is None or model is None:
            return self.config.spec_for(role)
        span = LayerSpan(info.layer_lo, info.layer_hi, info.num_layers)
        return stage_spec(self.config.spec_for(role), model, span)

    def _group(self, stages: list[tuple[str, NodeSpec, StageInfo]]) -> PipelineGroup:
        return PipelineGroup(
            stages,
            self.events,
            self.network,
            block_tokens=self.block_tokens,
            rtt_s=self.params.fetch_rtt_s,
            on_prefilled=self._prompt_done,
            on_kv_in=self._kv_arrived,
            host=self.host,
            threads=self.config.node_threads,
        )

    def _gossip_views(self, specs: dict[str, NodeSpec]) -> None:
        """The published view, shared by every entry's ClusterView."""
        self._members: dict[str, Member] = {}
        self._blocks: dict[str, NodeBlocks] = {}
        self._published: dict[str, tuple[int, int]] = {}
        self._state_version = 0
        self._costs: dict[str, NodeCosts] = {}
        for node_id in self.node_ids:
            spec = specs[node_id]
            peers = [p for p in self.node_ids if p != node_id][:MAX_LINKS]
            # What a node would measure pulling from a peer: the slower NIC of the two.
            links = tuple((p, min(spec.nic_bps, specs[p].nic_bps)) for p in peers)
            self._costs[node_id] = replace(spec.costs, links=links)
            self._members[node_id] = Member(
                node_id, ("127.0.0.1", 0), 1, 1, MemberStatus.ALIVE, 0.0, 0.0, None
            )
            self._blocks[node_id] = NodeBlocks(1)
        self.views: dict[str, ClusterView] = {}
        for node_id in self.node_ids:
            view = ClusterView(node_id, clock=lambda: self.events.now)
            view.members = self._members
            view.blocks = self._blocks
            self.views[node_id] = view

    # -- running ------------------------------------------------------------------

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        g = self.config.gossip_s
        ticks: list[float] = []
        for r in self.requests:
            tick = math.floor(r.arrival_s / g) * g if g > 0 else r.arrival_s
            if not ticks or tick > ticks[-1]:
                ticks.append(tick)
        # Scheduled first: a tick runs before an arrival at the same instant.
        for tick in ticks:
            self.events.at(tick, self._publish)
        for r in self.requests:
            self.events.at(r.arrival_s, self._arrive, r)
        self.events.run()
        for node in self.all_nodes.values():
            node.cache.check_integrity()
        return SimResult(
            self.config,
            self.requests,
            list(self.all_nodes.values()),
            dict(self.network.bytes_moved),
            self.events.num_events,
            time.perf_counter() - t0,
        )

    # -- gossip -------------------------------------------------------------------

    def _publish(self, _: object = None) -> None:
        for node_id, node in self.all_nodes.items():
            changes = node.cache.take_changes()
            if changes:
                masks = self._blocks[node_id].masks
                for h, mask in changes.items():
                    if mask:
                        masks[h] = mask
                    else:
                        masks.pop(h, None)
            key = node.state_key()
            if self._published.get(node_id) == key and not changes:
                continue
            self._published[node_id] = key
            self._state_version += 1
            load, forecast = node.gossiped(self.events.now, forecast=self._forecasts)
            self._members[node_id].state = NodeState(
                node_id,
                1,
                self._state_version,
                "",
                node.role,
                MODEL_ID,
                f"{node_id}:80",
                False,
                load,
                self._state_version,
                len(node.cache),
                0,
                self._costs[node_id],
                forecast,
                self._stage_info.get(node_id),
            )

    # -- a request's path ---------------------------------------------------------

    def _arrive(self, r: SimRequest) -> None:
        now = self.events.now
        entry = self.entry_ids[self._entry_rng.randrange(len(self.entry_ids))]
        r.entry = entry
        request = PlacementRequest(
            MODEL_ID, r.hashes, r.num_prompt_tokens, max_tokens=r.num_output_tokens
        )
        decision = self.admissions[entry].place(self.views[entry], request, now)
        result = decision.result
        if not isinstance(result, Placement):
            r.reject_code = result.code
            return
        r.placement = result
        r.model_ttft_s, r.model_tbt_s = result.model_ttft_s, result.model_tbt_s
        r.predicted_ttft_s = result.predicted_ttft_s
        dnode = self.nodes[result.decode.node_id]
        r.decode_node = dnode.node_id
        # The decode node holds the handoff from now on, waiting for its KV.
        dnode.expect_decode(r)
        if not result.prefill:
            r.prefill_node = dnode.node_id
            self._start_prefill(r, dnode, result.fetch, None)
            return
        tried = {c.node_id for c in result.prefill}
        r.scores = {s.node_id: s for s in decision.prefill if s.node_id in tried}
        r.walk = PrefillWalk(result.offers, len(result.prefill), self.params.fetch_rtt_s)
        self._offer(r)

    def _offer(self, r: SimRequest) -> None:
        """The next prefill candidate takes the request, or (late binding, its
        true queue too long) refuses and the next is asked a round trip later."""
        p, walk = r.placement, r.walk
        assert p is not None and walk is not None
        step = walk.next()
        if step is None:
            raise RuntimeError(f"request {r.index}: no prefill candidate took it")
        i, max_wait = step
        node_id = p.prefill[i].node_id
        group = self.groups.get(node_id)
        queued = 0.0
        if max_wait < math.inf:
            # A group's head judges the offer by its own queue, as any prefill node.
            queued = (group.head if group is not None else self.nodes[node_id]).queue_s()
        if queued > max_wait:
            r.num_bounces += 1
            # A limit below 0 is known before asking (the decode node skips
            # the call); a refusal costs the round trip to the node.
            hop = self.params.fetch_rtt_s if max_wait >= 0.0 else 0.0
            self.events.at(self.events.now + hop, self._offer, r)
            return
        r.walk = None
        if group is not None:
            group.start(r)
            return
        pnode = self.nodes[node_id]
        r.prefill_node = pnode.node_id
        score = r.scores.get(pnode.node_id)
        self._start_prefill(r, pnode, p.fetches(i) and score is not None, score)

    def _start_prefill(
        self, r: SimRequest, pnode: SimNode, fetch: bool, score: PrefillScore | None
    ) -> None:
        bs = self.block_tokens
        kvb = pnode.costs.kv_bytes_per_token
        # The last prompt token is always computed: its logits give the first token.
        usable = (r.num_prompt_tokens - 1) // bs
        local, on_ssd = pnode.cache.prefix(r.hashes, usable)
        pnode.cache.use(r.hashes[:local])
        r.local_cached_tokens = local * bs
        r.ssd_tokens = on_ssd * bs
        r.pos = local * bs
        ssd_s = on_ssd * bs * kvb / pnode.spec.ssd_bps if on_ssd else 0.0
        holder_id = score.holder if score is not None else None
        held = 0
        if fetch and score is not None and holder_id is not None and holder_id in self.nodes:
            holder = self.nodes[holder_id]
            # What the holder really has now: the index it was chosen by may be stale.
            held, _ = holder.cache.prefix(r.hashes, min(usable, score.remote_blocks))
            if held > local:
                holder.cache.use(r.hashes[:held])
            else:
                held = 0
        if held:
            r.fetched_tokens = (held - local) * bs
            r.pos = held * bs
            r.ready = False

            def fetched(_flow: Flow, r: SimRequest = r, lo: int = local, hi: int = held) -> None:
                pnode.cache.insert(r.hashes[lo:hi])
                self._after(ssd_s, pnode, r)

            start = (holder.node_id, pnode.node_id, r.fetched_tokens * kvb, fetched, "fetch")
            # The lease round trip comes first (the Conductor prices it as fetch_rtt_s).
            self.events.at(self.events.now + self.params.fetch_rtt_s, self._start_flow, start)
        elif ssd_s > 0:
            r.ready = False
            self._after(ssd_s, pnode, r)
        pnode.enqueue_prefill(r)

    def _start_flow(self, arg: tuple[str, str, float, Callable[[Flow], None], str]) -> None:
        self.network.start(*arg)

    def _after(self, delay: float, pnode: SimNode, r: SimRequest) -> None:
        if delay > 0:
            self.events.at(self.events.now + delay, pnode.make_ready, r)
        else:
            pnode.make_ready(r)

    def _prefill_started(self, pnode: SimNode, r: SimRequest) -> None:
        if r.decode_node == pnode.node_id or r.num_output_tokens <= 1:
            r.kv_in = True
            return
        # KV streams to the decode node layer by layer as the prefill computes it.
        nbytes = r.num_prompt_tokens * pnode.costs.kv_bytes_per_token

        def arrived(_flow: Flow, r: SimRequest = r) -> None:
            self._kv_arrived(r)

        self.network.start(pnode.node_id, r.decode_node or "", nbytes, arrived, "kv")

    def _kv_arrived(self, r: SimRequest) -> None:
        r.kv_in = True
        if r.prefilled:
            # The KV lagged the compute: the first token leaves once it is all in.
            r.first_token_s = self.events.now
            self._join_decode(r)

    def _prefilled(self, _pnode: SimNode, r: SimRequest) -> None:
        self._prompt_done(r)

    def _prompt_done(self, r: SimRequest) -> None:
        """The prompt is computed (on a node, or a group's last stage)."""
        r.prefilled = True
        if r.num_output_tokens <= 1:
            self._first_token(r)
            self.nodes[r.decode_node or ""].finish_without_decode(r)
        elif r.kv_in:
            self._join_decode(r)
        else:
            # As in the daemon, the first token is out only when the KV is in
            # place on the decode node (``_kv_arrived`` sets it).
            r.first_token_s = None

    def _join_decode(self, r: SimRequest) -> None:
        """Prefill done and KV in: the decode node takes the request, or (the
        paper's baseline) refuses it when its batch now cannot keep the TBT
        SLO with it, before the first token leaves."""
        dnode = self.nodes[r.decode_node or ""]
        if self.params.early_reject is EarlyReject.BASELINE and not admits_decode(
            dnode.costs,
            len(dnode.running) + len(dnode.waiting),
            dnode.context_tokens,
            r.num_prompt_tokens,
            dnode.lengths.expected_more(0, r.num_output_tokens),
            self.config.slo,
        ):
            r.first_token_s = None
            r.reject_code = "tbt_slo_after_prefill"
            dnode.refuse_decode(r)
            return
        self._first_token(r)
        dnode.admit_decode(r)

    def _first_token(self, r: SimRequest) -> None:
        if r.ttft_s is not None and r.placement is not None:
            self.admissions[r.entry].on_first_token(r.placement, r.ttft_s, self.events.now)

    def _done(self, _node: SimNode, r: SimRequest) -> None:
        self.admissions[r.entry].on_finished(
            r.placement, r.num_output_tokens, r.tbt_s, r.num_output_tokens - 1, self.events.now
        )


def simulate(config: SimConfig, records: Sequence[TraceRecord]) -> SimResult:
    return Simulation(config, trace_requests(records, config.scale, config.max_model_len)).run()
