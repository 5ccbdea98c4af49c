"""Prometheus metrics of one node, in a registry of its own.

Each Node owns an ``ApiMetrics`` with its own ``CollectorRegistry`` (never the
process-global one), so several Nodes in one test process keep separate
counts. The HTTP layer records requests, tokens and latencies as they happen;
engine gauges (load, KV usage, prefix hits) are read from ``EngineCore.stats()``
at scrape time, so they are never stale and cost nothing between scrapes.
Other subsystems add their own collectors to ``registry``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Seconds; covers a CPU test model (milliseconds) to a large model under load.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector(Collector):
    """Reads engine stats at scrape time; nothing while the engine is not up."""

    def __init__(self, stats: Callable[[], Any | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:
            return
        gauges = (
            ("mooncaked_num_requests_running", "Requests being scheduled.", s.num_running),
            (
                "mooncaked_num_requests_waiting",
                "Requests queued for a first schedule.",
                s.num_waiting,
            ),
            ("mooncaked_kv_blocks_total", "Device KV blocks in the pool.", s.kv_num_blocks),
            (
                "mooncaked_kv_blocks_used",
                "Device KV blocks held by requests.",
                s.kv_num_used_blocks,
            ),
            ("mooncaked_kv_usage_ratio", "Fraction of device KV blocks in use.", s.kv_usage),
            (
                "mooncaked_prefix_cache_hit_rate",
                "Prompt tokens served from the prefix cache / queried.",
                s.prefix_hit_rate,
            ),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=float(value))
        counters = (
            (
                "mooncaked_prefix_cache_queried_tokens",
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_queried_tokens,
            ),
            (
                "mooncaked_prefix_cache_hit_tokens",
                "Prompt tokens found in the prefix cache.",
                s.prefix_hit_tokens,
            ),
            (
                "mooncaked_engine_prompt_tokens",
                "Prompt tokens the engine computed or reused.",
                s.num_prompt_tokens_total,
            ),
            (
                "mooncaked_engine_generation_tokens",
                "Tokens the engine generated.",
                s.num_generation_tokens_total,
            ),
            (
                "mooncaked_preemptions",
                "Requests preempted for lack of KV blocks.",
                s.num_preemptions_total,
            ),
            ("mooncaked_engine_steps", "Engine steps run.", s.num_steps),
            (
                "mooncaked_engine_cache_loads",
                "Prefixes loaded from the host tiers instead of computed.",
                s.num_loads_total,
            ),
            (
                "mooncaked_engine_offloads",
                "Batches of device blocks handed to the host tiers.",
                s.num_offloads_total,
            ),
            (
                "mooncaked_kv_pool_self_check_failures",
                "Idle self-checks of the device block pool that found it inconsistent.",
                s.num_integrity_failures,
            ),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=float(value))


class _CacheCollector(Collector):
    """The KV cache's tiers, peer fetches and transfers, read at scrape time.

    ``snapshot()`` returns None while the store is not up, else a mapping with
    ``store`` (StoreStats), ``fetch`` (FetchStats), ``leases`` (LeaseStats)
    and ``transfer`` (TransferMetrics or None).
    """

    def __init__(self, snapshot: Callable[[], Any | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        if snap is None:
            return
        store = snap["store"]
        tiers = [("dram", store.dram)]
        if store.ssd.capacity_blocks:
            tiers.append(("ssd", store.ssd))

        def per_tier(name: str, doc: str, attr: str, counter: bool) -> Metric:
            family = CounterMetricFamily if counter else GaugeMetricFamily
            m = family(name, doc, labels=["tier"])
            for tier, t in tiers:
                m.add_metric([tier], float(getattr(t, attr)))
            return m

        yield per_tier(
            "mooncaked_cache_used_blocks", "KV blocks held by a host tier.", "used_blocks", False
        )
        yield per_tier(
            "mooncaked_cache_capacity_blocks",
            "KV blocks a host tier can hold.",
            "capacity_blocks",
            False,
        )
        yield per_tier("mooncaked_cache_hits", "Prefix blocks found in a host tier.", "hits", True)
        yield per_tier(
            "mooncaked_cache_misses", "Prefix blocks looked for and not found.", "misses", True
        )
        yield per_tier(
            "mooncaked_cache_read_bytes", "Bytes loaded out of a host tier.", "bytes_read", True
        )
        yield per_tier(
            "mooncaked_cache_written_bytes",
            "Bytes stored into a host tier.",
            "bytes_written",
            True,
        )
        yield per_tier(
            "mooncaked_cache_evictions", "Blocks evicted from a host tier.", "evictions", True
        )
        counters = (
            (
                "mooncaked_cache_offloads_dropped",
                "Device-to-DRAM offloads dropped on a full queue.",
                store.offloads_dropped,
            ),
            (
                "mooncaked_cache_ssd_writes_dropped",
                "SSD writes dropped on a full queue.",
                store.ssd_writes_dropped,
            ),
            (
                "mooncaked_cache_ssd_corrupt_dropped",
                "SSD blocks that failed their checksum and were dropped.",
                store.ssd_corrupt_dropped,
            ),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=float(value))
        fetch = snap["fetch"]
        results = CounterMetricFamily(
            "mooncaked_peer_fetches",
            "Fetches of cached blocks from peers, by result.",
            labels=["result"],
        )
        for result in ("ok", "failed", "missed", "skipped", "timed_out"):
            results.add_metric([result], float(getattr(fetch, result)))
        yield results
        yield CounterMetricFamily(
            "mooncaked_peer_fetch_blocks", "Blocks fetched from peers.", value=float(fetch.blocks)
        )
        yield CounterMetricFamily(
            "mooncaked_peer_fetch_bytes", "Bytes fetched from peers.", value=float(fetch.bytes)
        )
        yield GaugeMetricFamily(
            "mooncaked_peer_fetches_inflight",
            "Fetches from peers in flight.",
            value=float(fetch.inflight),
        )
        leases = snap["leases"]
        yield CounterMetricFamily(
            "mooncaked_peer_leases_granted",
            "DRAM leases granted to peers.",
            value=float(leases.granted),
        )
        yield CounterMetricFamily(
            "mooncaked_peer_leases_lapsed",
            "DRAM leases to peers that ran out before their release.",
            value=float(leases.lapsed),
        )
        yield GaugeMetricFamily(
            "mooncaked_peer_leases_active", "DRAM leases peers hold.", value=float(leases.active)
        )
        transfer = snap["transfer"]
        if transfer is None:
            return
        moved = CounterMetricFamily(
            "mooncaked_transfer_bytes",
            "Bytes this node moved by transfer ops it started, by direction.",
            labels=["direction"],
        )
        moved.add_metric(["read"], float(transfer.bytes_read))
        moved.add_metric(["written"], float(transfer.bytes_written))
        yield moved
        served = CounterMetricFamily(
            "mooncaked_transfer_served_bytes",
            "Bytes peers moved through this node's transfer endpoint, by direction.",
            labels=["direction"],
        )
        served.add_metric(["read"], float(transfer.served_bytes_read))
        served.add_metric(["written"], float(transfer.served_bytes_written))
        yield served
        by_transport = CounterMetricFamily(
            "mooncaked_transfer_transport_bytes",
            "Bytes this node moved, by transport.",
            labels=["transport"],
        )
        for name, value in sorted(transfer.bytes_by_transport.items()):
            by_transport.add_metric([name], float(value))
        yield by_transport
        yield CounterMetricFamily(
            "mooncaked_transfer_ops_failed",
            "Transfer ops that failed.",
            value=float(transfer.ops_failed),
        )


class _ClusterCollector(Collector):
    """Gossip: members by status, packets, drops, the block index; read at scrape time.

    ``snapshot()`` returns None while gossip is not running, else a
    ``mooncaked.cluster.local.ClusterSnapshot``.
    """

    def __init__(self, snapshot: Callable[[], Any | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        if snap is None:
            return
        members = GaugeMetricFamily(
            "mooncaked_cluster_members",
            "Cluster members in this node's view (itself included), by status.",
            labels=["status"],
        )
        for status, n in snap.members.items():
            members.add_metric([status], float(n))
        yield members
        c = snap.counters
        yield CounterMetricFamily(
            "mooncaked_gossip_packets_sent", "Gossip datagrams sent.", value=float(c.packets_sent)
        )
        yield CounterMetricFamily(
            "mooncaked_gossip_packets_received",
            "Gossip datagrams received (dropped ones included).",
            value=float(c.packets_received),
        )
        yield CounterMetricFamily(
            "mooncaked_gossip_bytes_sent",
            "Bytes of gossip datagrams sent.",
            value=float(c.bytes_sent),
        )
        yield CounterMetricFamily(
            "mooncaked_gossip_bytes_received",
            "Bytes of gossip datagrams received.",
            value=float(c.bytes_received),
        )
        dropped = CounterMetricFamily(
            "mooncaked_gossip_packets_dropped",
            "Gossip packets dropped, by reason: forged (bad MAC), malformed, invalid "
            "(a value out of bounds), oversize, blocked (a test partition).",
            labels=["reason"],
        )
        for reason, value in (
            ("forged", c.dropped_bad_mac),
            ("malformed", c.dropped_malformed),
            ("invalid", c.dropped_invalid),
            ("oversize", c.dropped_oversize),
            ("blocked", c.dropped_blocked),
        ):
            dropped.add_metric([reason], float(value))
        yield dropped
        yield CounterMetricFamily(
            "mooncaked_gossip_broadcasts_dropped",
            "Queued pieces of news dropped on a full broadcast queue.",
            value=float(c.dropped_broadcasts),
        )
        yield CounterMetricFamily(
            "mooncaked_gossip_handler_errors",
            "Gossip packets or timers whose handler failed (a bug).",
            value=float(c.handler_errors),
        )
        yield CounterMetricFamily(
            "mooncaked_gossip_probes", "Failure-detector probes sent.", value=float(c.probes)
        )
        yield CounterMetricFamily(
            "mooncaked_gossip_suspicions",
            "Members this node suspected after a failed probe.",
            value=float(c.suspicions_raised),
        )
        yield CounterMetricFamily(
            "mooncaked_gossip_refutations",
            "Suspicions of this node it refuted.",
            value=float(c.refutations),
        )
        for name, doc, ok, failed in (
            (
                "mooncaked_gossip_syncs",
                "Push-pull state exchanges, by result.",
                c.syncs_ok,
                c.syncs_failed,
            ),
            ("mooncaked_gossip_pulls", "Block-index pulls, by result.", c.pulls_ok, c.pulls_failed),
        ):
            family = CounterMetricFamily(name, doc, labels=["result"])
            family.add_metric(["ok"], float(ok))
            family.add_metric(["failed"], float(failed))
            yield family
        yield GaugeMetricFamily(
            "mooncaked_cluster_index_blocks",
            "Entries of the cluster-wide block index here, every node's replica together.",
            value=float(snap.index_blocks),
        )
        yield GaugeMetricFamily(
            "mooncaked_cluster_index_own_blocks",
            "Blocks this node publishes in the cluster-wide index.",
            value=float(snap.own_blocks),
        )
        yield CounterMetricFamily(
            "mooncaked_cluster_block_events",
            "Block events (stored, removed) of this node's tiers published to gossip.",
            value=float(snap.block_events),
        )


class ApiMetrics:
    def __init__(self, engine_stats: Callable[[], Any | None] = lambda: None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = Counter(
            "mooncaked_http_requests",
            "HTTP requests answered, by route and status code.",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "mooncaked_prompt_tokens", "Prompt tokens of finished API requests.", registry=r
        )
        self.generation_tokens = Counter(
            "mooncaked_generation_tokens", "Tokens returned to API clients.", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "mooncaked_cached_prompt_tokens",
            "Prompt tokens of finished API requests that came from a cache.",
            registry=r,
        )
        self.requests_finished = Counter(
            "mooncaked_requests_finished",
            "Generation requests finished, by reason (stop, length, abort, error).",
            ["reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "mooncaked_time_to_first_token_seconds",
            "From request arrival to its first token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "mooncaked_inter_token_latency_seconds",
            "Between consecutive tokens of one request.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "mooncaked_e2e_request_latency_seconds",
            "From request arrival to its last token.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(engine_stats))

    def add_cache_collector(self, snapshot: Callable[[], Any | None]) -> None:
        """Expose the KV cache's tiers, peer fetches and transfers (see _CacheCollector)."""
        self.registry.register(_CacheCollector(snapshot))

    def add_cluster_collector(self, snapshot: Callable[[], Any | None]) -> None:
        """Expose gossip membership, traffic and the block index (see _ClusterCollector)."""
        self.registry.register(_ClusterCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
