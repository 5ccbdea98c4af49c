"""Memory nodes: decode attention offloaded from the decode (compute) nodes.

A memory node holds the KV of the sequences it serves and computes their
attention; the decode nodes keep only the dense part of their steps
(``costs.offloaded_step``). The simulator stripes the memory nodes evenly
over the decode nodes: each decode node gets ``memory / decode`` of the
pool's KV capacity, bandwidth and NICs (a memory node shared by two decode
nodes reads both their KV in each layer's round, so each sees half its
bandwidth). The q/k/v traffic is priced by the cost model, not carried by
the simulated network.

Figures are published device specs; prices are server list prices
amortised over three years of hours (README: "Attention offloading").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mooncakectl.simulate.costs import (
    GB,
    PRESETS,
    NodeSpec,
    OffloadedDecode,
)
from mooncaked.cluster.costs import MemoryLink, Offload, StepCost

# Server prices in yuan (Reuters, January 2024: distributors' 8-GPU servers),
# as dollars an hour over three years.
CNY_PER_USD = 7.2
HOURS = 3 * 365 * 24
SERVER_CNY = {"8xh800": 2.0e6, "8xh20": 1.4e6}
# With attention offloaded the batch is bounded by the memory nodes' KV and
# the SLO, not by the compute node's HBM: the scheduler's cap is raised.
OFFLOAD_MAX_BATCH = 1024


def hourly_usd(hardware: str) -> float | None:
    cny = SERVER_CNY.get(hardware)
    return None if cny is None else cny / CNY_PER_USD / HOURS


@dataclass(frozen=True, slots=True)
class MemorySpec:
    name: str
    num_gpus: int
    # HBM bytes/s and bytes, per GPU.
    hbm_bps: float
    hbm_bytes: float
    num_nics: int
    nic_gbps: float
    memory_efficiency: float = 0.7
    # Per layer: a round trip of two small RDMA messages, and a kernel launch
    # on the memory node (assumptions, not measurements).
    rtt_s: float = 20e-6
    layer_s: float = 10e-6

    @property
    def kv_bytes(self) -> float:
        # No weights: all but a tenth (activations, fragmentation) holds KV.
        return self.num_gpus * self.hbm_bytes * 0.9

    @property
    def kv_read_bps(self) -> float:
        return self.num_gpus * self.hbm_bps * self.memory_efficiency

    @property
    def nic_bps(self) -> float:
        return self.num_nics * self.nic_gbps * 1e9 / 8


# H20: 96 GB HBM3 at 4.0 TB/s, 148 dense bf16 TFLOP/s (decode attention of
# a GQA-8 model does 8 flops a KV byte: 32 TFLOP/s at 4 TB/s, well within).
MEMORY_PRESETS = {"8xh20": MemorySpec("8xh20", 8, 4.0e12, 96 * GB, 8, 400.0)}


def offloaded_node(
    node: NodeSpec, preset: str, memory: MemorySpec, share: float, *, micro_batches: int = 2
) -> NodeSpec:
    """The decode node of ``preset`` with its attention on ``share`` of a
    memory node (memory nodes / decode nodes)."""
    if not share > 0:
        raise ValueError(f"a decode node needs a share of the memory nodes > 0, got {share}")
    model = PRESETS[preset].model
    traffic = model.attention_traffic()
    link = MemoryLink(
        kv_read_bps=memory.kv_read_bps * share,
        link_bps=min(node.nic_bps, memory.nic_bps * share),
        rtt_s=memory.rtt_s,
        layer_s=memory.layer_s,
    )
    off = OffloadedDecode(node.costs.step, node.costs.kv_bytes_per_token, Offload(traffic, link))
    s, layers = node.costs.step, traffic.num_layers
    # What the Conductor reads: the serial model is linear in batch and
    # context (the overlapped one is not), an upper bound of the real step.
    serial = StepCost(
        base_s=s.base_s + layers * (link.rtt_s + link.layer_s),
        token_s=s.token_s,
        pair_s=s.pair_s,
        seq_s=s.seq_s + layers * (traffic.qkv_bytes + traffic.out_bytes) / link.link_bps,
        ctx_s=node.costs.kv_bytes_per_token / link.kv_read_bps,
    )
    return replace(
        node,
        costs=replace(node.costs, step=serial, max_batch=OFFLOAD_MAX_BATCH),
        kv_capacity_tokens=int(memory.kv_bytes * share // node.costs.kv_bytes_per_token),
        offload=off,
    )


@dataclass(frozen=True, slots=True)
class Capacity:
    """One decode node's largest batch at a mean context, and what bounds it."""

    batch: int
    bound: str
    tbt_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.tbt_s if self.tbt_s > 0 else 0.0


def decode_s(node: NodeSpec, batch: int, context_tokens: float) -> float:
    if node.offload is not None:
        return node.offload.decode_s(batch, context_tokens)
    return node.costs.step.decode_step_s(batch, round(context_tokens))


def capacity(node: NodeSpec, mean_context: float, slo_tbt_s: float) -> Capacity:
    """The batch a decode node holds at ``mean_context`` tokens a sequence:
    the least of its KV room, its scheduler's cap and the largest batch
    whose step stays within the TBT SLO."""
    limits = {"max batch": node.costs.max_batch or OFFLOAD_MAX_BATCH}
    if node.kv_capacity_tokens > 0:
        limits["KV memory"] = int(node.kv_capacity_tokens // mean_context)
    lo, hi = 0, max(limits.values())
    if slo_tbt_s > 0:
        # The step grows with the batch: the largest within the SLO by bisection.
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if decode_s(node, mid, mid * mean_context) <= slo_tbt_s:
                lo = mid
            else:
                hi = mid - 1
        limits["TBT SLO"] = lo
    bound = min(limits, key=lambda k: (limits[k], k))
    batch = max(0, limits[bound])
    return Capacity(batch, bound, decode_s(node, batch, batch * mean_context) if batch else 0.0)


def cluster_price(compute_usd: float, memory_usd: float, num_decode: int, num_memory: int) -> float:
    return compute_usd * num_decode + memory_usd * num_memory
