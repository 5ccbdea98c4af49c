"""What a simulated node costs: ``costs.NodeCosts`` plus its memory and network.

Two sources:

- the analytic model of the Mooncake paper, from a model and a node's
  hardware: prefill flops = layers x (a n^2 d + b n d^2) with a = 4, b = 22,
  KV bytes per token = layers x 2 x d / gqa x bytes; GPU FLOPs and HBM
  bandwidth at an efficiency, NIC bandwidth. It becomes the same linear
  ``StepCost`` a real node fits to its own steps, so the Conductor reads a
  simulated node as it reads a real one;
- a profile measured from a real node: the ``conductor.costs`` section of
  ``GET /admin/status`` (the coefficients the daemon fitted and gossips).

A stage of a pipelined prefill group costs its share of the layers of the
whole model's node (``stage_spec``), a step's fixed part aside.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mooncaked.cluster.costs import AttentionTraffic, NodeCosts, Offload, StepCost, offloaded_step
from mooncaked.handoff import LayerSpan

# The paper's attention and projection coefficients.
ATTN_A = 4.0
PROJ_B = 22.0
GB = 1e9
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    # Query heads per KV head (grouped-query attention); 1 for multi-head.
    gqa: int
    num_params: float
    bytes_per_value: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.hidden_size // self.gqa * self.bytes_per_value

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.bytes_per_value

    def attention_traffic(self) -> AttentionTraffic:
        """Per token per layer: q (hidden), k and v (hidden / gqa each) out, the
        output (hidden) back."""
        d, b = self.hidden_size, self.bytes_per_value
        return AttentionTraffic(self.num_layers, (d + 2 * d // self.gqa) * b, d * b)


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    name: str
    num_gpus: int
    # Dense bf16 FLOP/s and HBM bytes/s and bytes, per GPU.
    gpu_flops: float
    gpu_hbm_bps: float
    gpu_hbm_bytes: float
    num_nics: int
    nic_gbps: float
    dram_bytes: float
    # Share of peak that a real engine reaches.
    compute_efficiency: float = 0.5
    memory_efficiency: float = 0.7
    # What a step costs beyond reading the weights and the KV and the
    # flops: tensor-parallel all-reduces (two a layer) and kernel launches,
    # per step and per sequence in it (their traffic grows with the batch).
    step_overhead_s: float = 0.0
    seq_overhead_s: float = 0.0
    # Of ``step_overhead_s``, what a step pays once whatever its layers (the
    # scheduler's work, preparing the inputs, launching the step, sampling);
    # the rest (each layer's all-reduces and kernels) a stage of a pipelined
    # group pays for its own layers only.
    step_fixed_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Preset:
    model: ModelSpec
    hardware: HardwareSpec
    chunk_tokens: int
    max_batch: int


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """Everything the simulator needs of one node."""

    costs: NodeCosts
    # Bytes/s each way through the node's NICs, all of them together.
    nic_bps: float
    # Host DRAM for the KV block cache, and the SSD tier (0: none).
    dram_bytes: float
    ssd_bytes: float = 0.0
    ssd_bps: float = 4 * GB
    # Tokens of KV the device holds for decoding (0: bounded by max_batch only).
    kv_capacity_tokens: int = 0
    # Decode attention on memory nodes (None: local); ``costs`` then prices it
    # serially for the Conductor, and the node's steps by this.
    offload: OffloadedDecode | None = None


@dataclass(frozen=True, slots=True)
class OffloadedDecode:
    """A compute node's own step model and where its attention goes."""

    step: StepCost
    kv_bytes_per_token: int
    offload: Offload

    def decode_s(self, batch: int, context_tokens: float) -> float:
        o = self.offload
        return offloaded_step(
            self.step,
            self.kv_bytes_per_token,
            o.traffic,
            o.link,
            batch,
            context_tokens,
            micro_batches=o.micro_batches,
        ).tbt_s


LLAMA3_70B = ModelSpec("llama3-70b", 80, 8192, 8, 70.6e9)
LLAMA3_8B = ModelSpec("llama3-8b", 32, 4096, 4, 8.0e9)
# A800 80GB SXM: A100's compute and memory, NVLink and I/O cut for export.
# Eight of them serve LLaMA-70B with tensor parallelism over all eight: the
# per-step and per-sequence overheads are fitted to published decode times
# of a 70B model on 8 x A100 with TP 8 (README: "Where the 70B preset's
# costs come from"): 16-16.5 ms a token at batch 1, 20 at 8, 25 at 50,
# 33 at 85, 40-43 at 150-200, against 12.5-30 ms without them.
A800_X8 = HardwareSpec(
    "8xa800",
    8,
    312e12,
    2.039e12,
    80 * GB,
    4,
    200.0,
    1024 * GB,
    step_overhead_s=0.005,
    seq_overhead_s=25e-6,
    # An assumption, not a fit: gpt-fast, with next to no host work a step,
    # decodes at about the fitted times, so most of the 5 ms is per layer.
    step_fixed_s=0.001,
)
# H800 80GB SXM: H100's compute (989 dense bf16 TFLOP/s) and HBM3 (3.35
# TB/s), NVLink cut to 400 GB/s as the A800's: the A800's fitted all-reduce
# and launch overheads are taken as they are (an assumption, not a fit).
H800_X8 = HardwareSpec(
    "8xh800",
    8,
    989e12,
    3.35e12,
    80 * GB,
    8,
    400.0,
    2048 * GB,
    step_overhead_s=0.005,
    seq_overhead_s=25e-6,
    step_fixed_s=0.001,
)
# One GPU: no tensor parallelism, nothing to all-reduce.
A800_X1 = HardwareSpec("1xa800", 1, 312e12, 2.039e12, 80 * GB, 1, 200.0, 256 * GB)

PRESETS: dict[str, Preset] = {
    "llama3-70b-8xa800": Preset(LLAMA3_70B, A800_X8, chunk_tokens=8192, max_batch=128),
    "llama3-8b-1xa800": Preset(LLAMA3_8B, A800_X1, chunk_tokens=8192, max_batch=128),
    "llama3-70b-8xh800": Preset(LLAMA3_70B, H800_X8, chunk_tokens=8192, max_batch=128),
}


def analytic_step_cost(model: ModelSpec, hw: HardwareSpec) -> StepCost:
    """The paper's flop count and a memory-bound decode as a ``StepCost``.

    A prompt of n tokens costs layers x (a n^2 d + b n d^2) flops; the
    n^2 term is 2x the (query, key) pairs ``costs.prefill_pairs`` counts,
    so a pair costs 2 a d layers flops and a token b d^2 layers. A step
    reads the weights once (``base``) and each decode reads its context's
    KV (``ctx``); each decoded token costs a prompt token's projections.
    The hardware's fixed overheads (all-reduces, launches) add to the step
    and to each sequence in it.
    """
    flops = hw.num_gpus * hw.gpu_flops * hw.compute_efficiency
    hbm = hw.num_gpus * hw.gpu_hbm_bps * hw.memory_efficiency
    d, layers = model.hidden_size, model.num_layers
    token_s = layers * PROJ_B * d * d / flops
    return StepCost(
        base_s=model.weight_bytes / hbm + hw.step_overhead_s,
        token_s=token_s,
        pair_s=2.0 * ATTN_A * d * layers / flops,
        seq_s=token_s + hw.seq_overhead_s,
        ctx_s=model.kv_bytes_per_token / hbm,
    )


def preset_node(name: str) -> NodeSpec:
    preset = PRESETS.get(name)
    if preset is None:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    model, hw = preset.model, preset.hardware
    kv_room = hw.num_gpus * hw.gpu_hbm_bytes * 0.9 - model.weight_bytes
    if kv_room <= 0:
        raise ValueError(f"preset {name!r}: the weights do not fit the GPUs' memory")
    nic_bps = hw.num_nics * hw.nic_gbps * 1e9 / 8
    costs = NodeCosts(
        step=analytic_step_cost(model, hw),
        kv_bytes_per_token=model.kv_bytes_per_token,
        chunk_tokens=preset.chunk_tokens,
        max_batch=preset.max_batch,
    )
    return NodeSpec(
        costs=costs,
        nic_bps=nic_bps,
        dram_bytes=hw.dram_bytes,
        kv_capacity_tokens=int(kv_room // model.kv_bytes_per_token),
    )


@dataclass(frozen=True, slots=True)
class StageModel:
    """What splitting a node's model into the stages of a pipelined prefill
    group needs to know of it (``stage_spec``)."""

    num_layers: int
    # One token's hidden state, what a stage sends the next: hidden size x
    # bytes per value.
    act_bytes_per_token: int
    # What a step costs whatever its layers (``HardwareSpec.step_fixed_s``).
    step_fixed_s: float = 0.0


def preset_stage_model(name: str) -> StageModel:
    preset = PRESETS.get(name)
    if preset is None:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    model = preset.model
    return StageModel(
        model.num_layers,
        model.hidden_size * model.bytes_per_value,
        preset.hardware.step_fixed_s,
    )


def stage_spec(node: NodeSpec, model: StageModel, span: LayerSpan) -> NodeSpec:
    """The node of one stage holding ``span`` of ``model``, from the whole
    model's ``node``: every layer computes its tokens and pairs, reads its
    weights and its KV and all-reduces on its own, so the per-token, per-pair,
    per-sequence and per-context terms, the KV bytes per token and the base
    less the fixed part scale by the stage's share of the layers; the fixed
    part of a step (``step_fixed_s``) each stage pays whole. (The embedding
    and the head go with the layers: a prefill reads a few rows of the one
    and computes the other for one token a request.)"""
    if span.num_layers != model.num_layers:
        raise ValueError(
            f"stage layers {span.lo}..{span.hi} are of a {span.num_layers}-layer model, "
            f"not of this {model.num_layers}-layer one"
        )
    share = span.count / model.num_layers
    s = node.costs.step
    fixed = min(model.step_fixed_s, s.base_s)
    step = StepCost(
        fixed + (s.base_s - fixed) * share,
        s.token_s * share,
        s.pair_s * share,
        s.seq_s * share,
        s.ctx_s * share,
    )
    kvb = node.costs.kv_bytes_per_token * span.count // model.num_layers
    return replace(node, costs=replace(node.costs, step=step, kv_bytes_per_token=kvb))


def costs_from_json(doc: Any, source: str = "<profile>") -> NodeCosts:
    """``NodeCosts`` from a node's published costs: the whole ``/admin/status``
    document, its ``conductor`` section, or the ``costs`` object itself."""
    if isinstance(doc, dict) and isinstance(doc.get("conductor"), dict):
        doc = doc["conductor"]
    if isinstance(doc, dict) and isinstance(doc.get("costs"), dict):
        doc = doc["costs"]
    if not isinstance(doc, dict) or not isinstance(doc.get("step"), dict):
        raise ValueError(
            f"{source}: no cost model in it (expected the conductor.costs section of "
            "GET /admin/status, with a 'step' object)"
        )
    step_doc = doc["step"]
    names = ("base_s", "token_s", "pair_s", "seq_s", "ctx_s")
    values = []
    for n in names:
        v = step_doc.get(n, 0.0)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{source}: step.{n} must be a number >= 0, got {v!r}")
        values.append(float(v))
    step = StepCost(*values)
    if not step.known:
        raise ValueError(f"{source}: the node had not fitted its step costs yet (all zero)")
    ints = {}
    for n in ("kv_bytes_per_token", "chunk_tokens", "max_batch"):
        v = doc.get(n, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{source}: {n} must be an integer >= 0, got {v!r}")
        ints[n] = v
    links_doc = doc.get("links", {})
    if not isinstance(links_doc, dict):
        raise ValueError(f"{source}: links must be an object of peer -> bytes/s")
    links = []
    for peer, bps in links_doc.items():
        if isinstance(bps, bool) or not isinstance(bps, int | float) or not bps > 0:
            raise ValueError(f"{source}: link {peer!r} must be a positive bytes/s, got {bps!r}")
        links.append((str(peer), float(bps)))
    links.sort(key=lambda kv: (-kv[1], kv[0]))
    return NodeCosts(
        step, ints["kv_bytes_per_token"], ints["chunk_tokens"], ints["max_batch"], tuple(links)
    )


def profile_node(
    path: str | Path, *, nic_gbps: float | None = None, dram_bytes: float = 64 * GIB
) -> NodeSpec:
    """A node as measured: its fitted costs; its NIC as fast as its fastest
    measured link unless ``nic_gbps`` says otherwise."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read profile {str(path)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {str(path)!r} is not JSON: {exc.msg}") from None
    costs = costs_from_json(doc, str(path))
    if nic_gbps is not None:
        nic_bps = nic_gbps * 1e9 / 8
    elif costs.links:
        nic_bps = costs.links[0][1]
    else:
        raise ValueError(
            f"profile {str(path)!r} has no measured link: give the NIC speed with --nic-gbps"
        )
    if costs.kv_bytes_per_token <= 0:
        raise ValueError(f"profile {str(path)!r}: kv_bytes_per_token is 0; cannot price transfers")
    # Links name the profiled cluster's peers; simulated peers are priced by the NIC.
    return NodeSpec(replace(costs, links=()), nic_bps=nic_bps, dram_bytes=dram_bytes)
