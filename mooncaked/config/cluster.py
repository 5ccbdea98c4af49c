"""The cluster: gossip, disaggregation, placement and admission, latency targets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mooncaked.config.errors import check

_KV_EVENTS_SCHEMES = ("tcp://", "ipc://", "inproc://")


def _check_kv_events_endpoint(endpoint: str) -> None:
    """ConfigValueError naming ``kv_events_endpoint`` unless it is empty or a
    ZMQ endpoint a PUB socket can bind or connect: tcp://HOST:PORT, ipc://PATH
    or inproc://NAME."""
    if not endpoint:
        return
    key = "kv_events_endpoint"
    scheme = next((s for s in _KV_EVENTS_SCHEMES if endpoint.startswith(s)), None)
    check(
        scheme is not None,
        key,
        f"{endpoint!r} is not a ZMQ endpoint: tcp://HOST:PORT (tcp://*:5557 binds every "
        "interface), ipc://PATH or inproc://NAME",
    )
    rest = endpoint[len(scheme or "") :]
    check(bool(rest), key, f"{endpoint!r} names no address after {scheme!r}")
    if scheme == "tcp://":
        host, sep, port = rest.rpartition(":")
        check(
            bool(sep and host) and port.isdigit() and 0 < int(port) <= 65535,
            key,
            f"{endpoint!r} is not tcp://HOST:PORT with a port in 1..65535",
        )


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Gossip: SWIM membership, state spread, push-pull sync, the block index.

    A crashed node is suspected within about two probe intervals (every live
    node probes one member per interval, round-robin) and declared dead
    suspect_timeout_s later; the news then spreads in a few gossip rounds.
    """

    # host:port of gossip endpoints to join through; empty: a cluster of one.
    seeds: tuple[str, ...] = ()
    gossip_host: str = "127.0.0.1"
    # 0: an ephemeral port. UDP (probes, gossip) and TCP (sync, pulls) share it.
    gossip_port: int = 0
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 0.2
    indirect_probes: int = 3
    suspect_timeout_s: float = 2.0
    # Piggy-backed news is also pushed to gossip_fanout random members this often.
    gossip_interval_s: float = 0.2
    gossip_fanout: int = 3
    # Each piece of news is sent retransmit_mult * ceil(log10(members + 1)) times.
    retransmit_mult: int = 4
    # Full push-pull state exchange with one random member (and one dead one,
    # to heal partitions) this often.
    sync_interval_s: float = 5.0
    sync_timeout_s: float = 2.0
    # Largest UDP datagram; fits an Ethernet MTU so nothing fragments.
    max_message_bytes: int = 1400
    # Largest TCP message (a sync, or one chunk of a block snapshot).
    max_sync_bytes: int = 16 * 1024 * 1024
    # Most queued pieces of news; beyond it the most-sent are dropped first.
    max_broadcasts: int = 1024
    # Recent block-index batches kept so lagging peers get a delta, not a snapshot.
    block_log_entries: int = 65536
    # Dead and left members are forgotten after this long.
    dead_reap_s: float = 300.0
    # Incarnations and generations are wall-clock milliseconds in origin: news
    # claiming one further ahead of this node's clock than this is refused, so
    # no forged claim can outrank a node's own answer for longer.
    max_clock_skew_s: float = 60.0
    # Tests only: serve POST /admin/test/blocks (fake block events) and
    # /admin/test/drop_peers (a staged partition). Never in production.
    test_hooks: bool = False
    # KV events out, in vLLM's format, for routers outside the cluster
    # (llm-d, Dynamo, Mooncake's conductor): a ZMQ PUB socket's endpoint;
    # empty: none. Bound when its host is a wildcard ("*", "::") or it is
    # ipc:// or inproc://, connected otherwise (to a subscriber that binds),
    # as vLLM's own publisher does. Needs the "events" extra.
    kv_events_endpoint: str = ""
    # The first frame of every message; subscribers filter on its prefix.
    kv_events_topic: str = ""
    # "map": each event a msgpack map tagged by its "type" key (vLLM since
    # its switch to named fields); "array": each event a positional array
    # behind its tag (earlier vLLM releases), for consumers that read only that.
    kv_events_format: Literal["map", "array"] = "map"

    def __post_init__(self) -> None:
        check(0 <= self.gossip_port <= 65535, "gossip_port", "must be in 0..65535")
        check(self.probe_interval_s > 0, "probe_interval_s", "must be > 0")
        check(
            0 < self.probe_timeout_s < self.probe_interval_s,
            "probe_timeout_s",
            "must be > 0 and below probe_interval_s",
        )
        check(self.indirect_probes >= 0, "indirect_probes", "must be >= 0")
        check(self.suspect_timeout_s > 0, "suspect_timeout_s", "must be > 0")
        check(self.gossip_interval_s > 0, "gossip_interval_s", "must be > 0")
        check(self.gossip_fanout > 0, "gossip_fanout", "must be > 0")
        check(self.retransmit_mult > 0, "retransmit_mult", "must be > 0")
        check(self.sync_interval_s > 0, "sync_interval_s", "must be > 0")
        check(self.sync_timeout_s > 0, "sync_timeout_s", "must be > 0")
        check(
            512 <= self.max_message_bytes <= 65507,
            "max_message_bytes",
            "must be in 512..65507 (a UDP datagram)",
        )
        check(
            self.max_sync_bytes >= 64 * 1024,
            "max_sync_bytes",
            "must be >= 65536",
        )
        check(self.max_broadcasts > 0, "max_broadcasts", "must be > 0")
        check(self.block_log_entries > 0, "block_log_entries", "must be > 0")
        check(self.dead_reap_s > 0, "dead_reap_s", "must be > 0")
        check(
            0 < self.max_clock_skew_s <= 86400,
            "max_clock_skew_s",
            "must be > 0 and at most 86400 (a day); set NTP up rather than raise it",
        )
        _check_kv_events_endpoint(self.kv_events_endpoint)
        check(len(self.kv_events_topic) <= 256, "kv_events_topic", "must be at most 256 characters")
        for seed in self.seeds:
            host, sep, port = seed.rpartition(":")
            check(
                bool(sep and host and port.isdigit()),
                "seeds",
                f"{seed!r} is not host:port",
            )


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """Prefill/decode disaggregation: the KV handoff between nodes."""

    # How long a prefill node may write the decode node's granted blocks; a
    # prefill that takes longer fails over (and its blocks stay held that long).
    grant_ttl_s: float = 30.0
    # Send each layer's KV as soon as its forward ends (overlapping compute);
    # false sends after the whole step (the baseline bench_disagg compares with).
    layerwise: bool = True
    # Layer-wise sends group consecutive layers until their KV reaches this
    # many bytes (the last layer goes alone): each batch costs the event
    # loop about half a millisecond, more than moving a short prompt's layer,
    # and that work competes with the forward. 0 sends every layer alone.
    layer_batch_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        check(0.0 < self.grant_ttl_s <= 3600.0, "grant_ttl_s", "must be in (0, 3600]")
        check(0 <= self.layer_batch_bytes <= 1 << 30, "layer_batch_bytes", "must be in [0, 2**30]")


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """Chunked pipeline parallelism: this prefill node as one stage of a
    pipelined prefill group. Each stage holds a range of the model's layers;
    a long prompt's chunks flow through the stages, so different chunks of
    one request compute at once on different nodes."""

    # The group's name (every stage of a group sets the same); empty: this
    # node is not a stage.
    group: str = ""
    # This node's stage, counted from 0 (the head, which holds the
    # embedding), and how many stages the group has.
    stage: int = 0
    num_stages: int = 2
    # The layers where each stage after the head begins (num_stages - 1
    # ascending indices); empty: as even a split as the layers allow.
    split: tuple[int, ...] = ()
    # Prompt tokens in a pipelined request's first chunk; later chunks are
    # sized to take as long (their attention grows with the context). 0:
    # the scheduler's token budget, every chunk alike.
    chunk_tokens: int = 512
    # Bytes for the activations of prompts in flight, in each direction:
    # the rows the stage before writes into here, and those waiting here to
    # be written to the next. The input rows bound the longest prompt the
    # stage takes (bytes / (hidden size x dtype bytes) tokens).
    activation_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        check(len(self.group) <= 64, "group", "must be at most 64 characters")
        check(2 <= self.num_stages <= 16, "num_stages", "must be in 2..16")
        check(
            0 <= self.stage < self.num_stages,
            "stage",
            f"must be in 0..{self.num_stages - 1} (num_stages = {self.num_stages})",
        )
        if self.split:
            check(
                len(self.split) == self.num_stages - 1,
                "split",
                f"must name {self.num_stages - 1} layer indices (num_stages - 1), "
                f"got {list(self.split)}",
            )
            check(
                all(b > a for a, b in zip((0, *self.split), self.split, strict=False)),
                "split",
                f"must be ascending layer indices above 0, got {list(self.split)}",
            )
        check(0 <= self.chunk_tokens <= 1 << 20, "chunk_tokens", "must be in 0..1048576")
        check(
            1 << 20 <= self.activation_bytes <= 1 << 40,
            "activation_bytes",
            "must be in [2**20, 2**40]",
        )

    @property
    def enabled(self) -> bool:
        return bool(self.group)


@dataclass(frozen=True, slots=True)
class ConductorConfig:
    """Placement and admission by the node a request enters (see cluster/conductor.py)."""

    # random | load_balance | local_cache | conductor (cluster-wide cache and
    # cost aware, the default).
    policy: Literal["random", "load_balance", "local_cache", "conductor"] = "conductor"
    # Judge the TBT SLO on the decode load forecast for the request's run from
    # when its prefill ends (predicted), on the batch decoding now (current),
    # or admit everything (off).
    early_reject: Literal["off", "current", "predicted"] = "predicted"
    # Fetch a remote prefix only when it is this many times longer than the
    # one the prefill node holds (and fetching beats recomputing).
    balancing_threshold: float = 1.2
    # Most nodes holding one prefix: beyond it nobody fetches it to serve it.
    max_replicas: int = 3
    # Entries deciding on the same gossip view spread their choices: prefill
    # candidates within this share of the best predicted TTFT come first in
    # a random order, decode candidates within decode_spread of the best
    # predicted TBT likewise (0: the best alone).
    spread: float = 0.25
    decode_spread: float = 0.05
    # Late binding: a prefill node whose own queue makes it slower than the
    # entry forecast (by more than bind_slack of its TTFT) and than the
    # candidates left passes the request on to the next; max_prefill
    # candidates are listed for each request.
    late_binding: bool = True
    bind_slack: float = 0.5
    max_prefill: int = 8
    # A request whose own prefill is longer than the TTFT SLO (a retry would
    # fail the same way) is served as well as can be, not rejected, when it
    # waits no longer than this share of the SLO; 0: rejected like others.
    best_effort_wait: float = 0.1
    # Profile the engine at start-up (a few prompts and a decode batch) so
    # the cost model is usable before the first request.
    profile: bool = True

    def __post_init__(self) -> None:
        check(self.balancing_threshold >= 1.0, "balancing_threshold", "must be >= 1.0")
        check(self.max_replicas >= 1, "max_replicas", "must be >= 1")
        for key in ("spread", "decode_spread", "bind_slack", "best_effort_wait"):
            value = getattr(self, key)
            check(0.0 <= value <= 100.0, key, "must be in [0, 100]")
        check(1 <= self.max_prefill <= 64, "max_prefill", "must be in [1, 64]")


@dataclass(frozen=True, slots=True)
class SloConfig:
    """Latency targets requests are admitted against; 0: none (nothing is rejected for it).
    A request may ask for its own with ``"slo": {"ttft_ms": ..., "tbt_ms": ...}``."""

    # Time to first token, seconds.
    ttft_s: float = 0.0
    # Time between tokens, seconds.
    tbt_s: float = 0.0
    # The share of admitted requests meant to meet the SLOs: admission allows
    # for the forecasts' error on the entry's recent requests up to that
    # share (0: the forecast alone decides, and about half of the requests
    # forecast near an SLO miss it).
    target: float = 0.95

    def __post_init__(self) -> None:
        check(0.0 <= self.ttft_s <= 3600.0, "ttft_s", "must be in [0, 3600]")
        check(0.0 <= self.tbt_s <= 60.0, "tbt_s", "must be in [0, 60]")
        check(0.0 <= self.target < 1.0, "target", "must be in [0, 1)")
