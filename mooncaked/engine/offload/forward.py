"""A forward pass whose decode attention runs on a memory node.

The step's decode sequences form one or two remote parts (micro-batches);
its prefill chunks, if any, one local part (prefill attention is compute-
bound: it stays). Per layer, a part computes its norm, q/k/v and RoPE here,
writes its new K/V into the local cache (the mirror that lets a step finish
here when the memory node fails), sends q/k/v, and later takes the output
back for o_proj and the MLP. The parts are staggered:

    pre(A, 0); pre(B, 0)
    for each layer i:  post(A, i); pre(A, i+1); post(B, i); pre(B, i+1)

so while the memory node attends A's layer i+1, this node runs B's layer i
after attention and its layer i+1 before it: with two parts, remote
attention overlaps local compute (Lamina's staggered pipelining); with
one part, every layer waits a full round trip.

A part's first layer-0 reply tells whether the memory node holds what the
step needs; a failure anywhere makes the rest of the step local: the
outputs are the same numbers either way.
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
from mooncaked.engine.offload.client import AttentionClient
from mooncaked.engine.offload.wire import OffloadError, StepSeq
from mooncaked.engine.plan import StepPlan
from mooncaked.request import Request

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class _Part:
    rows: torch.Tensor
    x: torch.Tensor
    rope: Rope
    meta: AttentionMetadata
    # None: attention here.
    seqs: list[StepSeq] | None
    conn: int = 0
    # q, k, v of the layer in flight.
    pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    sent: bool = False


@dataclass(slots=True)
class OffloadedRun:
    """A step's parts and how the attention went, for the caller's counters."""

    num_remote_parts: int
    fell_back: bool


class OffloadedAttention:
    """The runner's hook: ``forward`` runs a step with remote decode attention,
    or returns None when it does not apply (no decodes, the node is down)."""

    def __init__(self, client: AttentionClient, micro_batches: int) -> None:
        self.client = client
        self.micro_batches = micro_batches
        self.last: OffloadedRun | None = None

    def finished(self, request: Request) -> None:
        """A request ended: its KV on the memory node goes with the next step."""
        self.client.drop(request.request_id)

    def close(self) -> None:
        self.client.close()

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
        decodes = [i for i, c in enumerate(plan.chunks) if c.num_tokens == 1]
        if not decodes or not self.client.available():
            return None
        prefills = [i for i, c in enumerate(plan.chunks) if c.num_tokens > 1]
        n = min(self.micro_batches, len(decodes))
        size = -(-len(decodes) // n)
        groups = [decodes[lo : lo + size] for lo in range(0, len(decodes), size)]
        device, dtype = kv_buffer.device, kv_buffer.dtype
        starts = _row_starts(plan)
        parts = [
            _part(model, plan, g, starts, backend, block_size, device, dtype, remote=True, conn=j)
            for j, g in enumerate(groups)
        ]
        if prefills:
            parts.append(
                _part(
                    model, plan, prefills, starts, backend, block_size, device, dtype, remote=False
                )
            )

        def source(key: str, num_tokens: int) -> torch.Tensor:
            chunk = next(c for c in plan.chunks if c.request_id == key)
            return _gather_kv(kv_buffer, chunk.block_ids, num_tokens, block_size)

        fell_back = False
        for p in parts:
            if p.seqs is not None:
                try:
                    self.client.begin(p.conn, p.seqs, source)
                except OffloadError as exc:
                    fell_back = self._fail(parts, str(exc))
        layers = list(zip(model.model.layers, kv_caches, strict=True))
        for p in parts:
            fell_back |= self._pre(p, 0, layers[0])
        for i, pair in enumerate(layers):
            if layer_done is not None:
                layer_done(i)
            for p in parts:
                fell_back |= self._post(p, i, pair, parts)
                if i + 1 < len(layers):
                    fell_back |= self._pre(p, i + 1, layers[i + 1])
        if not fell_back:
            for p in parts:
                if p.seqs is not None:
                    self.client.end(p.seqs)
        self.last = OffloadedRun(len(groups), fell_back)
        norm = model.model.norm
        out = torch.empty(
            (plan.num_tokens, parts[0].x.shape[1]), dtype=parts[0].x.dtype, device=device
        )
        for p in parts:
            out.index_copy_(0, p.rows, norm(p.x) if norm is not None else p.x)
        return out

    def _fail(self, parts: list[_Part], reason: str) -> bool:
        self.client.fail(reason)
        self.client.stats.local_fallbacks += 1
        for p in parts:
            p.seqs = None
            p.sent = False
        return True

    def _pre(self, p: _Part, i: int, pair: tuple[torch.nn.Module, KVCache]) -> bool:
        layer, (k_cache, v_cache) = pair
        attn = layer.self_attn
        q, k, v = attn.project_qkv(layer.input_layernorm(p.x), p.rope)
        write_kv(k, v, k_cache, v_cache, p.meta.slot_mapping)
        p.pending, p.sent = (q, k, v), False
        if p.seqs is None:
            return False
        try:
            self.client.send_layer(p.conn, i, q, k, v)
        except OffloadError as exc:
            return self._fail([p], str(exc))
        p.sent = True
        return False

    def _post(
        self, p: _Part, i: int, pair: tuple[torch.nn.Module, KVCache], parts: list[_Part]
    ) -> bool:
        layer, (k_cache, v_cache) = pair
        if p.pending is None:
            raise RuntimeError(f"layer {i}: no q/k/v in flight")
        q, k, v = p.pending
        out: torch.Tensor | None = None
        failed = False
        if p.sent and p.seqs is not None:
            try:
                out = self.client.recv_layer(p.conn, i, q.shape[0])
            except OffloadError as exc:
                # Every part's stream is now out of step: all go local.
                failed = self._fail(parts, str(exc))
        if out is None:
            out = p.meta.backend.attend(q, PagedKV(k, v, k_cache, v_cache), p.meta)  # type: ignore[union-attr]
        x = p.x + layer.self_attn.project_out(out.to(q.dtype))
        p.x = x + layer.mlp(layer.post_attention_layernorm(x))
        p.pending = None
        return failed


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
    conn: int = 0,
) -> _Part:
    chunks = [plan.chunks[i] for i in chunk_ids]
    rows = [r for i in chunk_ids for r in range(starts[i], starts[i + 1])]
    ids = [t for c in chunks for t in c.token_ids]
    positions = [p for c in chunks for p in range(c.start_pos, c.start_pos + c.num_tokens)]
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
    return _Part(torch.tensor(rows, dtype=torch.int64, device=device), x, rope, meta, seqs, conn)


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
