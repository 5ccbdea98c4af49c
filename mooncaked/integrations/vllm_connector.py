"""A vLLM v1 KV connector that keeps vLLM's prompt KV in a mooncaked node.

    --kv-transfer-config '{"kv_connector": "MooncakedConnector",
      "kv_connector_module_path": "mooncaked.integrations.vllm_connector",
      "kv_role": "kv_both",
      "kv_connector_extra_config": {"node_url": "http://127.0.0.1:8000",
                                    "secret_file": "/etc/mooncaked/secret"}}'

Scheduler side: a prompt is hashed into mooncaked's chained block hashes,
seeded with the model id mooncaked computes for the same Hugging Face
directory and precision, so a block either engine computed is found by the
other. The node is asked (a lease) for the blocks past vLLM's own prefix
hit; vLLM loads them asynchronously (the request waits, the step does not).

Worker side: a load reads the leased blocks through the transfer engine
(shared memory on one host, TCP otherwise) into staging rows on the
connector's I/O thread, then scatters them into vLLM's paged cache
(``vllm_layout``); a load that fails is reported so vLLM recomputes those
blocks. After each step the full prompt blocks it computed are gathered into
staging rows and put on the node (its replica inbox, CRC checked).

vLLM's CPU backend drives connectors through the same worker and runner as
its GPU one (``CPUWorker`` and ``CPUModelRunner`` subclass them); the KV
cache per layer is ``[blocks, kv_heads, block_size, 2 * head_dim]``, whose
element placement ``PagedLayout.probe`` learns from vLLM's own cache write.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from mooncaked.cache.layout import BlockLayout
from mooncaked.engine.loader import hf_model_id, precision_tag
from mooncaked.integrations.node_link import LinkError, LoopThread, NodeLink
from mooncaked.integrations.vllm_layout import PagedLayout, RowMap
from mooncaked.integrations.vllm_plan import (
    ConnectorConfig,
    ConnectorMeta,
    LoadBook,
    LoadSpec,
    SaveSpec,
    SchedulerBook,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = structlog.get_logger(__name__)


class MooncakedMeta(KVConnectorMetadata):
    """``ConnectorMeta`` in vLLM's metadata type (pickled to workers)."""

    def __init__(self, plan: ConnectorMeta) -> None:
        self.plan = plan


def _node_layout(vllm_config: VllmConfig, block_size: int) -> BlockLayout:
    mc = vllm_config.model_config
    par = vllm_config.parallel_config
    dtype = vllm_config.cache_config.cache_dtype
    kv_dtype = mc.dtype if dtype in ("auto", None) else getattr(torch, str(dtype))
    return BlockLayout(
        mc.get_num_layers(par),
        block_size,
        mc.get_num_kv_heads(par),
        mc.get_head_size(),
        kv_dtype,
    )


def _model_id(cfg: ConnectorConfig, vllm_config: VllmConfig) -> str:
    """mooncaked's id for the same directory and precision."""
    d = Path(cfg.model_dir or vllm_config.model_config.model)
    if not (d / "config.json").is_file():
        raise ValueError(
            f"kv_connector_extra_config.model_dir: {str(d)!r} is not a Hugging Face "
            "directory; the block hashes are seeded with its model id"
        )
    return hf_model_id(d) + precision_tag(vllm_config.model_config.dtype)


def _layer_index(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name)
    if m is None:
        raise ValueError(f"cannot tell the layer of KV cache {name!r}")
    return int(m.group(1))


class MooncakedConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        name = f"vllm-{socket.gethostname()}-{os.getpid()}-{role.name.lower()}"
        self.cfg = ConnectorConfig.from_extra(extra, default_name=name, env=os.environ)
        self.layout = _node_layout(vllm_config, self.cfg.block_size)
        self.vllm_block_size = vllm_config.cache_config.block_size
        if self.vllm_block_size % self.cfg.block_size:
            raise ValueError(
                f"vLLM's block size ({self.vllm_block_size}) must be a multiple of the "
                f"node's ({self.cfg.block_size}, kv_connector_extra_config.block_size)"
            )
        worker = role == KVConnectorRole.WORKER
        self._io = LoopThread(f"mooncaked-{role.name.lower()}")
        self.link = NodeLink(
            node_url=self.cfg.node_url,
            name=self.cfg.name,
            secret=self.cfg.secret,
            layout=self.layout,
            staging_rows=(self.cfg.load_rows + self.cfg.save_rows) if worker else 0,
            timeout_s=self.cfg.timeout_s,
            transports=self.cfg.transports,
        )
        self._io.run(self.link.start(), self.cfg.timeout_s)
        if worker:
            self._init_worker()
        else:
            self.book = SchedulerBook(
                _model_id(self.cfg, vllm_config),
                self.cfg.block_size,
                max_load_blocks=self.cfg.load_rows,
                align=self.vllm_block_size,
            )
            log.info(
                "vllm_connector.scheduler", model_id=self.book.model_id, node=self.cfg.node_url
            )

    # -- scheduler side -----------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.cfg.load:
            return 0, False
        rid = request.request_id
        self.book.hashes(rid, request.prompt_token_ids or [])
        ask = self.book.to_ask(rid, num_computed_tokens)
        if ask is not None:
            _, hashes = ask
            try:
                offer = self._io.run(
                    self.link.lease(hashes, self.cfg.lease_ttl_s), self.cfg.timeout_s
                )
            except (LinkError, TimeoutError) as exc:
                # The node is away: vLLM computes the prompt itself.
                log.warning("vllm_connector.lease_failed", error=str(exc))
                offer = None
            self._give_back(self.book.offered(rid, num_computed_tokens, offer))
        n = self.book.num_matched(rid)
        return n, n > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._give_back(self.book.allocated(request.request_id, block_ids, num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        for new in scheduler_output.scheduled_new_reqs:
            n = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            self.book.scheduled(new.req_id, new.block_ids[0], n, replace=True)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            n = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[rid]
            ids = cached.new_block_ids[i]
            resumed = rid in cached.resumed_req_ids
            self.book.scheduled(rid, ids[0] if ids else [], n, replace=resumed)
        return MooncakedMeta(self.book.build(save=self.cfg.save))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy blocks out within the step: vLLM may free them now.
        self._give_back(self.book.finished(request.request_id))
        return False, None

    def _give_back(self, offer: Any) -> None:
        if offer is not None:
            self._io.submit(self.link.release(offer))

    # -- worker side ----------------------------------------------------------

    def _init_worker(self) -> None:
        self.rowmap: RowMap | None = None
        self.layers: list[torch.Tensor] = []
        self.loads = LoadBook(self.vllm_block_size // self.cfg.block_size)
        self._free_load = list(range(self.cfg.load_rows))
        self._free_save = list(range(self.cfg.load_rows, self.cfg.load_rows + self.cfg.save_rows))
        self._rows_lock = threading.Lock()
        self._bad_blocks: set[int] = set()
        self.blocks_saved = 0
        self.saves_dropped = 0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm._custom_ops import cpu_attn_reshape_and_cache
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        names = sorted(kv_caches, key=_layer_index)
        self.layers = [kv_caches[n] for n in names]
        first = self.layers[0]
        _, heads, kbs, two_dim = first.shape
        isa = _get_attn_isa(first.dtype, kbs, two_dim // 2)

        def write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor):
            nb, h, bs, td = cache.shape
            kc, vc = cache.view(nb, h, 2 * bs, td // 2).chunk(2, dim=2)
            cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)

        paged = PagedLayout.probe(
            write,
            num_kv_heads=heads,
            head_dim=two_dim // 2,
            kernel_block_size=kbs,
            dtype=first.dtype,
        )
        self.rowmap = RowMap(paged, self.layout, self.vllm_block_size)
        self.rowmap.check_layers(self.layers)
        log.info(
            "vllm_connector.worker",
            isa=isa,
            layers=len(self.layers),
            strided=paged.affine is not None,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        for spec in self._plan().loads:
            self.loads.started(spec)
            rows = self._take(self._free_load, spec.count)
            if rows is None:
                self.loads.landed(spec.req_id, 0)
                continue
            self._io.submit(self._load(spec, rows))

    async def _load(self, spec: LoadSpec, rows: list[int]) -> None:
        n = 0
        try:
            n = await self.link.read(spec.offer, rows)
            if n and self.rowmap is not None and self.link.rows is not None:
                places = self.rowmap.places(spec.block_ids, spec.first, n)
                self.rowmap.scatter(self.layers, places, self.link.rows[rows[:n]])
        except Exception as exc:  # any failure only costs a recompute
            log.warning("vllm_connector.load_failed", req=spec.req_id, error=repr(exc))
            n = 0
        finally:
            self._give(self._free_load, rows)
            self.loads.landed(spec.req_id, n)
        log.info(
            "vllm_connector.loaded",
            req=spec.req_id,
            blocks=n,
            asked=spec.count,
            bytes=n * self.layout.block_bytes,
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: a loading request is not in the step.
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Blocks are whole only once every layer ran: wait_for_save copies them.
        return

    def wait_for_save(self) -> None:
        for spec in self._plan().saves:
            rows = self._take(self._free_save, len(spec.hashes))
            if rows is None or self.rowmap is None or self.link.rows is None:
                self.saves_dropped += len(spec.hashes)
                continue
            places = self.rowmap.places(spec.block_ids, spec.first, len(spec.hashes))
            staged = torch.empty((len(rows), self.layout.block_bytes), dtype=torch.uint8)
            self.rowmap.gather(self.layers, places, staged)
            self.link.rows[rows] = staged
            self._io.submit(self._save(spec, rows))

    async def _save(self, spec: SaveSpec, rows: list[int]) -> None:
        try:
            self.blocks_saved += await self.link.put(spec.hashes, rows)
        except LinkError as exc:
            log.warning("vllm_connector.save_failed", req=spec.req_id, error=str(exc))
        finally:
            self._give(self._free_save, rows)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # vLLM asks for the failed blocks right after this, in the same pass:
        # they are kept for get_block_ids_with_load_errors.
        done, failed, bad = self.loads.take()
        self._bad_blocks |= bad
        if failed:
            log.warning("vllm_connector.loads_failed", requests=sorted(failed), blocks=len(bad))
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def _plan(self) -> ConnectorMeta:
        meta = self._get_connector_metadata()
        if not isinstance(meta, MooncakedMeta):
            raise RuntimeError(f"another connector's metadata: {type(meta).__name__}")
        return meta.plan

    def _take(self, free: list[int], n: int) -> list[int] | None:
        with self._rows_lock:
            if n > len(free):
                return None
            rows, free[:] = free[:n], free[n:]
            return rows

    def _give(self, free: list[int], rows: list[int]) -> None:
        with self._rows_lock:
            free.extend(rows)

    def shutdown(self) -> None:
        try:
            self._io.run(self.link.close(), self.cfg.timeout_s)
        except (TimeoutError, LinkError, OSError) as exc:
            log.warning("vllm_connector.close_failed", error=repr(exc))
        self._io.close()
