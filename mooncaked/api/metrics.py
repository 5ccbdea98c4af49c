"""Prometheus metrics of one node, in a registry of its own.

Each Node owns an ``ApiMetrics`` with its own ``CollectorRegistry`` (never the
process-global one), so several Nodes in one test process keep separate
counts. The HTTP layer records requests, tokens and latencies as they happen;
every subsystem's figures (engine load, KV cache tiers, gossip, the handoff,
the Conductor) come through one protocol: a ``MetricsSource`` handed to
``ApiMetrics.register``, collected at scrape time, so they are never stale
and cost nothing between scrapes. Most are a ``SnapshotMetrics``: a table of
``Spec``s read off a subsystem's stats snapshot.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# Seconds; covers a CPU test model (milliseconds) to a large model under load.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# (name, help, buckets) of the request latencies ``ApiMetrics`` records.
_LATENCIES = (
    (
        "mooncaked_time_to_first_token_seconds",
        "From request arrival to its first token.",
        _TTFT_BUCKETS,
    ),
    (
        "mooncaked_inter_token_latency_seconds",
        "Between consecutive tokens of one request.",
        _ITL_BUCKETS,
    ),
    (
        "mooncaked_e2e_request_latency_seconds",
        "From request arrival to its last token.",
        _E2E_BUCKETS,
    ),
)


@dataclass(frozen=True, slots=True)
class Spec:
    """One metric family read off a snapshot at scrape time.

    ``read(snapshot)`` gives the value; with ``label``, a mapping from label
    value to value (one sample each); None leaves the family out this scrape.
    """

    name: str
    doc: str
    read: Callable[[Any], float | Mapping[str, float] | None]
    counter: bool = False
    label: str | None = None


def _families(specs: tuple[Spec, ...], snap: Any) -> Iterator[Metric]:
    for spec in specs:
        value = spec.read(snap)
        if value is None:
            continue
        family = CounterMetricFamily if spec.counter else GaugeMetricFamily
        if spec.label is None:
            yield family(spec.name, spec.doc, value=float(value))  # type: ignore[arg-type]
            continue
        m = family(spec.name, spec.doc, labels=[spec.label])
        for key, v in value.items():  # type: ignore[union-attr]
            m.add_metric([key], float(v))
        yield m


def histograms(
    rows: Iterable[tuple[str, str, tuple[float, ...]]], registry: CollectorRegistry | None
) -> list[Histogram]:
    """One histogram per (name, help, buckets) row, in the rows' order."""
    return [Histogram(name, doc, buckets=buckets, registry=registry) for name, doc, buckets in rows]


class MetricsSource(Protocol):
    """A subsystem's metric families, built at scrape time (none while it is down)."""

    def collect(self) -> Iterable[Metric]: ...


class SnapshotMetrics:
    """A table of specs over ``snapshot()``; nothing while it returns None (the
    subsystem is not up)."""

    def __init__(self, snapshot: Callable[[], Any | None], specs: tuple[Spec, ...]) -> None:
        self._snapshot = snapshot
        self._specs = specs

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        if snap is not None:
            yield from _families(self._specs, snap)


def _gauge(name: str, doc: str, attr: str) -> Spec:
    return Spec(name, doc, operator.attrgetter(attr))


def _counter(name: str, doc: str, attr: str) -> Spec:
    return Spec(name, doc, operator.attrgetter(attr), counter=True)


# Read off ``EngineCore.stats()``.
ENGINE_METRICS: tuple[Spec, ...] = (
    _gauge("mooncaked_num_requests_running", "Requests being scheduled.", "num_running"),
    _gauge(
        "mooncaked_num_requests_waiting", "Requests queued for a first schedule.", "num_waiting"
    ),
    _gauge("mooncaked_kv_blocks_total", "Device KV blocks in the pool.", "kv_num_blocks"),
    _gauge("mooncaked_kv_blocks_used", "Device KV blocks held by requests.", "kv_num_used_blocks"),
    _gauge("mooncaked_kv_usage_ratio", "Fraction of device KV blocks in use.", "kv_usage"),
    _gauge(
        "mooncaked_prefix_cache_hit_rate",
        "Prompt tokens served from the prefix cache / queried.",
        "prefix_hit_rate",
    ),
    _counter(
        "mooncaked_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_queried_tokens",
    ),
    _counter(
        "mooncaked_prefix_cache_hit_tokens",
        "Prompt tokens found in the prefix cache.",
        "prefix_hit_tokens",
    ),
    _counter(
        "mooncaked_engine_prompt_tokens",
        "Prompt tokens the engine computed or reused.",
        "num_prompt_tokens_total",
    ),
    _counter(
        "mooncaked_engine_generation_tokens",
        "Tokens the engine generated.",
        "num_generation_tokens_total",
    ),
    _counter(
        "mooncaked_preemptions",
        "Requests preempted for lack of KV blocks.",
        "num_preemptions_total",
    ),
    _counter("mooncaked_engine_steps", "Engine steps run.", "num_steps"),
    _counter(
        "mooncaked_engine_cache_loads",
        "Loads of KV from outside the device (host tiers, peers) instead of computing it.",
        "num_loads_total",
    ),
    _counter(
        "mooncaked_engine_offloads",
        "Batches of device blocks handed to the host tiers.",
        "num_offloads_total",
    ),
    _counter(
        "mooncaked_kv_pool_self_check_failures",
        "Idle self-checks of the device block pool that found it inconsistent.",
        "num_integrity_failures",
    ),
)


def _per_tier(name: str, doc: str, attr: str, counter: bool) -> Spec:
    def read(snap: Any) -> dict[str, float]:
        store = snap["store"]
        tiers = {"dram": store.dram}
        if store.ssd.capacity_blocks:
            tiers["ssd"] = store.ssd
        return {tier: getattr(t, attr) for tier, t in tiers.items()}

    return Spec(name, doc, read, counter=counter, label="tier")


def _of(section: str, attr: str) -> Callable[[Any], float | None]:
    def read(snap: Any) -> float | None:
        obj = snap[section]
        return None if obj is None else getattr(obj, attr)

    return read


def _pinned(pins: Any) -> dict[str, float] | None:
    return None if pins is None else {"soft": pins.soft_blocks, "hard": pins.hard_blocks}


def _replicas(stats: Any) -> dict[str, float] | None:
    if stats is None:
        return None
    return {"stored": stats.blocks_stored, "refused": stats.blocks_refused}


def _lease_refusals(leases: Any) -> dict[str, float] | None:
    if leases is None:
        return None
    return {
        "full": leases.refused,
        "reader_cap": leases.refused_reader,
        "outside_cap": leases.refused_outside,
        "reader_refused": leases.refused_unknown,
    }


def _directions(served: bool) -> Callable[[Any], dict[str, float] | None]:
    prefix = "served_" if served else ""

    def read(snap: Any) -> dict[str, float] | None:
        t = snap["transfer"]
        if t is None:
            return None
        return {
            "read": getattr(t, f"{prefix}bytes_read"),
            "written": getattr(t, f"{prefix}bytes_written"),
        }

    return read


# Read off ``CacheAdmin.snapshot()``: ``store`` (StoreStats), ``fetch``
# (FetchStats), ``leases`` (LeaseStats), ``transfer`` (TransferMetrics or None).
CACHE_METRICS: tuple[Spec, ...] = (
    _per_tier(
        "mooncaked_cache_used_blocks", "KV blocks held by a host tier.", "used_blocks", False
    ),
    _per_tier(
        "mooncaked_cache_capacity_blocks",
        "KV blocks a host tier can hold.",
        "capacity_blocks",
        False,
    ),
    _per_tier("mooncaked_cache_hits", "Prefix blocks found in a host tier.", "hits", True),
    _per_tier("mooncaked_cache_misses", "Prefix blocks looked for and not found.", "misses", True),
    _per_tier("mooncaked_cache_read_bytes", "Bytes loaded out of a host tier.", "bytes_read", True),
    _per_tier(
        "mooncaked_cache_written_bytes", "Bytes stored into a host tier.", "bytes_written", True
    ),
    _per_tier("mooncaked_cache_evictions", "Blocks evicted from a host tier.", "evictions", True),
    Spec(
        "mooncaked_cache_offloads_dropped",
        "Device-to-DRAM offloads dropped on a full queue.",
        _of("store", "offloads_dropped"),
        counter=True,
    ),
    Spec(
        "mooncaked_cache_ssd_writes_dropped",
        "SSD writes dropped on a full queue.",
        _of("store", "ssd_writes_dropped"),
        counter=True,
    ),
    Spec(
        "mooncaked_cache_ssd_corrupt_dropped",
        "SSD blocks that failed their checksum and were dropped.",
        _of("store", "ssd_corrupt_dropped"),
        counter=True,
    ),
    Spec(
        "mooncaked_cache_watermark_evictions",
        "DRAM blocks the background task evicted past store.high_watermark.",
        _of("store", "watermark_evictions"),
        counter=True,
    ),
    Spec(
        "mooncaked_cache_pinned_blocks",
        "Blocks pinned against eviction, by kind (soft: evicted last; hard: never).",
        lambda snap: _pinned(snap["pins"]),
        label="kind",
    ),
    Spec(
        "mooncaked_store_replica_blocks",
        "Blocks this node put on other nodes, by what the holder did: stored, or "
        "refused because their bytes did not match the checksum stated.",
        lambda snap: _replicas(snap["replicator"]),
        counter=True,
        label="result",
    ),
    Spec(
        "mooncaked_peer_fetches",
        "Fetches of cached blocks from peers, by result.",
        lambda snap: {
            r: getattr(snap["fetch"], r) for r in ("ok", "failed", "missed", "skipped", "timed_out")
        },
        counter=True,
        label="result",
    ),
    Spec(
        "mooncaked_peer_fetch_blocks",
        "Blocks fetched from peers.",
        _of("fetch", "blocks"),
        counter=True,
    ),
    Spec("mooncaked_peer_fetch_bytes", "Bytes fetched from peers.", _of("fetch", "bytes"), True),
    Spec(
        "mooncaked_peer_fetches_inflight", "Fetches from peers in flight.", _of("fetch", "inflight")
    ),
    Spec(
        "mooncaked_peer_leases_granted",
        "DRAM leases granted to peers.",
        _of("leases", "granted"),
        counter=True,
    ),
    Spec(
        "mooncaked_peer_leases_lapsed",
        "DRAM leases to peers that ran out before their release.",
        _of("leases", "lapsed"),
        counter=True,
    ),
    Spec("mooncaked_peer_leases_active", "DRAM leases peers hold.", _of("leases", "active")),
    Spec(
        "mooncaked_peer_leases_refused",
        "Peers' lease lookups turned away, by reason: every lease out (full), the "
        "member's cap (reader_cap), the cap shared by readers outside the cluster "
        "view (outside_cap), or a reader never leased to, answered 403 (reader_refused).",
        lambda snap: _lease_refusals(snap["leases"]),
        counter=True,
        label="reason",
    ),
    Spec(
        "mooncaked_transfer_bytes",
        "Bytes this node moved by transfer ops it started, by direction.",
        _directions(served=False),
        counter=True,
        label="direction",
    ),
    Spec(
        "mooncaked_transfer_served_bytes",
        "Bytes peers moved through this node's transfer endpoint, by direction.",
        _directions(served=True),
        counter=True,
        label="direction",
    ),
    Spec(
        "mooncaked_transfer_transport_bytes",
        "Bytes this node moved, by transport.",
        lambda snap: (
            None
            if snap["transfer"] is None
            else dict(sorted(snap["transfer"].bytes_by_transport.items()))
        ),
        counter=True,
        label="transport",
    ),
    Spec(
        "mooncaked_transfer_ops_failed",
        "Transfer ops that failed.",
        _of("transfer", "ops_failed"),
        counter=True,
    ),
    Spec(
        "mooncaked_transfer_ops_refused",
        "Peers' transfer ops refused by a segment's access rights (a write into a "
        "read-only segment, or outside a live grant).",
        _of("transfer", "served_forbidden"),
        counter=True,
    ),
)


def _results(ok: str, failed: str) -> Callable[[Any], dict[str, float]]:
    return lambda snap: {
        "ok": getattr(snap.counters, ok),
        "failed": getattr(snap.counters, failed),
    }


def _gossip(name: str, doc: str, attr: str) -> Spec:
    return Spec(name, doc, lambda snap: getattr(snap.counters, attr), counter=True)


# Read off ``mooncaked.cluster.status.ClusterSnapshot``.
CLUSTER_METRICS: tuple[Spec, ...] = (
    Spec(
        "mooncaked_cluster_members",
        "Cluster members in this node's view (itself included), by status.",
        lambda snap: snap.members,
        label="status",
    ),
    _gossip("mooncaked_gossip_packets_sent", "Gossip datagrams sent.", "packets_sent"),
    _gossip(
        "mooncaked_gossip_packets_received",
        "Gossip datagrams received (dropped ones included).",
        "packets_received",
    ),
    _gossip("mooncaked_gossip_bytes_sent", "Bytes of gossip datagrams sent.", "bytes_sent"),
    _gossip(
        "mooncaked_gossip_bytes_received", "Bytes of gossip datagrams received.", "bytes_received"
    ),
    Spec(
        "mooncaked_gossip_packets_dropped",
        "Gossip packets dropped, by reason: forged (bad MAC), malformed, oversize, "
        "blocked (a test partition), invalid (a field out of bounds).",
        lambda snap: {
            "forged": snap.counters.dropped_bad_mac,
            "malformed": snap.counters.dropped_malformed,
            "oversize": snap.counters.dropped_oversize,
            "blocked": snap.counters.dropped_blocked,
            "invalid": snap.counters.dropped_invalid,
        },
        counter=True,
        label="reason",
    ),
    _gossip(
        "mooncaked_gossip_broadcasts_dropped",
        "Queued pieces of news dropped on a full broadcast queue.",
        "dropped_broadcasts",
    ),
    _gossip(
        "mooncaked_gossip_handler_errors",
        "Gossip packets or timers whose handler failed (a bug).",
        "handler_errors",
    ),
    _gossip("mooncaked_gossip_probes", "Failure-detector probes sent.", "probes"),
    _gossip(
        "mooncaked_gossip_suspicions",
        "Members this node suspected after a failed probe.",
        "suspicions_raised",
    ),
    _gossip("mooncaked_gossip_refutations", "Suspicions of this node it refuted.", "refutations"),
    Spec(
        "mooncaked_gossip_syncs",
        "Push-pull state exchanges, by result.",
        _results("syncs_ok", "syncs_failed"),
        counter=True,
        label="result",
    ),
    Spec(
        "mooncaked_gossip_pulls",
        "Block-index pulls, by result.",
        _results("pulls_ok", "pulls_failed"),
        counter=True,
        label="result",
    ),
    Spec(
        "mooncaked_cluster_index_blocks",
        "Entries of the cluster-wide block index here, every node's replica together.",
        operator.attrgetter("index_blocks"),
    ),
    Spec(
        "mooncaked_cluster_index_own_blocks",
        "Blocks this node publishes in the cluster-wide index.",
        operator.attrgetter("own_blocks"),
    ),
    Spec(
        "mooncaked_cluster_block_events",
        "Block events (stored, removed) of this node's tiers published to gossip.",
        operator.attrgetter("block_events"),
        counter=True,
    ),
)


# Read off ``mooncaked.kv_events.service.KVEventsStats``.
KV_EVENTS_METRICS: tuple[Spec, ...] = (
    _counter(
        "mooncaked_kv_events_sent",
        "KV events (vLLM's BlockStored, BlockRemoved, AllBlocksCleared) sent on the ZMQ socket.",
        "events_sent",
    ),
    _counter(
        "mooncaked_kv_events_batches_sent",
        "KV event batches sent on the ZMQ socket.",
        "batches_sent",
    ),
    _counter(
        "mooncaked_kv_events_dropped",
        "KV events dropped on the publisher's full queue (their batch's number is skipped).",
        "events_dropped",
    ),
    _counter(
        "mooncaked_kv_events_send_errors",
        "KV event batches the ZMQ socket refused.",
        "send_errors",
    ),
    _gauge("mooncaked_kv_events_queued", "KV event batches waiting to be sent.", "queued"),
    _gauge(
        "mooncaked_kv_events_announced_blocks",
        "Device blocks KV events say this node holds.",
        "announced_blocks",
    ),
)


class ApiMetrics:
    def __init__(self) -> None:
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
        self.ttft, self.itl, self.e2e = histograms(_LATENCIES, r)

    def register(self, source: MetricsSource) -> None:
        """Adds ``source``'s families to every scrape from now on."""
        self.registry.register(source)  # type: ignore[arg-type]

    def render(self) -> bytes:
        return generate_latest(self.registry)
