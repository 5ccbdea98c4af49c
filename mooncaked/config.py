"""Daemon configuration: frozen dataclasses per subsystem, loaded from TOML.

Every key has a default that works on one machine, so an empty file (or no
file) starts a single-node daemon on the builtin model. Loading is strict: an
unknown section or key, a value of the wrong type, or a value out of range
stops start-up with a ConfigError naming the file and the key.

Each section's dataclass validates its own values in ``__post_init__`` by
raising ``ConfigValueError(key, message)``; the loader adds the file and the
section to the message.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tomllib
import types
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration that cannot start the daemon; the message names key and file."""


class ConfigValueError(ValueError):
    """Raised by a section's validation; the loader turns it into a ConfigError."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigValueError(key, message)


Role = Literal["both", "prefill", "decode"]

ORIGIN_DEFAULT_PORTS = {"http": 80, "https": 443}


def split_origin(origin: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of a web origin such as ``http://host:8000``,
    lower-cased, the port filled in from the scheme; ValueError if it is not one."""
    parts = urllib.parse.urlsplit(origin.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1
    if (
        parts.scheme not in ORIGIN_DEFAULT_PORTS
        or not parts.hostname
        or port == -1
        or parts.username is not None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        raise ValueError(
            f"{origin!r} is not an origin: write scheme://host[:port], e.g. "
            "'https://ops.example.com' or 'http://10.0.0.5:8000'"
        )
    return (
        parts.scheme,
        parts.hostname,
        port if port is not None else ORIGIN_DEFAULT_PORTS[parts.scheme],
    )


@dataclass(frozen=True, slots=True)
class NodeConfig:
    # Empty means "<hostname>-<server port>", unique per daemon on one host.
    id: str = ""
    role: Role = "both"
    # Authenticates transfer handshakes and gossip messages. Every node of a
    # cluster must share it; the default only suits a single trusted host.
    cluster_secret: str = "mooncaked-insecure-default-secret"
    # A file holding the secret (e.g. a systemd credential); read at start,
    # its trailing newline stripped. Wins over cluster_secret and the
    # MOONCAKED_CLUSTER_SECRET environment variable.
    cluster_secret_file: str = ""
    # Where the daemon keeps state (SSD tier, logs of its own); empty: a
    # per-user directory under the system temp dir.
    data_dir: str = ""
    # CPUs the daemon runs on, as a Linux CPU list ("0-3,8"); empty: those it
    # was started with. Daemons sharing a host each get cores of their own,
    # so one node's steps do not slow another's, as on machines of their own.
    cpus: str = ""

    def __post_init__(self) -> None:
        _check(len(self.cluster_secret) >= 8, "cluster_secret", "must be at least 8 characters")
        if self.cpus:
            try:
                parse_cpu_list(self.cpus)
            except ValueError as exc:
                raise ConfigValueError("cpus", str(exc)) from None


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a Linux CPU list ("0-3,8"), as in taskset and cpuset."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise ValueError(f"{part!r} in {text!r} is not a CPU or a range of CPUs") from None
        if first < 0 or last < first:
            raise ValueError(f"{part!r} in {text!r} is not a CPU or a range of CPUs")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


# model.path of the seeded test models (engine/loader.py builds them).
BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    # "builtin:tiny" (no download), a local Hugging Face model directory or a .gguf file.
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
    attention_backend: Literal["auto", "sdpa", "flash"] = "auto"
    # Decode steps replayed from CUDA graphs, one per bucket of batch sizes up
    # to scheduler.max_num_seqs (engine/graphs.py). "auto": on a CUDA device
    # with flash-attn, running eagerly if capture fails; "on": an error where
    # it cannot be had; "off": always eager (no capture time at start-up).
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    seed: int = 0
    # Threads of the engine step thread's OpenMP team for CPU inference (no
    # other thread gets one: mooncaked/process.py). 0: measured at start-up,
    # every core vs one per core but one (engine/threads.py); builtin:tiny,
    # whose nodes must compute alike, keeps one per core but one.
    cpu_threads: int = 0

    @property
    def is_builtin(self) -> bool:
        return self.path.startswith(BUILTIN_PREFIX)

    def __post_init__(self) -> None:
        _check(bool(self.path), "path", "must not be empty")
        _check(self.max_model_len >= 0, "max_model_len", "must be >= 0")
        _check(self.cpu_threads >= 0, "cpu_threads", "must be >= 0")
        _check(self.packed_layout_rows >= 0, "packed_layout_rows", "must be >= 0")
        _check(
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
        _check(
            self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
            "block_size",
            f"must be a power of two, got {self.block_size}",
        )
        _check(self.num_blocks >= 0, "num_blocks", "must be >= 0")
        _check(self.memory_bytes > 0, "memory_bytes", "must be > 0")
        _check(0.0 < self.gpu_memory_fraction <= 1.0, "gpu_memory_fraction", "must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # Most requests decoding at once.
    max_num_seqs: int = 64
    # Token budget of one engine step (prefill chunks + decodes).
    max_num_batched_tokens: int = 1024
    # Requests waiting beyond this are rejected with 429.
    max_waiting: int = 256

    def __post_init__(self) -> None:
        _check(self.max_num_seqs > 0, "max_num_seqs", "must be > 0")
        _check(self.max_num_batched_tokens > 0, "max_num_batched_tokens", "must be > 0")
        _check(self.max_waiting >= 0, "max_waiting", "must be >= 0")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # On SIGTERM: in-flight requests get this long to finish, then are cancelled.
    drain_timeout_s: float = 30.0
    # A request body must arrive within this many seconds of its headers.
    body_timeout_s: float = 60.0
    # A connection with no complete request for this long is closed: an idle
    # keep-alive, or headers that trickle in (slow clients holding sockets).
    idle_timeout_s: float = 75.0
    # Connections served at once; one more is answered 503 and closed unread.
    max_connections: int = 1024
    # Connections one client address may hold at once (0: no limit), so one
    # client cannot take every connection; behind a proxy every client is one
    # address, so set 0 there.
    max_connections_per_client: int = 512
    # Connections accepted beyond max_connections that serve only /health,
    # /ready and requests bearing the admin token: a full server still
    # answers its probes and its operator.
    reserved_connections: int = 16
    # Origins (scheme://host[:port]) a browser page may send state changes
    # from, besides this node's own; also accepted as the Host of /admin and /ui.
    allowed_origins: tuple[str, ...] = ()
    # Keys /v1 accepts as "Authorization: Bearer <key>"; empty: /v1 is open.
    api_keys: tuple[str, ...] = ()
    # Token /admin needs as "Authorization: Bearer <token>"; empty: /admin
    # answers only clients on loopback.
    admin_token: str = ""
    # /metrics needs an API key or the admin token too.
    metrics_require_auth: bool = False

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", f"must be in 0..65535, got {self.port}")
        _check(self.drain_timeout_s >= 0, "drain_timeout_s", "must be >= 0")
        _check(self.body_timeout_s > 0, "body_timeout_s", "must be > 0")
        _check(self.idle_timeout_s > 0, "idle_timeout_s", "must be > 0")
        _check(self.max_connections > 0, "max_connections", "must be > 0")
        _check(
            self.max_connections_per_client >= 0,
            "max_connections_per_client",
            f"must be >= 0 (0: no limit), got {self.max_connections_per_client}",
        )
        _check(
            self.reserved_connections >= 0,
            "reserved_connections",
            f"must be >= 0, got {self.reserved_connections}",
        )
        for origin in self.allowed_origins:
            try:
                split_origin(origin)
            except ValueError as exc:
                raise ConfigValueError("allowed_origins", str(exc)) from None


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"
    # auto: console on a terminal, JSON otherwise.
    format: Literal["auto", "json", "console"] = "auto"


@dataclass(frozen=True, slots=True)
class TransferConfig:
    host: str = "127.0.0.1"
    # 0: an ephemeral port, published through gossip.
    port: int = 0
    transports: tuple[str, ...] = ("shm", "tcp")
    streams_per_peer: int = 4
    slice_bytes: int = 4 * 1024 * 1024
    op_timeout_s: float = 30.0
    max_retries: int = 3
    rdma_device: str = ""

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", f"must be in 0..65535, got {self.port}")
        known = {"tcp", "shm", "rdma"}
        bad = [t for t in self.transports if t not in known]
        _check(not bad, "transports", f"unknown transport(s) {bad}; known: {sorted(known)}")
        _check(self.streams_per_peer > 0, "streams_per_peer", "must be > 0")
        _check(self.slice_bytes >= 4096, "slice_bytes", "must be >= 4096")
        _check(self.op_timeout_s > 0, "op_timeout_s", "must be > 0")
        _check(self.max_retries >= 0, "max_retries", "must be >= 0")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Host tiers of the KV block cache."""

    # DRAM tier size: dram_bytes if > 0, else dram_fraction of physical RAM.
    dram_bytes: int = 256 * 1024 * 1024
    dram_fraction: float = 0.0
    # SSD tier: empty path disables it.
    ssd_path: str = ""
    ssd_bytes: int = 1024 * 1024 * 1024
    # Copy every block offloaded to DRAM on to the SSD in the background (so a
    # restart finds it); off: only blocks evicted from DRAM are written.
    ssd_write_through: bool = True
    # Threads doing SSD reads, writes and log appends.
    ssd_io_threads: int = 4
    # Blocks waiting to be written to the SSD; beyond this, writes are dropped
    # (and counted), never waited for.
    ssd_write_queue: int = 64
    # Read and check every SSD block on start instead of on its first load.
    ssd_verify_on_start: bool = False
    # Offload requests (device -> DRAM) waiting; beyond this they are dropped.
    offload_queue: int = 64
    # How long a peer may hold DRAM slots it reads before they can be reused.
    lease_timeout_s: float = 30.0
    # HTTP base URLs ("http://host:port") of nodes to fetch cached blocks
    # from; the cluster's block index names holders once gossip runs.
    peers: tuple[str, ...] = ()
    # A fetch from peers that takes longer is given up and the prompt computed.
    peer_fetch_timeout_s: float = 2.0
    # Fetches from peers at once; beyond this a prompt is computed (counted).
    peer_max_fetches: int = 8
    # DRAM leases granted to peers at once; beyond this lookups find nothing.
    peer_max_leases: int = 256
    # Of those, leases one member of the cluster view may hold at once, so no
    # peer takes them all.
    peer_max_leases_per_reader: int = 32
    # Leases all readers outside the cluster view (nodes that list this one
    # in their store.peers without gossip) may hold together: any caller can
    # name itself anything, so unverifiable names share one cap. 0: lease
    # to cluster members only.
    peer_max_leases_outside: int = 32

    def __post_init__(self) -> None:
        _check(self.dram_bytes >= 0, "dram_bytes", "must be >= 0")
        _check(0.0 <= self.dram_fraction < 1.0, "dram_fraction", "must be in [0, 1)")
        _check(self.ssd_bytes >= 0, "ssd_bytes", "must be >= 0")
        _check(
            not (self.ssd_path and self.ssd_bytes == 0),
            "ssd_bytes",
            f"is 0 but ssd_path is {self.ssd_path!r}: give the SSD tier a size, or no ssd_path",
        )
        _check(self.ssd_io_threads > 0, "ssd_io_threads", "must be > 0")
        _check(self.ssd_write_queue > 0, "ssd_write_queue", "must be > 0")
        _check(self.offload_queue > 0, "offload_queue", "must be > 0")
        _check(self.lease_timeout_s > 0, "lease_timeout_s", "must be > 0")
        bad = [u for u in self.peers if not u.startswith(("http://", "https://"))]
        _check(not bad, "peers", f"must be http(s)://host:port URLs, got {bad}")
        _check(self.peer_fetch_timeout_s > 0, "peer_fetch_timeout_s", "must be > 0")
        _check(self.peer_max_fetches > 0, "peer_max_fetches", "must be > 0")
        _check(self.peer_max_leases > 0, "peer_max_leases", "must be > 0")
        _check(self.peer_max_leases_per_reader > 0, "peer_max_leases_per_reader", "must be > 0")
        _check(self.peer_max_leases_outside >= 0, "peer_max_leases_outside", "must be >= 0")


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

    def __post_init__(self) -> None:
        _check(0 <= self.gossip_port <= 65535, "gossip_port", "must be in 0..65535")
        _check(self.probe_interval_s > 0, "probe_interval_s", "must be > 0")
        _check(
            0 < self.probe_timeout_s < self.probe_interval_s,
            "probe_timeout_s",
            "must be > 0 and below probe_interval_s",
        )
        _check(self.indirect_probes >= 0, "indirect_probes", "must be >= 0")
        _check(self.suspect_timeout_s > 0, "suspect_timeout_s", "must be > 0")
        _check(self.gossip_interval_s > 0, "gossip_interval_s", "must be > 0")
        _check(self.gossip_fanout > 0, "gossip_fanout", "must be > 0")
        _check(self.retransmit_mult > 0, "retransmit_mult", "must be > 0")
        _check(self.sync_interval_s > 0, "sync_interval_s", "must be > 0")
        _check(self.sync_timeout_s > 0, "sync_timeout_s", "must be > 0")
        _check(
            512 <= self.max_message_bytes <= 65507,
            "max_message_bytes",
            "must be in 512..65507 (a UDP datagram)",
        )
        _check(
            self.max_sync_bytes >= 64 * 1024,
            "max_sync_bytes",
            "must be >= 65536",
        )
        _check(self.max_broadcasts > 0, "max_broadcasts", "must be > 0")
        _check(self.block_log_entries > 0, "block_log_entries", "must be > 0")
        _check(self.dead_reap_s > 0, "dead_reap_s", "must be > 0")
        _check(
            0 < self.max_clock_skew_s <= 86400,
            "max_clock_skew_s",
            "must be > 0 and at most 86400 (a day); set NTP up rather than raise it",
        )
        for seed in self.seeds:
            host, sep, port = seed.rpartition(":")
            _check(
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

    def __post_init__(self) -> None:
        _check(0.0 < self.grant_ttl_s <= 3600.0, "grant_ttl_s", "must be in (0, 3600]")


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
        _check(self.balancing_threshold >= 1.0, "balancing_threshold", "must be >= 1.0")
        _check(self.max_replicas >= 1, "max_replicas", "must be >= 1")
        for key in ("spread", "decode_spread", "bind_slack", "best_effort_wait"):
            value = getattr(self, key)
            _check(0.0 <= value <= 100.0, key, "must be in [0, 100]")
        _check(1 <= self.max_prefill <= 64, "max_prefill", "must be in [1, 64]")


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
        _check(0.0 <= self.ttft_s <= 3600.0, "ttft_s", "must be in [0, 3600]")
        _check(0.0 <= self.tbt_s <= 60.0, "tbt_s", "must be in [0, 60]")
        _check(0.0 <= self.target < 1.0, "target", "must be in [0, 1)")


@dataclass(frozen=True, slots=True)
class Config:
    node: NodeConfig = field(default_factory=NodeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    conductor: ConductorConfig = field(default_factory=ConductorConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    # Where the config came from, for messages; not a TOML key.
    source: str = field(default="<defaults>", compare=False)

    def __post_init__(self) -> None:
        # The node's files live under its state directory: a relative SSD tier
        # path is taken from there, not from wherever the daemon was started.
        ssd = self.store.ssd_path
        if ssd and not os.path.isabs(ssd):
            store = dataclasses.replace(self.store, ssd_path=str(self.data_dir / ssd))
            object.__setattr__(self, "store", store)

    @property
    def node_id(self) -> str:
        return self.node.id or f"{socket.gethostname()}-{self.server.port}"

    @property
    def data_dir(self) -> Path:
        """``node.data_dir``, or a per-user, per-node directory under the system
        temp dir; the parent of a relative ``store.ssd_path``."""
        if self.node.data_dir:
            return Path(self.node.data_dir)
        import tempfile

        return Path(tempfile.gettempdir()) / f"mooncaked-{os.getuid()}" / self.node_id


_SECTIONS: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in dataclasses.fields(Config)
    if f.name != "source"
}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; TOML ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigValueError(key, f"must be one of {list(allowed)}, got {value!r}")
        return value
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigValueError(key, f"must be a list, got {type(value).__name__}")
        return tuple(_coerce(v, item_tp, key) for v in value)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _coerce(value, arm, key)
            except ConfigValueError:
                continue
        raise ConfigValueError(key, f"has the wrong type: {value!r}")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigValueError(key, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigValueError(key, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigValueError(key, f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigValueError(key, f"must be a string, got {value!r}")
        return value
    raise RuntimeError(f"config type {tp!r} of {key} is not supported by the loader")


def _build_section(name: str, cls: type, table: Any, source: str) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [{name}] must be a table")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(
                f"{source}: unknown key '{name}.{key}' (known keys of [{name}]: "
                f"{', '.join(sorted(known))})"
            )
        try:
            kwargs[key] = _coerce(value, hints[key], key)
        except ConfigValueError as exc:
            raise ConfigError(f"{source}: '{name}.{exc.key}' {exc.message}") from None
    try:
        return cls(**kwargs)
    except ConfigValueError as exc:
        raise ConfigError(f"{source}: '{name}.{exc.key}' {exc.message}") from None


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    sections: dict[str, Any] = {}
    for name, table in data.items():
        cls = _SECTIONS.get(name)
        if cls is None:
            raise ConfigError(
                f"{source}: unknown section [{name}] (known: {', '.join(sorted(_SECTIONS))})"
            )
        sections[name] = _build_section(name, cls, table, source)
    return Config(**sections, source=source)


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Load a TOML file; ``None`` gives the defaults."""
    if path is None:
        return Config()
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config file: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    return config_from_dict(data, str(p))


def apply_flags(config: Config, values: dict[str, Any], keys: dict[str, tuple[str, str]]) -> Config:
    """``config`` with command-line values applied: ``keys`` maps a flag to its
    (section, key); flags left at None keep the file's value."""
    sections: dict[str, dict[str, Any]] = {}
    for flag, (section, key) in keys.items():
        value = values.get(flag)
        if value is not None:
            sections.setdefault(section, {})[key] = value
    if not sections:
        return config
    try:
        return with_overrides(config, **sections)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (from the command line)") from None


def with_overrides(config: Config, **sections: dict[str, Any]) -> Config:
    """A copy of ``config`` with some keys replaced, validated like the file.

    ``with_overrides(cfg, server={"port": 0})``: used by the CLI flags and tests.
    """
    merged: dict[str, Any] = {}
    for f in dataclasses.fields(Config):
        if f.name == "source":
            continue
        current = dataclasses.asdict(getattr(config, f.name))
        current = {k: list(v) if isinstance(v, tuple) else v for k, v in current.items()}
        current.update(sections.get(f.name, {}))
        merged[f.name] = current
    unknown = set(sections) - set(merged)
    if unknown:
        raise ConfigError(f"unknown section(s) {sorted(unknown)}")
    return config_from_dict(merged, config.source)
