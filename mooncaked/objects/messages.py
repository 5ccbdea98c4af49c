"""What nodes tell each other about objects: the swarm call and its answer,
and the advertisement of a copy that gossip spreads.

- ``POST /internal/objects/swarm`` with a ``SwarmCall`` -> a ``SwarmAnswer``:
  a fetcher tells an object's origin (its coordinator) what it holds, what it
  is reading and which holders failed it, and gets up to ``slots`` shards to
  read next, each with its holder's transfer address (``assign``). A node
  that does not coordinate the object answers ``coordinator`` false, with
  the manifest it knows and the coordinator's URL (``redirect``) where it
  knows it, or 404 when it knows no such object.
- ``ObjectAd``: one entry of a node's gossiped segment list per copy it holds
  (whole or in part): the manifest, the shards held, the transfer address.
  Gossip carries segment lists apart from its datagrams: a change bumps a
  version number in the node's state, and peers pull the list over the
  authenticated TCP channel, so a manifest of thousands of checksums never
  has to fit a 1400-byte datagram.

Decoders raise ``ValueError`` naming the field (``wire.fields``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from mooncaked.config import check_object_name
from mooncaked.objects.manifest import MAX_SHARDS, Manifest, ShardSet
from mooncaked.wire import fields

# The ``kind`` of a gossiped segment entry that advertises an object copy.
AD_KIND = "object"
# Most holders a fetcher may tell the coordinator it avoids.
_MAX_AVOID = 4096


@dataclass(frozen=True, slots=True)
class SwarmCall:
    name: str
    # 0: the newest version the callee knows (the answer carries its manifest).
    version: int
    # The caller, and where peers read from it.
    node: str
    address: str
    # The shards it holds, as ``ShardSet.hex`` ("" before it knows the manifest).
    have: str
    # Whether it serves what it holds (objects.serve_fetched).
    serves: bool
    # Shards it is reading now.
    fetching: tuple[int, ...] = ()
    # (shard, holder) pairs that gave it bad bytes, and holders it could not reach.
    avoid: tuple[tuple[int, str], ...] = ()
    avoid_nodes: tuple[str, ...] = ()
    # Shards it wants to be handed (0: a report only).
    slots: int = 0
    # How long the coordinator may hold the call while it has nothing to hand out.
    wait_s: float = 0.0

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "name": self.name,
                "version": self.version,
                "node": self.node,
                "address": self.address,
                "have": self.have,
                "serves": self.serves,
                "fetching": list(self.fetching),
                "avoid": [list(p) for p in self.avoid],
                "avoid_nodes": list(self.avoid_nodes),
                "slots": self.slots,
                "wait_s": self.wait_s,
            }
        )

    @classmethod
    def decode(cls, data: dict[str, Any]) -> SwarmCall:
        name = fields.text(data.get("name"), "name", 256)
        try:
            check_object_name(name)
        except ValueError as exc:
            raise ValueError(f"'name': {exc}") from None
        raw_avoid = data.get("avoid")
        if not isinstance(raw_avoid, list) or len(raw_avoid) > _MAX_AVOID:
            raise fields.refuse("avoid", f"a list of at most {_MAX_AVOID} [shard, node]", raw_avoid)
        avoid = []
        for i, pair in enumerate(raw_avoid):
            if not isinstance(pair, list) or len(pair) != 2:
                raise fields.refuse(f"avoid[{i}]", "a [shard, node] pair", pair)
            avoid.append(
                (
                    fields.integer(pair[0], f"avoid[{i}][0]", 0, MAX_SHARDS),
                    fields.text(pair[1], f"avoid[{i}][1]"),
                )
            )
        nodes = data.get("avoid_nodes")
        if not isinstance(nodes, list) or len(nodes) > _MAX_AVOID:
            raise fields.refuse("avoid_nodes", "a list of node ids", nodes)
        return cls(
            name=name,
            version=fields.integer(data.get("version"), "version", 0),
            node=fields.text(data.get("node"), "node"),
            address=fields.text(data.get("address"), "address"),
            have=fields.text(data.get("have"), "have", MAX_SHARDS // 4, empty=True),
            serves=fields.flag(data.get("serves"), "serves"),
            fetching=tuple(fields.integers(data.get("fetching"), "fetching", max_len=MAX_SHARDS)),
            avoid=tuple(avoid),
            avoid_nodes=tuple(fields.text(n, f"avoid_nodes[{i}]") for i, n in enumerate(nodes)),
            slots=fields.integer(data.get("slots"), "slots", 0, 1024),
            wait_s=fields.number(data.get("wait_s"), "wait_s", 0.0, 600.0, unit="seconds"),
        )


@dataclass(frozen=True, slots=True)
class Grant:
    """One shard to read, and from whom."""

    shard: int
    node: str
    address: str


@dataclass(frozen=True, slots=True)
class SwarmAnswer:
    # Sent when the call named no version (the caller's first call).
    manifest: Manifest | None = None
    assign: tuple[Grant, ...] = ()
    # Whether the callee coordinates the object's fetches (its origin).
    coordinator: bool = True
    # Else the coordinator's API URL, where the callee knows it ("": it does not).
    redirect: str = ""

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "manifest": self.manifest.to_dict() if self.manifest is not None else None,
                "assign": [[g.shard, g.node, g.address] for g in self.assign],
                "coordinator": self.coordinator,
                "redirect": self.redirect,
            }
        )

    @classmethod
    def decode(cls, data: dict[str, Any]) -> SwarmAnswer:
        raw = data.get("manifest")
        manifest = None
        if raw is not None:
            try:
                manifest = Manifest.from_dict(fields.obj(raw, "manifest"))
            except ValueError as exc:
                raise ValueError(f"'manifest': {exc}") from None
        grants = data.get("assign")
        if not isinstance(grants, list):
            raise fields.refuse("assign", "a list of [shard, node, address]", grants)
        assign = []
        for i, g in enumerate(grants):
            if not isinstance(g, list) or len(g) != 3:
                raise fields.refuse(f"assign[{i}]", "a [shard, node, address] triple", g)
            assign.append(
                Grant(
                    fields.integer(g[0], f"assign[{i}][0]", 0, MAX_SHARDS),
                    fields.text(g[1], f"assign[{i}][1]"),
                    fields.text(g[2], f"assign[{i}][2]"),
                )
            )
        return cls(
            manifest=manifest,
            assign=tuple(assign),
            coordinator=fields.flag(data.get("coordinator"), "coordinator"),
            redirect=fields.text(data.get("redirect"), "redirect", 1024, empty=True),
        )


@dataclass(frozen=True, slots=True)
class ObjectAd:
    """A node's copy of an object, as gossip spreads it."""

    manifest: Manifest
    have: ShardSet
    # The node's transfer endpoint.
    address: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": AD_KIND,
            "manifest": self.manifest.to_dict(),
            "have": self.have.hex(),
            "address": self.address,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ObjectAd:
        manifest = Manifest.from_dict(fields.obj(data.get("manifest"), "manifest"))
        return cls(
            manifest,
            ShardSet.from_hex(data.get("have"), manifest.num_shards),
            fields.text(data.get("address"), "address"),
        )


def is_ad(entry: Mapping[str, Any]) -> bool:
    return entry.get("kind") == AD_KIND
