"""The wire forms of ``mooncaked.handoff``'s values: prefill targets with
their offers, KV grants, and a request's ask that its prompt be retained.

``handoff.py`` keeps the values; these are their one encoder and decoder
each (a pipelined group's stages too). An offer travels as ``PrefillOffer.to_list()``, the same four figures
``/admin/explain`` shows.
"""

from __future__ import annotations

from typing import Any

from mooncaked.handoff import (
    MAX_REPLICAS,
    MAX_RETAIN_S,
    KVGrant,
    KVLayout,
    PrefillOffer,
    PrefillTarget,
    Retain,
    StageRef,
)
from mooncaked.wire import fields

# Most blocks one grant may name (a 1M-token prompt in 16-token blocks).
MAX_GRANT_BLOCKS = 1 << 16
# Longest grant a decode node gives: the same bound as its KV-ready forecast.
MAX_GRANT_TTL_S = 3600.0
# A grant's fields that are names (ids, an address): non-empty strings.
_GRANT_NAMES = ("request_id", "node_id", "transfer_address", "segment")
_OFFER = "[ttft_s, move_s, rest_s, slack]"
_LAYOUT = "[num_layers, num_blocks, block_size, row_bytes]"
# Bounds of each layout figure, in _LAYOUT's order.
_LAYOUT_BOUNDS = ((1, 1 << 12), (1, 1 << 30), (1, 1 << 16), (1, 1 << 24))


def encode_retain(retain: Retain) -> dict[str, Any]:
    return {"retain_s": retain.retain_s, "replicas": retain.replicas}


def decode_retain(raw: Any, name: str = "retain") -> Retain | None:
    """``{"retain_s", "replicas"}`` or absent; ValueError naming the field."""
    if raw is None:
        return None
    d = fields.obj(raw, name)
    return Retain(
        fields.number(
            d.get("retain_s"), f"{name}.retain_s", 0.0, MAX_RETAIN_S, above=True, unit="seconds"
        ),
        fields.integer(d.get("replicas", 1), f"{name}.replicas", 1, MAX_REPLICAS),
    )


def decode_offer(raw: Any, name: str = "offer") -> PrefillOffer:
    """Four finite numbers >= 0; ValueError naming the offer otherwise."""
    if not isinstance(raw, list) or len(raw) != 4:
        raise fields.refuse(name, _OFFER, raw)
    ttft_s, move_s, rest_s, slack = (fields.number(v, f"{name}[{i}]") for i, v in enumerate(raw))
    return PrefillOffer(ttft_s, move_s, rest_s, slack)


def encode_target(target: PrefillTarget) -> dict[str, Any]:
    out: dict[str, Any] = {"node_id": target.node_id, "url": target.url, "fetch": target.fetch}
    if target.offer is not None:
        out["offer"] = target.offer.to_list()
    if target.stages:
        out["stages"] = [encode_stage(s) for s in target.stages]
    return out


def decode_target(raw: Any, name: str = "target") -> PrefillTarget:
    d = fields.obj(raw, name)
    offer = d.get("offer")
    stages = d.get("stages")
    node_id = fields.text(d.get("node_id"), f"{name}.node_id")
    refs = () if stages is None else decode_stages(stages, f"{name}.stages")
    if refs and refs[0].node_id != node_id:
        raise fields.refuse(f"{name}.stages[0][0]", f"the target's own id {node_id!r}", refs[0])
    return PrefillTarget(
        node_id=node_id,
        url=fields.text(d.get("url"), f"{name}.url", 2048),
        fetch=fields.flag(d.get("fetch", True), f"{name}.fetch"),
        offer=None if offer is None else decode_offer(offer, f"{name}.offer"),
        stages=refs,
    )


# A pipelined group's stages: at most as many as the config allows.
MAX_STAGES = 16
_STAGE = "[node_id, url, layer_lo, layer_hi]"


def encode_stage(ref: StageRef) -> list[Any]:
    return [ref.node_id, ref.url, ref.layer_lo, ref.layer_hi]


def decode_stages(raw: Any, name: str = "stages") -> tuple[StageRef, ...]:
    """A pipelined group's stages, head first: each ``[node_id, url, lo, hi]``,
    their layers one after the other from 0."""
    if not isinstance(raw, list) or not 2 <= len(raw) <= MAX_STAGES:
        raise fields.refuse(name, f"a list of 2..{MAX_STAGES} stages", raw)
    out: list[StageRef] = []
    at = 0
    for i, item in enumerate(raw):
        where = f"{name}[{i}]"
        if not isinstance(item, list) or len(item) != 4:
            raise fields.refuse(where, _STAGE, item)
        node_id = fields.text(item[0], f"{where}[0]")
        url = fields.text(item[1], f"{where}[1]", 2048)
        lo = fields.integer(item[2], f"{where}[2]", at, at)
        hi = fields.integer(item[3], f"{where}[3]", lo + 1, 1 << 12)
        out.append(StageRef(node_id, url, lo, hi))
        at = hi
    return tuple(out)


def encode_grant(grant: KVGrant) -> dict[str, Any]:
    lay = grant.layout
    return {
        **{key: getattr(grant, key) for key in _GRANT_NAMES},
        "layout": [lay.num_layers, lay.num_blocks, lay.block_size, lay.row_bytes],
        "first_block": grant.first_block,
        "block_ids": list(grant.block_ids),
        "ttl_s": grant.ttl_s,
    }


def decode_grant(raw: Any, name: str = "grant") -> KVGrant:
    """A grant a decode node sent, every figure bounded; ValueError naming the field."""
    d = fields.obj(raw, name)
    lay = d.get("layout")
    if not isinstance(lay, list) or len(lay) != 4:
        raise fields.refuse(f"{name}.layout", _LAYOUT, lay)
    num_layers, num_blocks, block_size, row_bytes = (
        fields.integer(v, f"{name}.layout[{i}]", lo, hi)
        for i, (v, (lo, hi)) in enumerate(zip(lay, _LAYOUT_BOUNDS, strict=True))
    )
    layout = KVLayout(num_layers, num_blocks, block_size, row_bytes)
    ids = fields.integers(
        d.get("block_ids"), f"{name}.block_ids", min_len=1, max_len=MAX_GRANT_BLOCKS
    )
    if any(b >= num_blocks for b in ids):
        raise fields.refuse(f"{name}.block_ids", f"block ids below {num_blocks}", ids)
    return KVGrant(
        **{key: fields.text(d.get(key), f"{name}.{key}") for key in _GRANT_NAMES},
        layout=layout,
        first_block=fields.integer(d.get("first_block"), f"{name}.first_block", 0, 1 << 30),
        block_ids=tuple(ids),
        ttl_s=fields.number(
            d.get("ttl_s"), f"{name}.ttl_s", 0.0, MAX_GRANT_TTL_S, above=True, unit="seconds"
        ),
    )
