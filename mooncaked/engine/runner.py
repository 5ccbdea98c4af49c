"""The model runner: a step plan in, one sampled token per sampling chunk out.

``execute`` turns the plan's chunks into flat tensors (ids, positions, cache
slots, attention metadata), runs one forward pass over every chunk of the step
(prefill chunks and decodes mixed), computes logits only at the positions that
sample, and samples each with its request's settings. It runs synchronously
under ``torch.inference_mode``; the engine calls it from a worker thread. The
plan is plain data; the runner never sees a live request.

With a KV connector (``run``), its worker side runs inside the step:
``save_layer`` after each layer's forward, ``wait_for_save`` before the
results return; what it reports of the step comes back with the tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import structlog
import torch

from mooncaked.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    build_metadata,
    select_backend,
)
from mooncaked.engine.connector import KVConnector
from mooncaked.engine.graphs import CUDA_GRAPH_MODES, DecodeGraphs, graph_unavailable_reason
from mooncaked.engine.loader import LoadedModel
from mooncaked.engine.model import ModelArch
from mooncaked.engine.offload.forward import OffloadedAttention
from mooncaked.engine.plan import SampledToken, ScheduledChunk, StepOutput, StepPlan
from mooncaked.engine.sampler import Sampler
from mooncaked.handoff import KVLayout

log = structlog.get_logger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]
# (nbytes, device) -> zeroed uint8 tensor of that many bytes on that device.
KVAllocator = Callable[[int, torch.device], torch.Tensor]


def kv_bytes_per_block(
    arch: ModelArch, block_size: int, dtype: torch.dtype, num_layers: int | None = None
) -> int:
    """Bytes of one block across every layer (or ``num_layers`` of them: a
    pipeline stage's), K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    layers = arch.num_layers if num_layers is None else num_layers
    return 2 * layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def num_blocks_for_bytes(
    arch: ModelArch,
    block_size: int,
    dtype: torch.dtype,
    nbytes: int,
    num_layers: int | None = None,
) -> int:
    return max(0, nbytes // kv_bytes_per_block(arch, block_size, dtype, num_layers))


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        backend: str | AttentionBackend = "auto",
        sampler: Sampler | None = None,
        kv_allocator: KVAllocator | None = None,
        cuda_graphs: str = "auto",
        max_graph_batch: int = 64,
        decodes: bool = True,
        vllm_cpu_library: str = "",
    ) -> None:
        """``kv_allocator(nbytes, device)`` gives the zeroed memory of the whole KV cache as
        a uint8 tensor on the model's device (shared memory a transfer engine
        exposes, so peers can write KV into it); default: a plain allocation.

        ``cuda_graphs``: "auto" captures the decode step (batches up to
        ``max_graph_batch``) wherever it can be (engine/graphs.py) and runs
        eagerly where capture fails; "on" makes either a ValueError; "off"
        never captures. ``decodes``: False for a prefill-only node, which
        "auto" captures nothing for (its steps are never all decodes)."""
        if cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(
                f"model.cuda_graphs = {cuda_graphs!r}; use one of {list(CUDA_GRAPH_MODES)}"
            )
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.loaded = loaded
        self.model = loaded.model
        self.arch = loaded.arch
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = loaded.max_model_len
        self.backend: AttentionBackend = (
            backend
            if isinstance(backend, AttentionBackend)
            else self.select_backend(backend, loaded, block_size, vllm_cpu_library)
        )
        # A pipeline stage holds the KV of its own layers only.
        self.span = self.model.span
        self.kv_layout, self.kv_buffer = self._allocate_kv(kv_allocator)
        self.kv_caches: list[KVCache] = [
            (self.kv_buffer[i, 0], self.kv_buffer[i, 1]) for i in range(self.span.count)
        ]
        self.backend.bind(self.kv_caches)
        # A stage after the first: the rows its input activations arrive in
        # ([rows, hidden], the pipeline's inbound segment), once bound.
        self.act_in: torch.Tensor | None = None
        # Attention offloading: decode attention on a memory node (None: here).
        self.offload: OffloadedAttention | None = None
        self.sampler = sampler if sampler is not None else Sampler()
        self.graphs: DecodeGraphs | None = None
        # Why the decode step runs eagerly ("" when it is graphed).
        self.graphs_off_reason = "model.cuda_graphs = off"
        if cuda_graphs == "auto" and not decodes:
            self.graphs_off_reason = "a prefill-only node does not decode"
        elif cuda_graphs != "off":
            self._capture_decode(cuda_graphs, max_graph_batch)

    @staticmethod
    def select_backend(
        requested: str, loaded: LoadedModel, block_size: int, vllm_cpu_library: str = ""
    ) -> AttentionBackend:
        """``model.attention_backend`` for this model (``attention.select_backend``):
        the engine picks it before sizing the cache (a backend may need two)."""
        arch = loaded.arch
        return select_backend(
            requested,
            device=loaded.device,
            dtype=loaded.dtype,
            block_size=block_size,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            vllm_cpu_library=vllm_cpu_library,
        )

    def _allocate_kv(self, kv_allocator: KVAllocator | None) -> tuple[KVLayout, torch.Tensor]:
        """One buffer [layers, K|V, blocks, block_size, kv_heads, head_dim]: per
        layer, K and V are contiguous views in flash-attn's paged layout, and
        the whole cache is one region a peer can address."""
        arch, num_layers = self.arch, self.span.count
        layout = KVLayout(
            num_layers=num_layers,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            row_bytes=arch.num_kv_heads
            * arch.head_dim
            * torch.empty((), dtype=self.dtype).element_size(),
        )
        shape = (
            num_layers, 2, self.num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim,
        )  # fmt: skip
        if kv_allocator is None:
            return layout, torch.zeros(shape, dtype=self.dtype, device=self.device)
        raw = kv_allocator(layout.total_bytes, self.device)
        if raw.dtype != torch.uint8 or raw.numel() != layout.total_bytes:
            raise ValueError(
                f"kv_allocator gave {raw.dtype} x {raw.numel()}, need uint8 x {layout.total_bytes}"
            )
        return layout, raw.view(self.dtype).view(shape)

    def _capture_decode(self, mode: str, max_batch: int) -> None:
        reason = graph_unavailable_reason(self.device, self.backend)
        if reason is not None:
            if mode == "on":
                raise ValueError(f"model.cuda_graphs = 'on': {reason}")
            self.graphs_off_reason = reason
            return
        try:
            self.graphs = DecodeGraphs(
                self._decode_forward,
                backend=self.backend,
                device=self.device,
                block_size=self.block_size,
                max_model_len=self.max_model_len,
                max_batch=max_batch,
            )
        except RuntimeError as exc:
            if mode == "on":
                raise ValueError(f"model.cuda_graphs = 'on': capture failed: {exc}") from exc
            # A kernel that cannot be captured costs speed, not service.
            self.graphs_off_reason = f"capture failed: {exc}"
            log.warning("cuda graph capture failed; decoding eagerly", error=str(exc))
            return
        self.graphs_off_reason = ""

    def _decode_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta)

    @property
    def block_bytes(self) -> int:
        return kv_bytes_per_block(self.arch, self.block_size, self.dtype, self.span.count)

    def execute(self, plan: StepPlan) -> list[SampledToken | None]:
        """One entry per chunk, in plan order: a token where ``chunk.sample``."""
        return self.run(plan).tokens

    def run(self, plan: StepPlan, connector: KVConnector | None = None) -> StepOutput:
        """The step's tokens, the connector's report of it, and (attention
        offloading) which requests' KV moved to the memory node or was lost."""
        if plan.is_empty:
            return StepOutput([])
        out = self._run(plan, connector)
        offload = self.offload
        if offload is None or offload.last is None:
            return out
        run, offload.last = offload.last, None
        return dataclasses.replace(out, kv_moved=run.moved, kv_lost=run.lost)

    def _run(self, plan: StepPlan, connector: KVConnector | None) -> StepOutput:
        meta = plan.connector_meta if connector is not None else None
        if connector is None or meta is None:
            with torch.inference_mode():
                hidden, sample_rows = self._forward(plan)
                return self._output(plan, hidden, sample_rows)

        def layer_done(layer: int) -> None:
            connector.save_layer(layer, meta)

        with torch.inference_mode():
            try:
                hidden, sample_rows = self._forward(plan, layer_done)
                out = self._output(plan, hidden, sample_rows)
            finally:
                # Even when the forward failed: its sends must be out of the
                # device blocks before they are handed to anyone else.
                report = connector.wait_for_save(meta)
        return StepOutput(out.tokens, report, out.hidden)

    def _output(self, plan: StepPlan, hidden: torch.Tensor, sample_rows: list[int]) -> StepOutput:
        if not self.span.last:
            # A stage before the last samples nothing: its output is the
            # residual stream the next stage continues from.
            return StepOutput([None] * len(plan.chunks), hidden=hidden)
        return StepOutput(self._sample(plan, hidden, sample_rows))

    def _sample(
        self, plan: StepPlan, hidden: torch.Tensor, sample_rows: list[int]
    ) -> list[SampledToken | None]:
        results: list[SampledToken | None] = [None] * len(plan.chunks)
        sampling = [i for i, c in enumerate(plan.chunks) if c.sample]
        if not sampling:
            return results
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        chunks = [plan.chunks[i] for i in sampling]
        tokens = self.sampler.sample(
            logits, [c.sampling for c in chunks], [c.num_output_tokens for c in chunks]
        )
        for i, tok in zip(sampling, tokens, strict=True):
            results[i] = tok
        return results

    def forward_logits(self, plan: StepPlan) -> list[torch.Tensor]:
        """Logits [num_tokens, vocab] of every computed position, one tensor per chunk.

        Writes the chunks' K/V like ``execute``; samples nothing. For parity tests.
        """
        if plan.is_empty:
            return []
        with torch.inference_mode():
            hidden, _ = self._forward(plan)
            logits = self.model.compute_logits(hidden).float()
            out: list[torch.Tensor] = []
            lo = 0
            for c in plan.chunks:
                out.append(logits[lo : lo + c.num_tokens].clone())
                lo += c.num_tokens
            return out

    def _forward(
        self, plan: StepPlan, layer_done: Callable[[int], None] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Hidden states of every token of the plan, and the row of each sampled chunk."""
        ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        starts: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        act_rows: list[int] = []
        for i, c in enumerate(plan.chunks):
            n = c.num_tokens
            self._check_chunk(i, c)
            end = c.start_pos + n
            if c.act_rows is not None:
                if len(c.act_rows) != n:
                    raise ValueError(f"chunk {i} ({c.request_id}) has {len(c.act_rows)} input rows")
                act_rows.extend(c.act_rows)
            ids.extend(c.token_ids)
            positions.extend(range(c.start_pos, end))
            query_lens.append(n)
            starts.append(c.start_pos)
            tables.append(c.block_ids)
            if c.sample:
                sample_rows.append(len(ids) - 1)
        if self.offload is not None and self.span.whole:
            hidden = self.offload.forward(
                self.model, plan, self.kv_caches, self.kv_buffer, self.backend,
                self.block_size, layer_done,
            )  # fmt: skip
            if hidden is not None:
                return hidden, sample_rows
        graphs = self.graphs
        if (
            graphs is not None
            and layer_done is None
            and len(ids) == len(query_lens) <= graphs.max_batch
        ):
            # Decodes only, and no connector work between layers: replay.
            return graphs.run(ids, starts, tables), sample_rows
        meta = build_metadata(
            query_lens=query_lens,
            start_positions=starts,
            block_tables=tables,
            block_size=self.block_size,
            device=self.device,
            backend=self.backend,
            dtype=self.dtype,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True)
        hidden_in = None
        if act_rows:
            if self.act_in is None:
                raise RuntimeError("a stage's input rows are not bound")
            rows = torch.tensor(act_rows, dtype=torch.int64)
            hidden_in = self.act_in.index_select(0, rows).to(self.device, non_blocking=True)
        hidden = self.model(input_ids, pos, self.kv_caches, meta, layer_done, hidden=hidden_in)
        self.backend.step_done(meta)
        return hidden, sample_rows

    def _check_chunk(self, i: int, c: ScheduledChunk) -> None:
        """ValueError naming what is wrong with chunk ``i`` of a plan."""
        n = c.num_tokens
        if n == 0:
            raise ValueError(f"chunk {i} ({c.request_id}) has no tokens")
        end = c.start_pos + n
        if c.start_pos < 0 or end > self.max_model_len:
            raise ValueError(
                f"chunk {i} ({c.request_id}) covers positions "
                f"{c.start_pos}..{end - 1}, beyond max_model_len {self.max_model_len}"
            )
        bad = [b for b in c.block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(
                f"chunk {i} ({c.request_id}) has block ids {bad[:4]} outside "
                f"0..{self.num_blocks - 1}"
            )
        if (c.act_rows is None) != self.span.first:
            raise ValueError(
                f"chunk {i} ({c.request_id}): layers {self.span.lo}..{self.span.hi} take "
                + ("token ids" if self.span.first else "the stage before's activations")
            )

    def copy_blocks(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Copy whole blocks, every layer, K and V: ``dst_ids[i] <- src_ids[i]``."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(
                f"copy_blocks needs equal lists, got {len(src_ids)} and {len(dst_ids)}"
            )
        if not src_ids:
            return
        bad = [b for b in (*src_ids, *dst_ids) if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:4]} outside 0..{self.num_blocks - 1}")
        src = torch.tensor(list(src_ids), dtype=torch.int64, device=self.device)
        dst = torch.tensor(list(dst_ids), dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            for k_cache, v_cache in self.kv_caches:
                k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
                v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
