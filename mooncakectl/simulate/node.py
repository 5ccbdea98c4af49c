"""One simulated node: a prefill queue with chunked prefill, continuous-batching
decode, its block cache, and the load it publishes.

A step is priced by the node's ``StepCost`` on the step's features, as the
real engine's steps are; its contents follow the engine's scheduler: the
running decodes first (up to ``max_batch``), then prompt tokens first come
first served up to the token budget (``chunk_tokens`` less the decodes). A
prefill node only prefills, a decode node only decodes, a ``both`` node
mixes them in one step.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mooncakectl.simulate.cache import BlockCache
from mooncakectl.simulate.costs import NodeSpec
from mooncakectl.simulate.events import EventQueue
from mooncakectl.simulate.host import SharedHost
from mooncaked.cluster.costs import prefill_pairs
from mooncaked.cluster.forecast import (
    DecodeForecast,
    DecodeWork,
    DepartureRate,
    OutputLengths,
    PrefillWork,
)
from mooncaked.cluster.placement import Placement
from mooncaked.cluster.ranking import PrefillScore
from mooncaked.cluster.slo import tbt_s
from mooncaked.cluster.state import NodeLoad
from mooncaked.cluster.work import NodeWork, gossiped_load, queue_s
from mooncaked.engine.late_binding import PrefillWalk

ROLES = ("prefill", "decode", "both")


@dataclass(slots=True, eq=False)
class SimRequest:
    """One trace request and what happened to it (times in simulated seconds)."""

    index: int
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    hashes: tuple[bytes, ...]
    entry: str = ""
    prefill_node: str | None = None
    # A pipelined prefill group's stages it ran on, head first (empty: one node).
    stages: tuple[str, ...] = ()
    decode_node: str | None = None
    reject_code: str | None = None
    # Where its entry placed it (None: rejected), each prefill candidate's
    # figures, and how often a candidate passed it on (late binding).
    placement: Placement | None = None
    scores: dict[str, PrefillScore] = field(default_factory=dict)
    walk: PrefillWalk | None = None
    num_bounces: int = 0
    predicted_ttft_s: float = 0.0
    # The cost model's own forecasts, before the entry's calibration.
    model_ttft_s: float = 0.0
    model_tbt_s: float = 0.0
    # Prompt tokens found in the prefill node's own cache, fetched from a peer, read from SSD.
    local_cached_tokens: int = 0
    fetched_tokens: int = 0
    ssd_tokens: int = 0
    first_token_s: float | None = None
    done_s: float | None = None
    tbt_s: float | None = None
    # Prefill progress: tokens in KV (cached or computed) and left to compute.
    pos: int = 0
    left: int = 0
    # Whether the prefill may start (a fetch or SSD read may be under way).
    ready: bool = True
    started: bool = False
    # Decode: KV arrived at the decode node, and prefill done, both needed to join.
    kv_in: bool = False
    prefilled: bool = False
    join_step: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


class SimNode:
    def __init__(
        self,
        node_id: str,
        role: str,
        spec: NodeSpec,
        events: EventQueue,
        *,
        block_tokens: int,
        on_prefill_start: Callable[[SimNode, SimRequest], None],
        on_prefilled: Callable[[SimNode, SimRequest], None],
        on_done: Callable[[SimNode, SimRequest], None],
        coalesce: bool = True,
        host: SharedHost | None = None,
        threads: int = 1,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"node {node_id}: role must be one of {ROLES}, got {role!r}")
        self.node_id = node_id
        self.role = role
        self.spec = spec
        self.costs = spec.costs
        self.events = events
        self.block_tokens = block_tokens
        block_bytes = block_tokens * max(1, spec.costs.kv_bytes_per_token)
        self.cache = BlockCache(
            int(spec.dram_bytes // block_bytes), int(spec.ssd_bytes // block_bytes)
        )
        self._on_prefill_start = on_prefill_start
        self._on_prefilled = on_prefilled
        self._on_done = on_done
        # The machine this node shares with others (None: its own), and the
        # threads a step of it keeps busy there.
        self.host = host
        self.threads = threads
        # Decode-only steps as one event per run (False: one per step, the
        # reference). On a shared host each step is priced by the sharing at
        # its start, so a run cannot be priced ahead.
        self.coalesce = coalesce and host is None
        self.prefill_queue: deque[SimRequest] = deque()
        self.queued_tokens = 0
        # Decode: placed here and not yet in the batch (KV on its way, or waiting for room).
        # Decodes placed here whose prefill is not done, as the real node's
        # handoffs waiting for their KV.
        self.incoming: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self.running: dict[SimRequest, int] = {}
        self.context_tokens = 0
        # Step number at which each running request produces its last token.
        self._finish_at: dict[int, list[SimRequest]] = {}
        self._finish_steps: list[int] = []
        # The decode run under way: its steps' end times (empty: none).
        self._run_ends: list[float] = []
        self._run_start = 0.0
        self._run_decodes = 0
        self._run_id = 0
        # End time of each step that carried decodes: the token times of every request in it.
        self.step_ends: list[float] = []
        self.lengths = OutputLengths()
        # As a real node: the recent departures stand for the arrivals to come.
        self.departures = DepartureRate()
        self.busy = False
        self.busy_s = 0.0
        # Bumped on every change of what the node would publish.
        self.version = 0
        self.num_prefilled = 0

    # -- prefill ------------------------------------------------------------------

    def enqueue_prefill(self, r: SimRequest) -> None:
        r.left = r.num_prompt_tokens - r.pos
        self.prefill_queue.append(r)
        self.queued_tokens += r.left
        self.version += 1
        self.kick()

    def make_ready(self, r: SimRequest) -> None:
        r.ready = True
        self.kick()

    # -- decode -------------------------------------------------------------------

    def expect_decode(self, r: SimRequest) -> None:
        self.incoming.append(r)
        self.version += 1

    def refuse_decode(self, r: SimRequest) -> None:
        """``r``'s KV is here but the node will not decode it (it was rejected)."""
        self.incoming.remove(r)
        self.version += 1

    def admit_decode(self, r: SimRequest) -> None:
        """``r``'s KV is here and its first token out: it joins the batch when there is room."""
        self.incoming.remove(r)
        self.waiting.append(r)
        self.version += 1
        self.kick()

    def _fits(self, r: SimRequest) -> bool:
        max_batch = self.costs.max_batch
        if max_batch > 0 and len(self.running) >= max_batch:
            return False
        cap = self.spec.kv_capacity_tokens
        need = r.num_prompt_tokens + r.num_output_tokens
        return cap <= 0 or not self.running or self.context_tokens + need <= cap

    # -- steps --------------------------------------------------------------------

    def kick(self) -> None:
        """Something changed: start a step if idle, or end a decode run at its current step."""
        if not self.busy:
            self._start_step()
        elif self._run_ends:
            self._cut_run()

    def _start_step(self) -> None:
        if self.busy:
            raise RuntimeError(f"node {self.node_id} started a step while one was running")
        step_no = len(self.step_ends)
        while self.waiting and self._fits(self.waiting[0]):
            r = self.waiting.popleft()
            r.join_step = step_no
            # The prompt's KV and the first token (produced by the prefill).
            self.running[r] = 0
            self.context_tokens += r.num_prompt_tokens + 1
            last = step_no + r.num_output_tokens - 2
            if last not in self._finish_at:
                self._finish_at[last] = []
                heapq.heappush(self._finish_steps, last)
            self._finish_at[last].append(r)
            self.version += 1
        num_decodes = len(self.running)
        pieces: list[tuple[SimRequest, int]] = []
        tokens = pairs = 0
        # A decode node only holds prompts when no prefill node was alive to take them.
        if self.prefill_queue:
            chunk = self.costs.chunk_tokens
            budget = max(1, chunk - num_decodes) if chunk > 0 else 0
            for r in self.prefill_queue:
                if not r.ready:
                    continue
                k = r.left if budget == 0 else min(budget, r.left)
                pieces.append((r, k))
                tokens += k
                pairs += prefill_pairs(k, r.pos)
                if not r.started:
                    r.started = True
                    self._on_prefill_start(self, r)
                if budget == 0:
                    break
                budget -= k
                if budget <= 0:
                    break
        if not pieces and not num_decodes:
            return
        c = self.costs.step
        if not pieces and self.coalesce:
            self._start_run(num_decodes)
            return
        off = self.spec.offload
        if off is not None and num_decodes:
            # Attention on memory nodes: the decodes' step, plus the prompt's tokens.
            decodes = off.decode_s(num_decodes, self.context_tokens)
            dt = decodes + c.token_s * tokens + c.pair_s * pairs
        else:
            dt = (
                c.base_s
                + c.token_s * tokens
                + c.pair_s * pairs
                + c.seq_s * num_decodes
                + c.ctx_s * self.context_tokens
            )
        if self.host is not None:
            dt *= self.host.start(self.node_id, self.threads)
        self.busy = True
        self.busy_s += dt
        self.events.at(self.events.now + dt, self._end_step, (pieces, num_decodes))

    def _end_step(self, arg: tuple[list[tuple[SimRequest, int]], int]) -> None:
        pieces, num_decodes = arg
        now = self.events.now
        if self.host is not None:
            self.host.stop(self.node_id)
        # Still busy while the callbacks below run: what they admit waits for the next step.
        self.version += 1
        for r, k in pieces:
            r.pos += k
            r.left -= k
            self.queued_tokens -= k
            if r.left == 0:
                self.prefill_queue.remove(r)
                r.first_token_s = now
                self.num_prefilled += 1
                self.cache.insert(r.hashes[: r.num_prompt_tokens // self.block_tokens])
                self._on_prefilled(self, r)
        if num_decodes:
            self.step_ends.append(now)
            self.context_tokens += num_decodes
            self._finish_step(len(self.step_ends) - 1, now)
        self.busy = False
        self._start_step()

    def _finish_step(self, step_no: int, now: float) -> None:
        if self._finish_steps and self._finish_steps[0] == step_no:
            heapq.heappop(self._finish_steps)
            for r in self._finish_at.pop(step_no):
                self._finish(r, now)

    # A run: decode-only steps up to the next request's last token, one event
    # for them all (they differ only by the context, growing a token a
    # request a step). Anything that would change the next step (a decode
    # joining, a prompt to compute) cuts the run at the step under way.

    def _start_run(self, num_decodes: int) -> None:
        step_no = len(self.step_ends)
        num_steps = self._finish_steps[0] - step_no + 1
        c = self.costs.step
        first = c.base_s + c.seq_s * num_decodes + c.ctx_s * self.context_tokens
        growth = c.ctx_s * num_decodes
        t = self.events.now
        ends = []
        off = self.spec.offload
        for j in range(num_steps):
            if off is not None:
                t += off.decode_s(num_decodes, self.context_tokens + num_decodes * j)
            else:
                t += first + growth * j
            ends.append(t)
        self._run_ends = ends
        self._run_start = self.events.now
        self._run_decodes = num_decodes
        self._run_id += 1
        self.busy = True
        self.events.at(ends[-1], self._end_run, self._run_id)

    def state_key(self) -> tuple[int, int]:
        """Changes whenever what the node would gossip may have: its version,
        and the decode steps it has completed, those of a run under way too
        (a run's steps change its context and its forecast as separate
        steps do, though the run ends, and bumps the version, only once)."""
        return self.version, len(self.step_ends) + self._steps_done_in_run()

    def _steps_done_in_run(self) -> int:
        return bisect.bisect_right(self._run_ends, self.events.now) if self._run_ends else 0

    def _cut_run(self) -> None:
        under_way = self._steps_done_in_run()
        if under_way >= len(self._run_ends) - 1:
            return
        del self._run_ends[under_way + 1 :]
        self._run_id += 1
        self.events.at(self._run_ends[-1], self._end_run, self._run_id)

    def _end_run(self, run_id: int) -> None:
        if run_id != self._run_id:
            return
        ends, self._run_ends = self._run_ends, []
        now = self.events.now
        self.version += 1
        self.step_ends.extend(ends)
        self.context_tokens += self._run_decodes * len(ends)
        self.busy_s += now - self._run_start
        self._finish_step(len(self.step_ends) - 1, now)
        self.busy = False
        self._start_step()

    def _finish(self, r: SimRequest, now: float) -> None:
        del self.running[r]
        self.context_tokens -= r.num_prompt_tokens + r.num_output_tokens
        r.done_s = now
        ends = self.step_ends
        first = r.first_token_s if r.first_token_s is not None else now
        gaps = [ends[r.join_step] - first]
        gaps.extend(ends[i] - ends[i - 1] for i in range(r.join_step + 1, len(ends)))
        r.tbt_s = tbt_s(gaps)
        self.lengths.add(r.num_output_tokens)
        self.departures.add(now, r.num_prompt_tokens)
        self._on_done(self, r)

    def finish_without_decode(self, r: SimRequest) -> None:
        """A one-token request: its first token was its last."""
        self.incoming.remove(r)
        self.version += 1
        r.done_s = r.first_token_s
        self.lengths.add(r.num_output_tokens)
        self._on_done(self, r)

    # -- what gossip spreads ------------------------------------------------------

    def work(self) -> NodeWork:
        """The node's work as the real scheduler's ``work()`` gives it: prompts
        left, then decodes running, waiting for room (from now) and still to
        come (from when the placement expected their prefill done)."""
        now = self.events.now
        step_no = len(self.step_ends) + self._steps_done_in_run()
        decode = []
        context = 0
        for r in self.running:
            produced = 1 + step_no - r.join_step
            context += r.num_prompt_tokens + produced
            decode.append(
                DecodeWork(
                    r.num_prompt_tokens + produced,
                    produced,
                    max(0, r.num_output_tokens - produced),
                )
            )
        for r in self.waiting:
            decode.append(DecodeWork(r.num_prompt_tokens, 0, r.num_output_tokens))
        for r in self.incoming:
            ready = r.arrival_s + r.predicted_ttft_s if r.predicted_ttft_s > 0.0 else now
            decode.append(
                DecodeWork(r.num_prompt_tokens, 0, r.num_output_tokens, max(0.0, ready - now))
            )
        cap = self.spec.kv_capacity_tokens
        return NodeWork(
            prefill=[PrefillWork(r.left, r.pos) for r in self.prefill_queue],
            decode=decode,
            running_decode_batch=len(self.running),
            kv_usage=context / cap if cap > 0 else 0.0,
        )

    def queue_s(self) -> float:
        """The wait of a prompt queued now, as the node itself prices it (late binding)."""
        return queue_s(self.costs, self.work())

    def gossiped(self, now: float, *, forecast: bool = True) -> tuple[NodeLoad, DecodeForecast]:
        """What the node publishes, built as the daemon's load meter builds it."""
        return gossiped_load(
            self.costs, self.work(), self.lengths, self.departures, now, forecast=forecast
        )


@dataclass(slots=True)
class NodeStats:
    node_id: str
    role: str
    busy_s: float
    prefills: int
    decode_steps: int
    cached_blocks: int
    evicted_blocks: int
    extra: dict[str, float] = field(default_factory=dict)
