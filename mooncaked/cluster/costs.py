"""Cost models: pure functions over numbers a node measures and gossips.

Kept free of I/O and clocks so the Conductor and a simulator can call them
with any view, live or simulated.

One linear model prices an engine step, whatever it mixes (chunked prefill
and decode share steps)::

    step_s = base + token * prefill_tokens + attn * prefill_pairs
                  + seq * decode_seqs + ctx * decode_context_tokens

``prefill_pairs`` counts the (query, key) pairs of the step's prefill
chunks: a chunk of ``k`` tokens after ``p`` already-computed ones attends to
``k * p + k * (k + 1) / 2`` keys, so a long cached prefix makes the rest of a
prompt dearer to compute, and a prompt's cost grows with its square. A
node fits the five coefficients to its own steps (profiled at start-up,
refined online) and publishes them with its KV bytes per token and the
bandwidth it measured pulling KV from each peer (``NodeCosts``). From them:
the time of a prefill (summed over its chunks), of a decode step at a
batch size and context, and of moving a prefix between two nodes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

# Links kept per node in gossip: a datagram must stay under the MTU.
MAX_LINKS = 8


def prefill_pairs(num_tokens: int, start_pos: int) -> int:
    """(query, key) pairs of a prefill chunk of ``num_tokens`` starting at ``start_pos``."""
    return num_tokens * start_pos + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """What an engine step computed: the inputs of the step-time model."""

    prefill_tokens: int = 0
    prefill_pairs: int = 0
    decode_seqs: int = 0
    decode_ctx: int = 0

    def vector(self) -> tuple[float, float, float, float, float]:
        return (
            1.0,
            float(self.prefill_tokens),
            float(self.prefill_pairs),
            float(self.decode_seqs),
            float(self.decode_ctx),
        )


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds per engine step as a linear function of ``StepFeatures``."""

    base_s: float = 0.0
    token_s: float = 0.0
    pair_s: float = 0.0
    seq_s: float = 0.0
    ctx_s: float = 0.0

    @property
    def known(self) -> bool:
        return self.base_s > 0.0 or self.token_s > 0.0 or self.seq_s > 0.0

    def coefficients(self) -> tuple[float, float, float, float, float]:
        return (self.base_s, self.token_s, self.pair_s, self.seq_s, self.ctx_s)

    def step_s(self, f: StepFeatures) -> float:
        return sum(c * x for c, x in zip(self.coefficients(), f.vector(), strict=True))

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` sequences holding ``context_tokens`` in all."""
        if batch <= 0:
            return 0.0
        return self.base_s + self.seq_s * batch + self.ctx_s * context_tokens

    def prefill_s(
        self,
        new_tokens: int,
        cached_tokens: int = 0,
        *,
        chunk_tokens: int = 0,
        decode_seqs: int = 0,
        decode_ctx: int = 0,
    ) -> float:
        """Compute ``new_tokens`` of a prompt after ``cached_tokens`` already in KV.

        Chunked as the scheduler does (``chunk_tokens`` a step, 0: one step),
        each step also carrying ``decode_seqs`` decodes of a colocated engine.
        """
        if new_tokens <= 0:
            return 0.0
        chunk = chunk_tokens - decode_seqs if chunk_tokens > 0 else new_tokens
        chunk = max(1, chunk)
        total = 0.0
        pos, left = cached_tokens, new_tokens
        while left > 0:
            k = min(chunk, left)
            total += self.step_s(StepFeatures(k, prefill_pairs(k, pos), decode_seqs, decode_ctx))
            pos += k
            left -= k
        return total


@dataclass(frozen=True, slots=True)
class NodeCosts:
    """A node's cost model as gossip spreads it (``to_list`` / ``from_list``)."""

    step: StepCost = field(default_factory=StepCost)
    # Bytes of KV (all layers, K and V) one token holds.
    kv_bytes_per_token: int = 0
    # Prompt tokens one step computes at most (the scheduler's token budget).
    chunk_tokens: int = 0
    # Sequences a step runs at most.
    max_batch: int = 0
    # Measured bytes/s pulling KV from a peer: (peer node id, bytes/s), best known first.
    links: tuple[tuple[str, float], ...] = ()

    @property
    def known(self) -> bool:
        return self.step.known

    def prefill_s(
        self, new_tokens: int, cached_tokens: int = 0, *, decode_seqs: int = 0, decode_ctx: int = 0
    ) -> float:
        return self.step.prefill_s(
            new_tokens,
            cached_tokens,
            chunk_tokens=self.chunk_tokens,
            decode_seqs=decode_seqs,
            decode_ctx=decode_ctx,
        )

    def link_bps(self, peer: str) -> float:
        """Bytes/s measured from ``peer`` to this node; else the median of the
        links measured; 0 when nothing was measured."""
        for node, bps in self.links:
            if node == peer:
                return bps
        if not self.links:
            return 0.0
        rates = sorted(bps for _, bps in self.links)
        return rates[len(rates) // 2]

    def to_list(self) -> list[object]:
        return [
            *self.step.coefficients(),
            self.kv_bytes_per_token,
            self.chunk_tokens,
            self.max_batch,
            [[node, bps] for node, bps in self.links[:MAX_LINKS]],
        ]

    def to_json(self) -> dict[str, object]:
        return {
            "step": dataclasses.asdict(self.step),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "chunk_tokens": self.chunk_tokens,
            "max_batch": self.max_batch,
            "links": {node: bps for node, bps in self.links},
        }


def equal_time_chunks(
    step: StepCost,
    new_tokens: int,
    cached_tokens: int,
    first_chunk: int,
    *,
    align: int = 1,
) -> list[int]:
    """Chunk sizes for ``new_tokens`` of a prompt after ``cached_tokens``, each
    taking about as long as the first (``first_chunk`` tokens) on ``step``.

    A chunk's attention grows with the context before it, so equal chunks
    take longer and longer; in a pipeline the slowest chunk sets the pace
    and the last one is the drain every later stage waits for. Solving the
    step model for ``k`` at each position keeps the chunks level (SGLang's
    dynamic chunking, on this node's fitted model). Sizes are multiples of
    ``align`` (a block), never above the first, never below a quarter of
    it: a chunk's fixed costs (a step, a hop between stages) are then paid
    at most four times over.
    """
    if new_tokens <= 0:
        return []
    first = min(first_chunk, new_tokens) if first_chunk > 0 else new_tokens
    align = max(1, align)
    smallest = min(first, max(align, first // 4 // align * align))
    target = step.token_s * first + step.pair_s * prefill_pairs(first, cached_tokens)
    chunks: list[int] = []
    pos, left = cached_tokens, new_tokens
    while left > 0:
        k = first
        if chunks and step.pair_s > 0.0 and target > 0.0:
            # pair/2 k^2 + (token + pair (pos + 1/2)) k = target
            a = step.pair_s / 2.0
            b = step.token_s + step.pair_s * (pos + 0.5)
            k = int((-b + math.sqrt(b * b + 4.0 * a * target)) / (2.0 * a)) // align * align
            k = max(smallest, min(first, k))
        k = min(k, left)
        chunks.append(k)
        pos += k
        left -= k
    return chunks


def pipeline_prefill_s(
    stages: list[StepCost],
    chunks: list[int],
    cached_tokens: int,
    *,
    queue_s: list[float] | None = None,
    hop_s: list[float] | None = None,
) -> float:
    """Seconds until the last stage of a pipelined group finishes a prompt
    cut into ``chunks`` after ``cached_tokens``.

    Stage ``s`` computes chunk ``i`` once it finished chunk ``i - 1`` and
    chunk ``i``'s activations arrived from stage ``s - 1`` (``hop_s[i]``
    after that stage finished it): the pipeline fills, runs at the pace of
    its slowest stage and drains. Each stage's steps are priced by its own
    model (it fits its own layers' steps); ``queue_s[s]`` is when stage
    ``s`` is free to start.
    """
    n = len(stages)
    queues = queue_s if queue_s is not None else [0.0] * n
    hops = hop_s if hop_s is not None else [0.0] * len(chunks)
    ready = [0.0] * len(chunks)
    for s, cost in enumerate(stages):
        free = queues[s]
        pos = cached_tokens
        for i, k in enumerate(chunks):
            arrive = ready[i] + (hops[i] if s > 0 else 0.0)
            free = max(free, arrive) + cost.step_s(StepFeatures(k, prefill_pairs(k, pos)))
            ready[i] = free
            pos += k
    return ready[-1] if chunks else max(queues, default=0.0)


def transfer_s(num_tokens: int, kv_bytes_per_token: int, bps: float, rtt_s: float = 0.0) -> float:
    """Moving ``num_tokens`` of KV over a link of ``bps`` bytes/s (inf if unknown)."""
    if num_tokens <= 0:
        return 0.0
    if bps <= 0.0:
        return math.inf
    return rtt_s + num_tokens * kv_bytes_per_token / bps


def predicted_tbt_s(
    costs: NodeCosts, batch: float, context_tokens: float, *, queued_prefill_tokens: int = 0
) -> float:
    """Time between tokens of a decode step at ``batch`` and ``context_tokens``;
    on a node that also prefills, a step carries a prefill chunk while prompts wait."""
    b = max(1, math.ceil(batch))
    t = costs.step.decode_step_s(b, round(context_tokens))
    if queued_prefill_tokens > 0 and costs.chunk_tokens > 0:
        k = max(1, min(queued_prefill_tokens, costs.chunk_tokens - b))
        t += costs.step.token_s * k + costs.step.pair_s * prefill_pairs(k, 0)
    return t


# -- attention offloading -------------------------------------------------------
#
# A compute node whose decode attention runs on a memory node (which holds the
# KV) keeps only the dense part of its step: reading the weights and each
# sequence's projections (``base + seq * batch``). Per layer, the batch's
# q, k and v go to the memory node, which reads the context's KV for that layer
# and sends the attention output back. Split in micro-batches, one's remote
# attention runs while the compute node computes another's layers (Lamina's
# staggered pipelining); each micro-batch then reads the weights again.


@dataclass(frozen=True, slots=True)
class AttentionTraffic:
    """What offloaded attention moves per decoded token per layer."""

    num_layers: int
    # One token's q, k and v at one layer: (query heads + 2 KV heads) x head
    # dim x bytes per value; sent to the memory node.
    qkv_bytes: int
    # One token's attention output at one layer: query heads x head dim x
    # bytes per value; sent back.
    out_bytes: int


@dataclass(frozen=True, slots=True)
class MemoryLink:
    """A memory node as one compute node sees it."""

    # Bytes/s its attention reads KV at: measured, or a preset's.
    kv_read_bps: float
    # Bytes/s each way between the two nodes: the slower NIC (inf: no limit).
    link_bps: float
    # One round trip a layer: the q/k/v message and the output's.
    rtt_s: float = 0.0
    # What a layer's attention costs the memory node whatever the context
    # (a kernel launch, the synchronisation).
    layer_s: float = 0.0
    # KV it holds for other compute nodes: it reads those too in each layer's
    # round, so they share its bandwidth in proportion.
    other_bytes: float = 0.0


@dataclass(frozen=True, slots=True)
class OffloadedStep:
    """A decode step of a compute node with offloaded attention, term by term."""

    # The compute node's step without attention, for the whole batch at once.
    dense_s: float
    # Per layer: the memory node's attention, and the q/k/v/output round trip.
    attention_s: float
    round_trip_s: float
    # No overlap: the dense step, then every layer's remote trip in turn.
    serial_s: float
    # Micro-batched (staggered pipelining): see ``offloaded_step``.
    overlapped_s: float

    @property
    def tbt_s(self) -> float:
        # The engine micro-batches only where it pays: a micro-batch reads
        # the weights again, which a small remote part does not repay.
        return min(self.serial_s, self.overlapped_s)

    @property
    def overlaps(self) -> bool:
        return self.overlapped_s < self.serial_s


def dense_step_s(step: StepCost, batch: int) -> float:
    """The decode step of ``batch`` sequences without its attention: the fitted
    model less its context term (which is the attention's KV read)."""
    if batch <= 0:
        return 0.0
    return step.base_s + step.seq_s * batch


def remote_attention_s(
    link: MemoryLink, traffic: AttentionTraffic, kv_bytes_per_token: int, context_tokens: float
) -> float:
    """One layer's attention on the memory node: its share of the context's
    KV (and of what it holds for others) read at its bandwidth."""
    if link.kv_read_bps <= 0.0:
        return math.inf
    per_layer = (context_tokens * kv_bytes_per_token + link.other_bytes) / traffic.num_layers
    return link.layer_s + per_layer / link.kv_read_bps


def round_trip_s(link: MemoryLink, traffic: AttentionTraffic, batch: int) -> float:
    """One layer's q/k/v out and attention output back for ``batch`` tokens."""
    if batch <= 0:
        return 0.0
    if link.link_bps <= 0.0:
        return math.inf
    return link.rtt_s + batch * (traffic.qkv_bytes + traffic.out_bytes) / link.link_bps


def _split(batch: int, parts: int) -> list[int]:
    parts = max(1, min(parts, batch))
    return [batch // parts + (1 if i < batch % parts else 0) for i in range(parts)]


def offloaded_step(
    step: StepCost,
    kv_bytes_per_token: int,
    traffic: AttentionTraffic,
    link: MemoryLink,
    batch: int,
    context_tokens: float,
    *,
    micro_batches: int = 2,
) -> OffloadedStep:
    """A decode step of ``batch`` sequences holding ``context_tokens`` whose
    attention runs on the memory node behind ``link``.

    Serial: ``dense(b) + L x (attention(ctx) + round_trip(b))``.

    Overlapped, the batch cut into ``micro_batches`` parts j (dense part
    d_j = dense(b_j) / L a layer, remote part a_j + n_j): each layer, the
    compute node runs every d_j, the memory node every a_j, the link carries
    every transfer, and each micro-batch waits its own d_j + a_j + n_j, so a
    layer takes ``P = max(sum d_j, sum a_j, sum of transfers, max_j (d_j +
    a_j + n_j))``; the step takes ``L x P`` plus one remote trip to drain.
    """
    layers = traffic.num_layers
    if batch <= 0:
        return OffloadedStep(0.0, 0.0, 0.0, 0.0, 0.0)
    dense = dense_step_s(step, batch)
    attn = remote_attention_s(link, traffic, kv_bytes_per_token, context_tokens)
    trip = round_trip_s(link, traffic, batch)
    serial = dense + layers * (attn + trip)
    sizes = _split(batch, micro_batches)
    if len(sizes) < 2:
        return OffloadedStep(dense, attn, trip, serial, serial)
    ds, attns, trips = [], [], []
    for b in sizes:
        share = b / batch
        # Each micro-batch carries its share of the other nodes' reads too.
        part = dataclasses.replace(link, other_bytes=link.other_bytes * share)
        ds.append(dense_step_s(step, b) / layers)
        attns.append(remote_attention_s(part, traffic, kv_bytes_per_token, context_tokens * share))
        trips.append(round_trip_s(link, traffic, b))
    wire = sum(t - link.rtt_s for t in trips)
    cycle = max(d + a + n for d, a, n in zip(ds, attns, trips, strict=True))
    period = max(sum(ds), sum(attns), wire, cycle)
    drain = max(a + n for a, n in zip(attns, trips, strict=True))
    return OffloadedStep(dense, attn, trip, serial, layers * period + drain)


@dataclass(frozen=True, slots=True)
class Offload:
    """How a compute node's attention is offloaded: the traffic its model
    makes, the memory node it goes to, and the micro-batches it is cut into."""

    traffic: AttentionTraffic
    link: MemoryLink
    micro_batches: int = 2


def decode_tbt_s(
    costs: NodeCosts, batch: float, context_tokens: float, offload: Offload | None = None
) -> float:
    """Time between tokens of a decode step: local attention (``offload`` None,
    ``predicted_tbt_s``) or offloaded to a memory node."""
    if offload is None:
        return predicted_tbt_s(costs, batch, context_tokens)
    return offloaded_step(
        costs.step,
        costs.kv_bytes_per_token,
        offload.traffic,
        offload.link,
        max(1, math.ceil(batch)),
        context_tokens,
        micro_batches=offload.micro_batches,
    ).tbt_s
