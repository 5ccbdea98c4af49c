"""The data plane: the transfer engine and the host tiers of the KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mooncaked.config.errors import check
from mooncaked.config.names import object_name_error


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
        check(0 <= self.port <= 65535, "port", f"must be in 0..65535, got {self.port}")
        known = {"tcp", "shm", "rdma"}
        bad = [t for t in self.transports if t not in known]
        check(not bad, "transports", f"unknown transport(s) {bad}; known: {sorted(known)}")
        check(self.streams_per_peer > 0, "streams_per_peer", "must be > 0")
        check(self.slice_bytes >= 4096, "slice_bytes", "must be >= 4096")
        check(self.op_timeout_s > 0, "op_timeout_s", "must be > 0")
        check(self.max_retries >= 0, "max_retries", "must be >= 0")


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
    # Share of DRAM slots in use past which a background task evicts least
    # recently used blocks (never leased or hard-pinned ones, soft-pinned
    # last) down to low_watermark; 1.0: only allocation evicts.
    high_watermark: float = 0.9
    low_watermark: float = 0.8
    # Most blocks pins may hold (soft and hard together, wherever the blocks
    # are), as a share of the DRAM tier's slots; a pin beyond it is refused.
    max_pinned_ratio: float = 0.5
    # Staging memory that replicas pushed by peers are written into (granted
    # to the writer, checked, then copied into DRAM); 0: take no replicas.
    replica_inbox_bytes: int = 32 * 1024 * 1024
    # How long a replica put may take per holder (reserve, write, commit).
    replica_timeout_s: float = 10.0
    # Inbox rows that writers outside the cluster view (the KV connector of
    # another engine: mooncaked/integrations/) may hold together. Any holder
    # of the secret can name itself anything, so they share one cap, as
    # outside readers share peer_max_leases_outside. 0: take replicas from
    # cluster members only.
    replica_max_rows_outside: int = 0

    def __post_init__(self) -> None:
        check(self.dram_bytes >= 0, "dram_bytes", "must be >= 0")
        check(0.0 <= self.dram_fraction < 1.0, "dram_fraction", "must be in [0, 1)")
        check(self.ssd_bytes >= 0, "ssd_bytes", "must be >= 0")
        check(
            not (self.ssd_path and self.ssd_bytes == 0),
            "ssd_bytes",
            f"is 0 but ssd_path is {self.ssd_path!r}: give the SSD tier a size, or no ssd_path",
        )
        check(self.ssd_io_threads > 0, "ssd_io_threads", "must be > 0")
        check(self.ssd_write_queue > 0, "ssd_write_queue", "must be > 0")
        check(self.offload_queue > 0, "offload_queue", "must be > 0")
        check(self.lease_timeout_s > 0, "lease_timeout_s", "must be > 0")
        bad = [u for u in self.peers if not u.startswith(("http://", "https://"))]
        check(not bad, "peers", f"must be http(s)://host:port URLs, got {bad}")
        check(self.peer_fetch_timeout_s > 0, "peer_fetch_timeout_s", "must be > 0")
        check(self.peer_max_fetches > 0, "peer_max_fetches", "must be > 0")
        check(self.peer_max_leases > 0, "peer_max_leases", "must be > 0")
        check(self.peer_max_leases_per_reader > 0, "peer_max_leases_per_reader", "must be > 0")
        check(self.peer_max_leases_outside >= 0, "peer_max_leases_outside", "must be >= 0")
        check(
            0.0 < self.high_watermark <= 1.0,
            "high_watermark",
            f"must be in (0, 1], got {self.high_watermark}",
        )
        check(
            0.0 < self.low_watermark < self.high_watermark,
            "low_watermark",
            f"must be in (0, high_watermark = {self.high_watermark}), got {self.low_watermark}",
        )
        check(
            0.0 <= self.max_pinned_ratio <= 1.0,
            "max_pinned_ratio",
            f"must be in [0, 1], got {self.max_pinned_ratio}",
        )
        check(self.replica_inbox_bytes >= 0, "replica_inbox_bytes", "must be >= 0")
        check(self.replica_timeout_s > 0, "replica_timeout_s", "must be > 0")
        check(self.replica_max_rows_outside >= 0, "replica_max_rows_outside", "must be >= 0")


# Checksums a manifest may name for its shards (objects/manifest.py).
CHECKSUMS = ("sha256", "blake2b")


@dataclass(frozen=True, slots=True)
class ObjectsConfig:
    """Named objects shared peer to peer (weights, checkpoints): ``objects/``."""

    # An object is cut into shards of this many bytes (the last one shorter),
    # each checked against its own checksum as it lands. Fewer, bigger shards
    # cost less bookkeeping; more, smaller ones spread sooner among peers.
    shard_bytes: int = 64 * 1024 * 1024
    # The shard checksum of objects this node registers ("sha256" is fastest
    # where the CPU has SHA instructions, "blake2b" elsewhere).
    checksum: Literal["sha256", "blake2b"] = "sha256"
    # Shards of one object this node fetches at once.
    max_fetches: int = 4
    # Shard reads one holder serves at once, as an object's origin hands them
    # out (it spreads the rest to other holders or has readers wait).
    max_uploads: int = 8
    # A fetch of a whole object not done by then fails.
    fetch_timeout_s: float = 3600.0
    # One shard read from one holder not done by then fails and the shard is
    # fetched again, from another holder if there is one.
    shard_timeout_s: float = 120.0
    # How long a fetcher with nothing to read waits for a peer that is
    # fetching the shard it needs from the origin, before the origin serves
    # that shard a second time.
    patience_s: float = 2.0
    # Serve every shard this node fetched to peers as soon as it is verified.
    # false: peers read only from the nodes that registered an object (the
    # baseline of tools/bench_objects.py).
    serve_fetched: bool = True
    # HTTP base URLs ("http://host:port") of nodes asked about an object when
    # gossip names nobody: how a node whose model.path is an object finds it
    # at start-up, before it joins the cluster.
    peers: tuple[str, ...] = ()
    # Register model.path as an object of this name when the node starts, so
    # that other nodes can load their model from this one ("": none).
    share_model: str = ""
    # Read and check every shard of the local copies on start, rather than
    # trust the journal of shards checked as they landed.
    verify_on_start: bool = False

    def __post_init__(self) -> None:
        check(
            4096 <= self.shard_bytes <= 1 << 34,
            "shard_bytes",
            f"must be in 4096..{1 << 34}, got {self.shard_bytes}",
        )
        check(self.max_fetches > 0, "max_fetches", "must be > 0")
        check(self.max_uploads > 0, "max_uploads", "must be > 0")
        check(self.fetch_timeout_s > 0, "fetch_timeout_s", "must be > 0")
        check(self.shard_timeout_s > 0, "shard_timeout_s", "must be > 0")
        check(self.patience_s >= 0, "patience_s", "must be >= 0")
        bad = [u for u in self.peers if not u.startswith(("http://", "https://"))]
        check(not bad, "peers", f"must be http(s)://host:port URLs, got {bad}")
        if self.share_model:
            reason = object_name_error(self.share_model)
            check(reason is None, "share_model", f"{reason}")
