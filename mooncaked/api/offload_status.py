"""Attention offloading in ``/admin/status`` (``offload``) and ``/metrics``
(``mooncaked_offload_*``).

A compute node reports its client's side: where its attention goes, the
steps and layers sent, the sequences uploaded, bytes each way, the time the
step thread waited, the failures and the steps finished here instead. A
memory node reports its attention service's side: what it served, its pool
and its peers. Other nodes report nothing (the section is None).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from mooncaked.api.services import Services

# (name, doc) of the client's counters (``ClientStats``), as metrics.
_CLIENT_COUNTERS = (
    ("steps", "Decode steps whose attention went to a memory node."),
    ("layers", "Layers' attention computed on a memory node."),
    ("uploads", "Sequences' KV uploaded to a memory node (first use or after a failure)."),
    ("direct_handoffs", "Prompts a prefill node wrote straight into a memory node."),
    ("bytes_sent", "Bytes sent to memory nodes (q/k/v, uploads)."),
    ("bytes_received", "Bytes of attention output received from memory nodes."),
    ("wait_s", "Seconds the step thread waited for memory nodes' replies."),
    ("flight_s", "Seconds layers were in flight to memory nodes (sent to answered)."),
    ("failures", "Calls to a memory node that failed or timed out."),
    ("local_fallbacks", "Steps (or their rest) whose attention ran here instead."),
)
# The attention service's counters (``ServerStats``), on a memory node.
_SERVER_COUNTERS = (
    ("connections", "Compute nodes' connections accepted."),
    ("steps", "Decode steps served."),
    ("layers", "Layers' attention computed."),
    ("uploads", "Sequences' KV uploaded by compute nodes."),
    ("direct", "Prompts' KV written here by prefill nodes (direct handoffs)."),
    ("bytes_in", "Bytes received from compute nodes."),
    ("bytes_out", "Bytes of attention output sent."),
    ("refused", "Connections refused (bad proof, another KV shape)."),
    ("errors", "Layers answered with an error."),
    ("busy_s", "Seconds of attention computed."),
)


class OffloadStatus:
    def __init__(self, services: Services) -> None:
        self._services = services

    def _client_stats(self) -> tuple[str, Any] | None:
        """(where attention goes, the client's counters) on a compute node."""
        engine = self._services.engine
        offload = engine.runner.offload if engine is not None else None
        if offload is None:
            return None
        # "auto": every memory node connected now.
        return ", ".join(offload.clients.connected), offload.stats

    def status_section(self) -> dict[str, Any] | None:
        cfg = self._services.config.offload
        server = self._services.attention
        if server is not None:
            return {
                "side": "memory",
                "attention_addr": server.address,
                "pool": server.load(),
                **{name: _num(getattr(server.stats, name)) for name, _ in _SERVER_COUNTERS},
            }
        client = self._client_stats()
        if client is None and not cfg.placed:
            return None
        out: dict[str, Any] = {
            "side": "compute",
            # "auto": the memory node placement picks per request.
            "memory_node": cfg.memory_node,
            "connected_to": client[0] if client is not None else "",
        }
        stats = client[1] if client is not None else None
        for name, _ in _CLIENT_COUNTERS:
            out[name] = _num(getattr(stats, name)) if stats is not None else 0
        return out

    def collect(self) -> Iterator[Metric]:
        server = self._services.attention
        if server is not None:
            for name, doc in _SERVER_COUNTERS:
                yield _counter(f"mooncaked_offload_served_{name}", doc, getattr(server.stats, name))
            load = server.load()
            for key, doc in (
                ("num_seqs", "Sequences whose KV this memory node holds."),
                ("num_peers", "Compute nodes connected."),
                ("num_blocks", "KV blocks of the memory node's pool."),
                ("num_free_blocks", "Free KV blocks of the memory node's pool."),
            ):
                g = GaugeMetricFamily(f"mooncaked_offload_{key}", doc)
                g.add_metric([], load[key])
                yield g
            return
        client = self._client_stats()
        if client is None:
            return
        for name, doc in _CLIENT_COUNTERS:
            yield _counter(f"mooncaked_offload_{name}", doc, getattr(client[1], name))

    def describe(self) -> list[Metric]:
        return []


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    # Seconds are counted as seconds: the family says so in its name.
    family = CounterMetricFamily(name[:-2] + "_seconds" if name.endswith("_s") else name, doc)
    family.add_metric([], float(value))
    return family


def _num(v: float) -> float:
    return round(v, 6) if isinstance(v, float) else v
