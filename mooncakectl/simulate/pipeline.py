"""Pipelined prefill groups (chunked pipeline parallelism) in the simulator.

A group's stages are prefill nodes, each holding a range of the model's
layers (``handoff.split_layers``) and publishing its place in the group
(``state.StageInfo``), so the Conductor sees the group whole and prices it
with ``ranking.group_score``. A request placed on a group runs as the
daemon runs it (``api/pipeline.py``):

- opening: the head opens the next stage, which opens the one after it, a
  round trip (``fetch_rtt_s``) each; the group starts from the prefix every
  stage holds of its layers (``hashing.layer_hashes`` keys), the least of
  them; a stage that holds part of it on SSD reads it back first;
- the head cuts the rest into chunks level in time by its own step model
  (``costs.equal_time_chunks``, multiples of a block) and computes them in
  order, no further than the next chunk's end a step;
- every stage steps on its own, as a prefill node does: first come first
  served, several requests to a step up to its token budget, each no
  further than its input has arrived; what a step computed of a request
  goes on to the next stage as one write of its activations (tokens x
  ``act_bytes_per_token`` over the NICs) and a notice a round trip after
  it; a later write that lands first waits for the earlier ones;
- each stage streams its own layers' KV to the decode node (its share of
  the bytes) from its first step of the request on; the last stage's end
  is the prompt's end, and the first token leaves when all the KV is in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

from mooncakectl.simulate.cache import BlockCache
from mooncakectl.simulate.costs import NodeSpec
from mooncakectl.simulate.events import EventQueue
from mooncakectl.simulate.host import SharedHost
from mooncakectl.simulate.network import Flow, Network
from mooncakectl.simulate.node import SimRequest
from mooncaked.cache.hashing import layer_hashes
from mooncaked.cluster.costs import equal_time_chunks, prefill_pairs
from mooncaked.cluster.forecast import DecodeForecast, DepartureRate, OutputLengths, PrefillWork
from mooncaked.cluster.state import NodeLoad, StageInfo
from mooncaked.cluster.work import NodeWork, gossiped_load, queue_s


@dataclass(slots=True, eq=False)
class PipelineRun:
    """One request on a group: its part on each stage, and the stages'
    KV streams to the decode node not yet in."""

    request: SimRequest
    tasks: list[StageTask] = field(default_factory=list)
    kv_left: int = 0


@dataclass(slots=True, eq=False)
class StageTask:
    """A request's part on one stage of its group."""

    run: PipelineRun
    index: int
    # The prompt's full blocks as this stage caches them (its layers' keys).
    keys: list[bytes]
    # Tokens in this stage's KV (the group's start, then computed), and left.
    pos: int
    left: int
    # Tokens whose input is here: the whole prompt on the head, elsewhere
    # what the stage before has delivered.
    arrived: int
    # The head's chunk ends still to reach, in order (empty elsewhere).
    ends: deque[int] = field(default_factory=deque)
    # Opened (and its SSD blocks read back): it may step.
    ready: bool = False
    started: bool = False
    # Activation writes: numbered as sent; landed ones wait for the earlier.
    next_out: int = 0
    next_in: int = 0
    landed: dict[int, int] = field(default_factory=dict)


class StageNode:
    """One stage of a pipelined group: a prefill node that steps on its part
    of each request (``StageTask``), priced by its own layers' ``StepCost``."""

    role = "prefill"

    def __init__(
        self,
        node_id: str,
        spec: NodeSpec,
        info: StageInfo,
        events: EventQueue,
        *,
        block_tokens: int,
        on_started: Callable[[StageNode, StageTask], None],
        on_computed: Callable[[StageNode, StageTask, int], None],
        host: SharedHost | None = None,
        threads: int = 1,
    ) -> None:
        self.node_id = node_id
        self.spec = spec
        self.costs = spec.costs
        self.info = info
        self.events = events
        self.block_tokens = block_tokens
        block_bytes = block_tokens * max(1, spec.costs.kv_bytes_per_token)
        self.cache = BlockCache(
            int(spec.dram_bytes // block_bytes), int(spec.ssd_bytes // block_bytes)
        )
        self._on_started = on_started
        self._on_computed = on_computed
        self.host = host
        self.threads = threads
        self.queue: list[StageTask] = []
        self.busy = False
        self.busy_s = 0.0
        self.version = 0
        self.num_prefilled = 0
        # A prefill node decodes nothing: empty, for the load it publishes.
        self.lengths = OutputLengths()
        self.departures = DepartureRate()

    def enqueue(self, t: StageTask) -> None:
        self.queue.append(t)
        self.version += 1
        self.kick()

    def make_ready(self, t: StageTask) -> None:
        t.ready = True
        self.kick()

    def land(self, t: StageTask, seq: int, end: int) -> None:
        """Write ``seq`` of ``t``'s input, up to prompt position ``end``, is here."""
        t.landed[seq] = end
        while t.next_in in t.landed:
            t.arrived = t.landed.pop(t.next_in)
            t.next_in += 1
        self.kick()

    def kick(self) -> None:
        if not self.busy:
            self._start_step()

    def _start_step(self) -> None:
        chunk = self.costs.chunk_tokens
        budget = chunk
        pieces: list[tuple[StageTask, int]] = []
        tokens = pairs = 0
        for t in self.queue:
            if not t.ready:
                continue
            k = min(t.left, t.arrived - t.pos)
            if t.ends:
                k = min(k, t.ends[0] - t.pos)
            if k <= 0:
                continue
            if chunk > 0:
                k = min(k, budget)
            pieces.append((t, k))
            tokens += k
            pairs += prefill_pairs(k, t.pos)
            if not t.started:
                t.started = True
                self._on_started(self, t)
            if chunk <= 0:
                break
            budget -= k
            if budget <= 0:
                break
        if not pieces:
            return
        c = self.costs.step
        dt = c.base_s + c.token_s * tokens + c.pair_s * pairs
        if self.host is not None:
            dt *= self.host.start(self.node_id, self.threads)
        self.busy = True
        self.busy_s += dt
        self.events.at(self.events.now + dt, self._end_step, pieces)

    def _end_step(self, pieces: list[tuple[StageTask, int]]) -> None:
        if self.host is not None:
            self.host.stop(self.node_id)
        self.version += 1
        for t, k in pieces:
            t.pos += k
            t.left -= k
            if t.ends and t.pos >= t.ends[0]:
                t.ends.popleft()
            if t.left == 0:
                self.queue.remove(t)
                self.num_prefilled += 1
                r = t.run.request
                self.cache.insert(t.keys[: r.num_prompt_tokens // self.block_tokens])
            self._on_computed(self, t, k)
        self.busy = False
        self._start_step()

    # -- what gossip spreads ------------------------------------------------------

    def state_key(self) -> tuple[int, int]:
        return self.version, 0

    def work(self) -> NodeWork:
        return NodeWork(prefill=[PrefillWork(t.left, t.pos) for t in self.queue])

    def queue_s(self) -> float:
        """The wait of a prompt queued now, as the node itself prices it (late binding)."""
        return queue_s(self.costs, self.work())

    def gossiped(self, now: float, *, forecast: bool = True) -> tuple[NodeLoad, DecodeForecast]:
        return gossiped_load(
            self.costs, self.work(), self.lengths, self.departures, now, forecast=forecast
        )


class PipelineGroup:
    """A group's stages, head first, and the requests they run together."""

    def __init__(
        self,
        stages: list[tuple[str, NodeSpec, StageInfo]],
        events: EventQueue,
        network: Network,
        *,
        block_tokens: int,
        rtt_s: float,
        on_prefilled: Callable[[SimRequest], None],
        on_kv_in: Callable[[SimRequest], None],
        host: SharedHost | None = None,
        threads: int = 1,
    ) -> None:
        self.stages = [
            StageNode(
                node_id,
                spec,
                info,
                events,
                block_tokens=block_tokens,
                on_started=self._started,
                on_computed=self._computed,
                host=host,
                threads=threads,
            )
            for node_id, spec, info in stages
        ]
        self.head = self.stages[0]
        self.events = events
        self.network = network
        self.block_tokens = block_tokens
        self.rtt_s = rtt_s
        self._on_prefilled = on_prefilled
        self._on_kv_in = on_kv_in

    def start(self, r: SimRequest) -> None:
        """The group takes ``r``: it opens its stages and queues a part on each."""
        bs = self.block_tokens
        # The last prompt token is always computed: its logits give the first token.
        usable = (r.num_prompt_tokens - 1) // bs
        full = r.hashes[: r.num_prompt_tokens // bs]
        keys = [layer_hashes(full, s.info.layer_lo, s.info.layer_hi) for s in self.stages]
        start = min(s.cache.prefix(k, usable)[0] for s, k in zip(self.stages, keys, strict=True))
        cached = start * bs
        new = r.num_prompt_tokens - cached
        r.prefill_node = self.head.node_id
        r.stages = tuple(s.node_id for s in self.stages)
        r.local_cached_tokens = r.pos = cached
        run = PipelineRun(r)
        if r.num_output_tokens <= 1:
            r.kv_in = True
        else:
            run.kv_left = len(self.stages)
        chunks = equal_time_chunks(
            self.head.costs.step, new, cached, self.head.info.chunk_tokens, align=bs
        )
        last = len(self.stages) - 1
        for i, (stage, k) in enumerate(zip(self.stages, keys, strict=True)):
            _, on_ssd = stage.cache.prefix(k, start)
            stage.cache.use(k[:start])
            r.ssd_tokens = max(r.ssd_tokens, on_ssd * bs)
            t = StageTask(run, i, k, cached, new, r.num_prompt_tokens if i == 0 else cached)
            if i == 0:
                t.ends.extend(list(accumulate(chunks, initial=cached))[1:])
            run.tasks.append(t)
            # Open once the stages after it are (the head last), then with
            # its cached blocks read back from SSD.
            ssd_s = on_ssd * bs * stage.costs.kv_bytes_per_token / stage.spec.ssd_bps
            delay = (last - i) * self.rtt_s + ssd_s
            if delay > 0:
                self.events.at(self.events.now + delay, stage.make_ready, t)
            else:
                t.ready = True
        for stage, t in zip(self.stages, run.tasks, strict=True):
            stage.enqueue(t)

    def _started(self, stage: StageNode, t: StageTask) -> None:
        r = t.run.request
        if r.kv_in:
            return
        # This stage's layers of the prompt's KV stream to the decode node as computed.
        nbytes = r.num_prompt_tokens * stage.costs.kv_bytes_per_token
        self.network.start(stage.node_id, r.decode_node or "", nbytes, self._kv_done(t.run), "kv")

    def _kv_done(self, run: PipelineRun) -> Callable[[Flow], None]:
        def done(_flow: Flow) -> None:
            run.kv_left -= 1
            if run.kv_left == 0:
                self._on_kv_in(run.request)

        return done

    def _computed(self, stage: StageNode, t: StageTask, k: int) -> None:
        if t.index == len(self.stages) - 1:
            if t.left == 0:
                r = t.run.request
                r.first_token_s = self.events.now
                self._on_prefilled(r)
            return
        nxt = self.stages[t.index + 1]
        landed = (nxt, t.run.tasks[t.index + 1], t.next_out, t.pos)
        t.next_out += 1

        def written(_flow: Flow, landed: tuple[StageNode, StageTask, int, int] = landed) -> None:
            # Its notice follows the write: a round trip, as group_score prices a hop.
            self.events.at(self.events.now + self.rtt_s, self._land, landed)

        nbytes = k * stage.info.act_bytes_per_token
        self.network.start(stage.node_id, nxt.node_id, nbytes, written, "act")

    def _land(self, arg: tuple[StageNode, StageTask, int, int]) -> None:
        node, t, seq, end = arg
        node.land(t, seq, end)
