"""A forward pass whose decode attention runs on memory nodes.

The step's decodes go to the memory node each names (``offload.memory_node``,
or the one placement chose for its request), split per memory node into one
or two remote parts (micro-batches), each on a connection of its own; the
decodes that name none and the prefill chunks, if any, form one local part
(prefill attention is compute-bound: it stays, into local blocks; the KV
moves to the memory node with the sequence's first decode, and the engine
frees the blocks then). Per layer, a part computes its norm, q/k/v and RoPE
here; a local part writes its K/V into the local cache and attends here, a
remote part sends q/k/v (the memory node writes the K/V into its own
blocks: there is no local copy) and later takes the output back for o_proj
and the MLP. The parts are staggered:

    pre(A, 0); pre(B, 0)
    for each layer i:  post(A, i); pre(A, i+1); post(B, i); pre(B, i+1)

so while a memory node attends A's layer i+1, this node runs B's layer i
after attention and its layer i+1 before it: with two parts, remote
attention overlaps local compute (Lamina's staggered pipelining); with
one part, every layer waits a full round trip.

A failure of a memory node ends its parts' work for the step: their
sequences, and every other that memory node held, are reported lost (the
engine recomputes them), and their rows of this step are void. The other
memory nodes' parts and the local part finish as if nothing happened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mooncaked.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    PagedKV,
    build_metadata,
    write_kv,
)
from mooncaked.engine.model import CausalLM, Rope
from mooncaked.engine.offload.client import AttentionClient, ClientStats, memory_node_for
from mooncaked.engine.offload.clients import ClientPool
from mooncaked.engine.offload.direct import DirectHandoff
from mooncaked.engine.offload.wire import OffloadError, StepSeq
from mooncaked.engine.plan import ScheduledChunk, StepPlan

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class _Part:
    rows: torch.Tensor
    x: torch.Tensor
    rope: Rope
    # Local attention's metadata (None: a remote part, it has none here).
    meta: AttentionMetadata | None
    # None: attention here.
    seqs: list[StepSeq] | None
    # A remote part's memory node, and its connection there.
    client: AttentionClient | None = None
    conn: int = 0
    # q, k, v of the layer in flight.
    pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # A remote part whose memory node failed: nothing more is computed of it.
    failed: bool = False


@dataclass(frozen=True, slots=True)
class _Group:
    """Chunks (indices into the plan) whose attention goes to one memory
    node over one connection; ``stranded``: the node is down and their KV
    was there only (the step cannot compute them)."""

    client: AttentionClient
    chunk_ids: list[int]
    conn: int = 0
    stranded: bool = False


@dataclass(frozen=True, slots=True)
class OffloadedRun:
    """What a step did to where KV lives, for the scheduler (plain data)."""

    num_remote_parts: int
    # Requests whose KV a memory node holds after this step.
    moved: tuple[str, ...]
    # Requests whose KV was lost with a memory node (their step is void).
    lost: tuple[str, ...]


class OffloadedAttention:
    """The runner's hook: ``forward`` runs a step with remote decode attention,
    or returns None when it does not apply (no decode names a memory node;
    the memory nodes named are down and every decode's KV is still here).

    ``configured``: ``offload.memory_node`` ("auto": each request's own)."""

    def __init__(self, clients: ClientPool, micro_batches: int, configured: str = "") -> None:
        self.clients = clients
        self.micro_batches = micro_batches
        self.configured = configured
        # The last step's report, until the runner takes it.
        self.last: OffloadedRun | None = None
        self._lost: list[str] = []
        # Prompts a prefill node writes into the memory node (None: uploads only).
        self.direct: DirectHandoff | None = None

    @property
    def stats(self) -> ClientStats:
        return self.clients.stats

    def address_for(self, placed: str) -> str:
        """Where a request's decode attention goes ("": here)."""
        return memory_node_for(placed or None, self.configured)

    def dropped(self, request_id: str) -> None:
        """A request's KV on a memory node is no longer needed (finished,
        preempted): it is freed with the next step, or by ``flush``."""
        self.clients.dropped(request_id)

    def flush(self) -> None:
        """Free what finished requests held on memory nodes; step thread only."""
        self.clients.flush()

    def close(self) -> None:
        self.clients.close()

    def forward(
        self,
        model: CausalLM,
        plan: StepPlan,
        kv_caches: list[KVCache],
        kv_buffer: torch.Tensor,
        backend: AttentionBackend,
        block_size: int,
        layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor | None:
        self.last = None
        chunks = plan.chunks
        by_node = self._by_memory_node(chunks)
        groups = self._groups(chunks, by_node)
        if not groups:
            self.clients.prune(by_node)
            return None
        remote = {i for g in groups for i in g.chunk_ids}
        local = [i for i in range(len(chunks)) if i not in remote]
        device, dtype = kv_buffer.device, kv_buffer.dtype
        starts = _row_starts(plan)
        parts = [
            _part(model, plan, g.chunk_ids, starts, backend, block_size, device, dtype,
                  remote=True, client=g.client, conn=g.conn)
            for g in groups
        ]  # fmt: skip
        if local:
            parts.append(
                _part(model, plan, local, starts, backend, block_size, device, dtype, remote=False)
            )
        self._lost = []
        for p, g in zip(parts, groups, strict=False):
            if g.stranded:
                # Defensive: KV on a node that is down is KV lost.
                self._stop(p)
        self._begin(parts, chunks, kv_buffer, block_size)
        layers = list(zip(model.model.layers, kv_caches, strict=True))
        for p in parts:
            self._pre(p, 0, layers[0], parts)
        for i, pair in enumerate(layers):
            if layer_done is not None:
                layer_done(i)
            for p in parts:
                self._post(p, i, pair, parts)
                if i + 1 < len(layers):
                    self._pre(p, i + 1, layers[i + 1], parts)
        moved: list[str] = []
        for p in parts:
            if p.seqs is not None and p.client is not None and not p.failed:
                p.client.end(p.seqs)
                moved.extend(s.key for s in p.seqs)
        lost = tuple(dict.fromkeys(self._lost))
        self.stats.lost += len(lost)
        live = sum(not g.stranded for g in groups)
        self.last = OffloadedRun(live, tuple(moved), lost)
        self.clients.prune(by_node)
        norm = model.model.norm
        out = torch.empty(
            (plan.num_tokens, parts[0].x.shape[1]), dtype=parts[0].x.dtype, device=device
        )
        for p in parts:
            out.index_copy_(0, p.rows, norm(p.x) if norm is not None else p.x)
        return out

    def _by_memory_node(self, chunks: list[ScheduledChunk]) -> dict[str, list[int]]:
        """The decodes (indices) by the memory node they attend on. A
        one-token chunk that samples decodes next (a prefill's last token
        included): after this step its KV is on that memory node."""
        by_node: dict[str, list[int]] = {}
        for i, c in enumerate(chunks):
            address = self.address_for(c.memory_node) if c.num_tokens == 1 and c.sample else ""
            if address:
                by_node.setdefault(address, []).append(i)
        return by_node

    def _groups(self, chunks: list[ScheduledChunk], by_node: dict[str, list[int]]) -> list[_Group]:
        """The remote parts to run: each memory node's decodes in up to
        ``micro_batches`` parts. A memory node that is down takes none: its
        decodes whose KV is still here attend here (with the local part),
        those whose KV was there only are stranded. Empty: nothing remote
        runs, the whole step is local."""
        groups: list[_Group] = []
        for address, ids in by_node.items():
            client = self.clients.get(address)
            if client.available():
                n = min(self.micro_batches, len(ids))
                size = -(-len(ids) // n)
                groups.extend(
                    _Group(client, ids[lo : lo + size], conn=j)
                    for j, lo in enumerate(range(0, len(ids), size))
                )
                continue
            stranded = [i for i in ids if chunks[i].kv_remote]
            if len(stranded) < len(ids):
                self.stats.local_fallbacks += 1
            if stranded:
                groups.append(_Group(client, stranded, stranded=True))
        return groups

    def _begin(
        self, parts: list[_Part], chunks: list[ScheduledChunk], kv_buffer: torch.Tensor, bs: int
    ) -> None:
        by_id = {c.request_id: c for c in chunks}

        def source(key: str, num_tokens: int) -> torch.Tensor | None:
            chunk = by_id[key]
            if chunk.kv_remote or not chunk.block_ids:
                return None
            return _gather_kv(kv_buffer, chunk.block_ids, num_tokens, bs)

        clients = list(dict.fromkeys(p.client for p in parts if p.client is not None))
        for client in clients:
            mine = [p for p in parts if p.client is client and not p.failed]
            if not mine:
                continue
            keys = {s.key for p in mine if p.seqs is not None for s in p.seqs}
            # Told once a memory node, with its first part's step.
            drops = client.take_drops(keys)
            for p in mine:
                if p.seqs is None:
                    continue
                try:
                    client.begin(p.conn, p.seqs, source, drops)
                except OffloadError as exc:
                    self._fail(client, parts, str(exc))
                    break
                drops = []

    def _stop(self, p: _Part) -> None:
        """A remote part computes nothing more; its sequences' step is void."""
        if p.seqs is not None and not p.failed:
            p.failed = True
            p.pending = None
            self._lost.extend(s.key for s in p.seqs)

    def _fail(self, client: AttentionClient, parts: list[_Part], reason: str) -> None:
        """The memory node failed: its parts stop, what it held is lost (the
        other memory nodes' parts go on: their streams are in step)."""
        self._lost.extend(client.fail(reason))
        for p in parts:
            if p.client is client:
                self._stop(p)

    def _pre(
        self, p: _Part, i: int, pair: tuple[torch.nn.Module, KVCache], parts: list[_Part]
    ) -> None:
        if p.failed:
            return
        layer, (k_cache, v_cache) = pair
        q, k, v = layer.self_attn.project_qkv(layer.input_layernorm(p.x), p.rope)
        p.pending = (q, k, v)
        if p.client is None:
            if p.meta is None:
                raise RuntimeError("a local part without attention metadata")
            write_kv(k, v, k_cache, v_cache, p.meta.slot_mapping)
            return
        try:
            p.client.send_layer(p.conn, i, q, k, v)
        except OffloadError as exc:
            self._fail(p.client, parts, str(exc))

    def _post(
        self, p: _Part, i: int, pair: tuple[torch.nn.Module, KVCache], parts: list[_Part]
    ) -> None:
        if p.failed:
            return
        layer, (k_cache, v_cache) = pair
        if p.pending is None:
            raise RuntimeError(f"layer {i}: no q/k/v in flight")
        q, k, v = p.pending
        p.pending = None
        if p.client is not None:
            try:
                out = p.client.recv_layer(p.conn, i, q.shape[0])
            except OffloadError as exc:
                # That memory node's streams are out of step: its parts stop.
                self._fail(p.client, parts, str(exc))
                return
        else:
            meta = p.meta
            if meta is None or meta.backend is None:
                raise RuntimeError("a local part without attention metadata")
            out = meta.backend.attend(q, PagedKV(k, v, k_cache, v_cache), meta)
        x = p.x + layer.self_attn.project_out(out.to(q.dtype))
        p.x = x + layer.mlp(layer.post_attention_layernorm(x))


def _row_starts(plan: StepPlan) -> list[int]:
    starts = [0]
    for c in plan.chunks:
        starts.append(starts[-1] + c.num_tokens)
    return starts


def _part(
    model: CausalLM,
    plan: StepPlan,
    chunk_ids: list[int],
    starts: list[int],
    backend: AttentionBackend,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    *,
    remote: bool,
    client: AttentionClient | None = None,
    conn: int = 0,
) -> _Part:
    chunks = [plan.chunks[i] for i in chunk_ids]
    rows = [r for i in chunk_ids for r in range(starts[i], starts[i + 1])]
    ids = [t for c in chunks for t in c.token_ids]
    positions = [p for c in chunks for p in range(c.start_pos, c.start_pos + c.num_tokens)]
    meta = None
    if not remote:
        meta = build_metadata(
            query_lens=[c.num_tokens for c in chunks],
            start_positions=[c.start_pos for c in chunks],
            block_tables=[c.block_ids for c in chunks],
            block_size=block_size,
            device=device,
            backend=backend,
            dtype=dtype,
        )
    embed = model.model.embed_tokens
    if embed is None:
        raise RuntimeError("attention offloading runs whole models only")
    x = embed(torch.tensor(ids, dtype=torch.int64, device=device))
    rope = model.rope(torch.tensor(positions, dtype=torch.int64, device=device), x.dtype)
    seqs = [StepSeq(c.request_id, c.start_pos, c.num_tokens) for c in chunks] if remote else None
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
    return _Part(rows_t, x, rope, meta, seqs, client, conn)


def _gather_kv(
    kv_buffer: torch.Tensor, block_ids: list[int], num_tokens: int, block_size: int
) -> torch.Tensor:
    """The first ``num_tokens`` tokens' K/V of every layer, [layers, 2, n, kvh, d], on the CPU."""
    layers, _, num_blocks, bs, kvh, d = kv_buffer.shape
    slots = torch.tensor(
        [block_ids[p // block_size] * block_size + p % block_size for p in range(num_tokens)],
        dtype=torch.int64,
        device=kv_buffer.device,
    )
    flat = kv_buffer.view(layers, 2, num_blocks * bs, kvh, d)
    return flat.index_select(2, slots).cpu()
