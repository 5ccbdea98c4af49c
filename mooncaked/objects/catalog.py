"""The cluster's objects as this node's gossip view has them: each manifest, and
which node holds which of its shards (``ObjectAd``s in members' segment lists).

Ads are parsed once per (member, generation, segment-list version) and kept
until that changes. Down members hold nothing. This node's own copies come
from the caller (``own``), fresher than gossip's echo of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import structlog

from mooncaked.cluster.state import ClusterView
from mooncaked.objects.manifest import Manifest, ShardSet
from mooncaked.objects.messages import ObjectAd, is_ad

log = structlog.get_logger(__name__)

ViewGetter = Callable[[], ClusterView | None]


@dataclass(frozen=True, slots=True)
class Copy:
    """One node's copy of an object, whole or in part."""

    node_id: str
    have: ShardSet
    # Its transfer endpoint, and its HTTP API's host:port ("" when unknown).
    address: str
    api_addr: str = ""


@dataclass(slots=True)
class Entry:
    manifest: Manifest
    copies: dict[str, Copy] = field(default_factory=dict)


class Catalog:
    def __init__(self, view: ViewGetter, node_id: Callable[[], str]) -> None:
        self._view = view
        self._node_id = node_id
        # member -> ((generation, segments version), its ads)
        self._parsed: dict[str, tuple[tuple[int, int], list[ObjectAd]]] = {}

    def entries(self, own: Iterable[tuple[ObjectAd, str]] = ()) -> dict[tuple[str, int], Entry]:
        """Every (name, version) known, with its copies; ``own``: this node's
        copies, each with this node's API address."""
        out: dict[tuple[str, int], Entry] = {}
        me = self._node_id()
        for ad, api_addr in own:
            self._add(out, me, ad, api_addr)
        view = self._view()
        if view is None:
            return out
        seen: set[str] = set()
        for m in view.members.values():
            if m.node_id == me or not m.is_up or m.state is None:
                continue
            seen.add(m.node_id)
            for ad in self._ads(m.node_id, m.generation, m.segments_version, m.segments):
                self._add(out, m.node_id, ad, m.state.api_addr)
        for gone in set(self._parsed) - seen:
            del self._parsed[gone]
        return out

    def newest(self, name: str, own: Iterable[tuple[ObjectAd, str]] = ()) -> Entry | None:
        """The newest version of ``name`` known (ties: the origin's id decides)."""
        found = [e for (n, _), e in self.entries(own).items() if n == name]
        if not found:
            return None
        return max(found, key=lambda e: (e.manifest.version, e.manifest.origin))

    @staticmethod
    def _add(out: dict[tuple[str, int], Entry], node: str, ad: ObjectAd, api_addr: str) -> None:
        entry = out.get(ad.manifest.ref)
        if entry is None:
            entry = out[ad.manifest.ref] = Entry(ad.manifest)
        elif entry.manifest.digest != ad.manifest.digest:
            # Two origins registered one name at the same version: keep the first seen.
            return
        entry.copies[node] = Copy(node, ad.have, ad.address, api_addr)

    def _ads(self, node: str, gen: int, version: int, segments: Iterable[object]) -> list[ObjectAd]:
        cached = self._parsed.get(node)
        if cached is not None and cached[0] == (gen, version):
            return cached[1]
        ads: list[ObjectAd] = []
        for entry in segments:
            if not isinstance(entry, dict) or not is_ad(entry):
                continue
            try:
                ads.append(ObjectAd.from_dict(entry))
            except ValueError as exc:
                log.warning("object ad ignored", node=node, error=str(exc))
        self._parsed[node] = ((gen, version), ads)
        return ads
