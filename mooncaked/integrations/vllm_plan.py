"""The vLLM connector's decisions, without vLLM: its configuration, the
blocks it asks a node for, what each step loads and saves, and which loads
failed.

The scheduler side (``SchedulerBook``) hashes a prompt into mooncaked's
chained block hashes, leases from the node the blocks past vLLM's own
prefix hit and turns vLLM's block allocations into a ``ConnectorMeta`` per
step: ``LoadSpec`` (leased node blocks into a request's vLLM blocks) and
``SaveSpec`` (full prompt blocks computed this step, to be put on the node).
The worker side (``LoadBook``) records each load's outcome as it lands and
says which requests finished loading and which vLLM blocks failed, so vLLM
recomputes them. Everything here is plain data a test drives.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncaked.cache.hashing import BlockHash, block_hashes
from mooncaked.cache.peer import Offer
from mooncaked.secrets import ENV_CLUSTER_SECRET


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """``kv_connector_extra_config``, checked."""

    # The node's HTTP API (its internal calls: lease, reserve, commit).
    node_url: str
    secret: bytes
    # The connector's identity towards the node (its leases and inbox rows
    # are counted under it, as an outside reader and writer).
    name: str
    # The Hugging Face directory whose model id seeds the block hashes
    # (default: the directory vLLM loaded).
    model_dir: str = ""
    # The node's block size: mooncaked blocks are this many tokens.
    block_size: int = 16
    load: bool = True
    save: bool = True
    # Staging rows (node blocks) for loads and for saves: a load longer
    # than its rows is cut to them; a save finding none free is dropped.
    load_rows: int = 256
    save_rows: int = 256
    lease_ttl_s: float = 10.0
    timeout_s: float = 10.0
    transports: tuple[str, ...] = ("shm", "tcp")

    @classmethod
    def from_extra(
        cls, extra: Mapping[str, Any], *, default_name: str, env: Mapping[str, str]
    ) -> ConnectorConfig:
        """ValueError naming the key that is wrong or missing."""
        url = extra.get("node_url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"kv_connector_extra_config.node_url: an http URL, got {url!r}")
        return cls(
            node_url=url.rstrip("/"),
            secret=_secret(extra, env),
            name=str(extra.get("name") or default_name),
            model_dir=str(extra.get("model_dir") or ""),
            block_size=_positive(extra, "block_size", 16),
            load=bool(extra.get("load", True)),
            save=bool(extra.get("save", True)),
            load_rows=_positive(extra, "load_rows", 256),
            save_rows=_positive(extra, "save_rows", 256),
            lease_ttl_s=float(_positive(extra, "lease_ttl_s", 10.0)),
            timeout_s=float(_positive(extra, "timeout_s", 10.0)),
            transports=tuple(extra.get("transports") or ("shm", "tcp")),
        )


def _positive(extra: Mapping[str, Any], key: str, default: float) -> Any:
    value = extra.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"kv_connector_extra_config.{key}: a number > 0, got {value!r}")
    return type(default)(value)


def _secret(extra: Mapping[str, Any], env: Mapping[str, str]) -> bytes:
    """The cluster secret: ``secret``, or the file ``secret_file`` names (this
    user's alone, as the node's), or the node's environment variable."""
    path = extra.get("secret_file")
    if path:
        try:
            with Path(str(path)).open("rb") as f:
                if os.fstat(f.fileno()).st_mode & 0o077:
                    raise ValueError(
                        f"kv_connector_extra_config.secret_file: {path!r} grants group or "
                        f"others access ({stat.filemode(os.fstat(f.fileno()).st_mode)})"
                    )
                text = f.read().decode("utf-8").rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"kv_connector_extra_config.secret_file: {exc}") from None
    else:
        text = str(extra.get("secret") or env.get(ENV_CLUSTER_SECRET, ""))
    if len(text.encode()) < 8:
        raise ValueError(
            "kv_connector_extra_config.secret (or secret_file, or "
            f"{ENV_CLUSTER_SECRET}): the node's cluster secret, at least 8 bytes"
        )
    return text.encode()


def matched_tokens(
    num_prompt: int, num_computed: int, num_node_blocks: int, block_size: int
) -> int:
    """Tokens past vLLM's own hit (``num_computed``) the node's first
    ``num_node_blocks`` blocks cover. The prompt's last token is always left
    to compute: vLLM needs its logits."""
    cap = (max(num_prompt - 1, 0) // block_size) * block_size
    return max(0, min(num_node_blocks * block_size, cap) - num_computed)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Node blocks ``first`` .. ``first + len(offer.offsets) - 1`` of a
    request, leased in ``offer``, into its vLLM blocks ``block_ids``."""

    req_id: str
    block_ids: tuple[int, ...]
    first: int
    offer: Offer

    @property
    def count(self) -> int:
        return self.offer.num_blocks


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Full node blocks ``first`` .. of a request, computed by now, to put on the node."""

    req_id: str
    block_ids: tuple[int, ...]
    first: int
    hashes: tuple[BlockHash, ...]


@dataclass(slots=True)
class ConnectorMeta:
    """One step's work for the worker side."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(slots=True)
class _Request:
    hashes: list[BlockHash]
    num_prompt: int
    block_ids: list[int] = field(default_factory=list)
    # Node blocks known to be on the node (loaded from it) or put there.
    saved: int = 0
    # The lease of the last lookup, and vLLM's hit it was asked past.
    offer: Offer | None = None
    asked_past: int = -1


class SchedulerBook:
    """The scheduler side's state per request, between vLLM's calls."""

    def __init__(
        self, model_id: str, block_size: int, *, max_load_blocks: int, align: int = 0
    ) -> None:
        self.model_id = model_id
        self.block_size = block_size
        # vLLM's block size: a load ends on one of its blocks' edges.
        self.align = align or block_size
        self.max_load_blocks = max_load_blocks
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadSpec] = []
        # Requests scheduled this step -> tokens computed once it ran.
        self._computed: dict[str, int] = {}

    def hashes(self, req_id: str, prompt: Sequence[int]) -> list[BlockHash]:
        """The prompt's block hashes, computed once per request."""
        r = self._requests.get(req_id)
        if r is None:
            r = _Request(block_hashes(list(prompt), self.block_size, self.model_id), len(prompt))
            self._requests[req_id] = r
        return r.hashes

    def to_ask(self, req_id: str, num_computed: int) -> tuple[int, list[BlockHash]] | None:
        """The first block and the hashes to lease past ``num_computed``;
        None when the last answer for this hit stands (vLLM asks again)."""
        r = self._requests[req_id]
        if r.asked_past == num_computed:
            return None
        first = num_computed // self.block_size
        cap = max(r.num_prompt - 1, 0) // self.block_size
        return first, r.hashes[first : min(cap, first + self.max_load_blocks)]

    def offered(self, req_id: str, num_computed: int, offer: Offer | None) -> Offer | None:
        """Record the node's answer; the lease it replaces, to give back."""
        r = self._requests[req_id]
        old, r.offer, r.asked_past = r.offer, offer, num_computed
        return old

    def num_matched(self, req_id: str) -> int:
        r = self._requests[req_id]
        n = r.offer.num_blocks if r.offer else 0
        first = r.asked_past // self.block_size
        n = matched_tokens(r.num_prompt, r.asked_past, first + n, self.block_size)
        end = r.asked_past + n
        return max(0, end - end % self.align - r.asked_past)

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int) -> Offer | None:
        """vLLM allocated ``block_ids`` for the request, ``num_external``
        tokens of them to load. The lease it will not use, to give back."""
        r = self._requests.get(req_id)
        if r is None:
            return None
        offer, r.offer = r.offer, None
        first = max(r.asked_past, 0) // self.block_size
        # vLLM's own hit was computed (and put) before. vLLM calls again once
        # a load landed (num_external 0): what was loaded stays counted.
        r.saved = max(r.saved, first)
        if num_external <= 0 or offer is None:
            return offer
        count = num_external // self.block_size
        if count < offer.num_blocks:
            offer = _cut(offer, count)
        r.block_ids = list(block_ids)
        r.saved = first + count
        self._loads.append(LoadSpec(req_id, tuple(block_ids), first, offer))
        return None

    def scheduled(
        self, req_id: str, block_ids: Sequence[int], num_tokens_after: int, *, replace: bool
    ) -> None:
        """vLLM scheduled the request: its vLLM blocks (all of them when
        ``replace``, else the new ones), and the tokens it will have computed
        after this step."""
        r = self._requests.get(req_id)
        if r is None:
            return
        if replace:
            r.block_ids = list(block_ids)
        else:
            r.block_ids.extend(block_ids)
        self._computed[req_id] = num_tokens_after

    def build(self, *, save: bool) -> ConnectorMeta:
        """This step's loads, and the prompt blocks now computed and not yet
        on the node (when ``save``)."""
        meta = ConnectorMeta(loads=self._loads)
        self._loads = []
        for req_id, computed in self._computed.items():
            r = self._requests[req_id]
            full = min(computed, r.num_prompt) // self.block_size
            if save and full > r.saved:
                meta.saves.append(
                    SaveSpec(req_id, tuple(r.block_ids), r.saved, tuple(r.hashes[r.saved : full]))
                )
            r.saved = max(r.saved, full)
        self._computed.clear()
        return meta

    def finished(self, req_id: str) -> Offer | None:
        """The request is gone; its lease, if it never used it."""
        r = self._requests.pop(req_id, None)
        self._computed.pop(req_id, None)
        return r.offer if r is not None else None

    def num_requests(self) -> int:
        return len(self._requests)


def _cut(offer: Offer, count: int) -> Offer:
    """The first ``count`` blocks of an offer (its lease covers more: the
    release gives them all back)."""
    return Offer(
        offer.peer,
        offer.node_id,
        offer.lease_id,
        offer.offsets[:count],
        offer.block_bytes,
        offer.segment,
        offer.transfer_address,
    )


def failed_vllm_blocks(spec: LoadSpec, num_landed: int, per_vllm_block: int) -> set[int]:
    """The vLLM blocks a load leaves wrong when only its first ``num_landed``
    node blocks landed: every one from the first missing node block on."""
    if num_landed >= spec.count:
        return set()
    first_bad = spec.first + num_landed
    last = spec.first + spec.count - 1
    return {spec.block_ids[k // per_vllm_block] for k in range(first_bad, last + 1)}


class LoadBook:
    """The worker side's loads in flight and their outcomes. ``landed`` is
    called from the connector's I/O thread, ``take`` from vLLM's."""

    def __init__(self, per_vllm_block: int) -> None:
        self._per = per_vllm_block
        self._lock = threading.Lock()
        self._in_flight: dict[str, LoadSpec] = {}
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._bad_blocks: set[int] = set()
        self.blocks_loaded = 0
        self.bytes_loaded = 0
        self.blocks_failed = 0

    def started(self, spec: LoadSpec) -> None:
        with self._lock:
            self._in_flight[spec.req_id] = spec

    def landed(self, req_id: str, num_landed: int) -> None:
        """The load ended with its first ``num_landed`` node blocks in place."""
        with self._lock:
            spec = self._in_flight.pop(req_id)
            bad = failed_vllm_blocks(spec, num_landed, self._per)
            self._finished.add(req_id)
            if bad:
                self._failed.add(req_id)
                self._bad_blocks |= bad
                self.blocks_failed += spec.count - num_landed
            self.blocks_loaded += num_landed
            self.bytes_loaded += num_landed * spec.offer.block_bytes

    def take(self) -> tuple[set[str], set[str], set[int]]:
        """Requests finished loading since the last take, those of them that
        failed, and the vLLM blocks to recompute."""
        with self._lock:
            out = (self._finished, self._failed, self._bad_blocks)
            self._finished, self._failed, self._bad_blocks = set(), set(), set()
            return out

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)
