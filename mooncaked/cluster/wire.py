"""The gossip wire format: authenticated packets of typed frames.

A packet (one UDP datagram, or one length-prefixed TCP message) is::

    mac[16] | b"MG" | wire version u8 | sender id length u8 | sender id | frames

and each frame is ``kind u8 | length u32 | payload``. The MAC is keyed
BLAKE2b-128 over everything after it, with a key derived from the cluster
secret; it is checked before anything else is parsed, so a forgery costs one
hash and never reaches the decoders. Control frames are orjson objects;
block deltas are packed binary (``BlockDelta``), because they are the bulk of
the traffic and must decode at millions of entries per second.

Every decoder validates types and lengths and raises ``WireError`` (a
ValueError) on anything else: the caller counts and drops, it never crashes.
Every number is bounded too (``BoundsError``, a WireError the caller counts
apart from garbage): a signed peer must not be able to plant a value that
breaks an invariant later, such as an incarnation whose refutation (one
more) no longer encodes. Replays are not detected; they are harmless because
every accepted update is ordered by incarnation or version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from mooncaked.cache.hashing import BLOCK_HASH_BYTES
from mooncaked.cluster.block_index import ALL_TIERS_MASK, BlockDelta
from mooncaked.cluster.costs import MAX_LINKS, NodeCosts, StepCost
from mooncaked.cluster.forecast import FORECAST_HORIZONS_S, DecodeForecast
from mooncaked.cluster.state import (
    AttentionShape,
    MemoryInfo,
    NodeLoad,
    NodeState,
    OffloadInfo,
    StageInfo,
)

MAC_BYTES = 16
MAGIC = b"MG"
WIRE_VERSION = 1
MAX_NODE_ID_BYTES = 255

FRAME_MSG = 1
FRAME_BLOCKS = 2

FRAME_HEAD = struct.Struct("<BI")
_DELTA_HEAD = struct.Struct("<QQQIIB")
# A TCP message is prefixed with its length.
TCP_LEN = struct.Struct("<I")

# The largest integer any field may carry: every JSON reader holds it exactly,
# and counting up from it (a version, a sequence number) still encodes.
MAX_COUNT = 2**53 - 1
# Incarnations and generations (a process starts both at its start time in
# milliseconds, ~2^41). An accusation (suspect, dead) may name at most
# MAX_INCARNATION - 1, so that the accused's refutation, one more, is itself
# a valid incarnation everywhere.
MAX_INCARNATION = MAX_COUNT
# Chunks one pull reply may announce (each up to ``max_sync_bytes``).
MAX_PULL_CHUNKS = 1 << 16
# Bytes whose value is a valid tier mask.
_VALID_MASKS = bytes(range(ALL_TIERS_MASK + 1))


class WireError(ValueError):
    """A packet or frame that is malformed, oversized or not authentic."""


class AuthError(WireError):
    """The MAC did not match: a forgery, a corruption, or another cluster's secret."""


class BoundsError(WireError):
    """A well-formed message with a value out of bounds, or one that breaks an invariant."""


def derive_key(secret: bytes) -> bytes:
    if len(secret) < 8:
        raise ValueError("the cluster secret must be at least 8 bytes")
    return hashlib.blake2b(secret, digest_size=32, person=b"mooncaked.gossip").digest()


class Codec:
    """Seals and opens packets for one node under the cluster key."""

    __slots__ = ("_header", "_key")

    def __init__(self, secret: bytes, node_id: str) -> None:
        self._key = derive_key(secret)
        raw_id = node_id.encode("utf-8")
        if not raw_id or len(raw_id) > MAX_NODE_ID_BYTES:
            raise ValueError(
                f"node id must be 1..{MAX_NODE_ID_BYTES} bytes of UTF-8, got {node_id!r}"
            )
        self._header = MAGIC + bytes((WIRE_VERSION, len(raw_id))) + raw_id

    def seal(self, frames: Iterable[bytes]) -> bytes:
        body = self._header + b"".join(frames)
        mac = hashlib.blake2b(body, key=self._key, digest_size=MAC_BYTES).digest()
        return mac + body

    @property
    def overhead(self) -> int:
        return MAC_BYTES + len(self._header)

    def open(self, packet: bytes, max_bytes: int) -> tuple[str, list[tuple[int, memoryview]]]:
        """Verify and split a packet; returns (sender id, [(frame kind, payload)])."""
        if len(packet) > max_bytes:
            raise WireError(f"packet of {len(packet)} bytes exceeds the {max_bytes} byte limit")
        if len(packet) < MAC_BYTES + 4:
            raise WireError("packet too short")
        view = memoryview(packet)
        body = view[MAC_BYTES:]
        mac = hashlib.blake2b(body, key=self._key, digest_size=MAC_BYTES).digest()
        if not hmac.compare_digest(mac, view[:MAC_BYTES]):
            raise AuthError("bad MAC")
        sender, pos = _read_header(body)
        frames: list[tuple[int, memoryview]] = []
        end = len(body)
        while pos < end:
            if pos + FRAME_HEAD.size > end:
                raise WireError("truncated frame header")
            kind, length = FRAME_HEAD.unpack_from(body, pos)
            pos += FRAME_HEAD.size
            if pos + length > end:
                raise WireError("truncated frame")
            frames.append((kind, body[pos : pos + length]))
            pos += length
        return sender, frames


def _read_header(body: memoryview) -> tuple[str, int]:
    """The sender id of a packet body (after the MAC), and where its frames start."""
    if body[:2] != MAGIC or body[2] != WIRE_VERSION:
        raise WireError("unknown magic or wire version")
    id_len = body[3]
    pos = 4 + id_len
    if id_len == 0 or pos > len(body):
        raise WireError("bad sender id")
    try:
        sender = bytes(body[4:pos]).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("sender id is not UTF-8") from None
    return sender, pos


def peek_sender(packet: bytes) -> str | None:
    """The sender id a packet claims, NOT verified (None if it names none).

    For packet filters that stage partitions in tests; trust only ``Codec.open``.
    """
    if len(packet) < MAC_BYTES + 4:
        return None
    try:
        return _read_header(memoryview(packet)[MAC_BYTES:])[0]
    except WireError:
        return None


def msg_frame(obj: Mapping[str, Any]) -> bytes:
    payload = orjson.dumps(obj)
    return FRAME_HEAD.pack(FRAME_MSG, len(payload)) + payload


def reframe(kind: int, payload: memoryview) -> bytes:
    """A received frame as bytes again, to pass it on unchanged."""
    return FRAME_HEAD.pack(kind, len(payload)) + bytes(payload)


def blocks_frame(delta: BlockDelta) -> bytes:
    raw_id = delta.node_id.encode("utf-8")
    n = delta.num_entries
    head = (
        bytes((len(raw_id),))
        + raw_id
        + _DELTA_HEAD.pack(
            delta.generation,
            delta.from_version,
            delta.to_version,
            n,
            delta.num_upserts,
            1 if delta.is_snapshot else 0,
        )
    )
    length = len(head) + len(delta.hashes) + n
    return b"".join((FRAME_HEAD.pack(FRAME_BLOCKS, length), head, delta.hashes, delta.masks))


def blocks_frame_size(node_id: str, num_entries: int) -> int:
    return (
        FRAME_HEAD.size
        + 1
        + len(node_id.encode("utf-8"))
        + _DELTA_HEAD.size
        + num_entries * (BLOCK_HASH_BYTES + 1)
    )


def decode_msg(payload: memoryview) -> dict[str, Any]:
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise WireError("control frame is not JSON") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("t"), str):
        raise WireError("control frame is not an object with a type")
    return obj


def decode_blocks(payload: memoryview) -> BlockDelta:
    if len(payload) < 1:
        raise WireError("empty block frame")
    id_len = payload[0]
    pos = 1 + id_len
    if id_len == 0 or pos + _DELTA_HEAD.size > len(payload):
        raise WireError("truncated block frame")
    try:
        node_id = bytes(payload[1:pos]).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("block frame node id is not UTF-8") from None
    generation, from_v, to_v, n, n_up, flags = _DELTA_HEAD.unpack_from(payload, pos)
    pos += _DELTA_HEAD.size
    if len(payload) - pos != n * (BLOCK_HASH_BYTES + 1):
        raise WireError("block frame length does not match its entry count")
    if n_up > n or from_v > to_v or flags > 1:
        raise BoundsError("inconsistent block frame header")
    if not 0 < generation <= MAX_INCARNATION or to_v > MAX_COUNT:
        raise BoundsError(f"block frame generation {generation} or version {to_v} out of bounds")
    split = pos + n * BLOCK_HASH_BYTES
    masks = bytes(payload[split:])
    if masks.translate(None, _VALID_MASKS):
        raise BoundsError("block frame carries a tier mask beyond the known tiers")
    return BlockDelta(
        node_id,
        generation,
        from_v,
        to_v,
        bytes(payload[pos:split]),
        masks,
        n_up,
        is_snapshot=bool(flags),
    )


# ---- typed field access for control messages -------------------------------------------


def get_str(obj: Mapping[str, Any], key: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or not v:
        raise WireError(f"field {key!r} must be a non-empty string")
    return v


def get_int(obj: Mapping[str, Any], key: str, maximum: int = MAX_COUNT, minimum: int = 0) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise WireError(f"field {key!r} must be an integer")
    if not minimum <= v <= maximum:
        raise BoundsError(f"field {key!r} = {v} is outside {minimum}..{maximum}")
    return v


def get_incarnation(obj: Mapping[str, Any], key: str = "inc", *, accusation: bool = False) -> int:
    """An incarnation; one in an accusation stays below the top so its refutation is valid."""
    return get_int(obj, key, MAX_INCARNATION - 1 if accusation else MAX_INCARNATION)


def get_generation(obj: Mapping[str, Any], key: str = "gen") -> int:
    return get_int(obj, key, MAX_INCARNATION, minimum=1)


def get_member(
    obj: Mapping[str, Any], *, accusation: bool = False
) -> tuple[str, int, int, tuple[str, int]]:
    """(node id, incarnation, generation, address) of an alive message or a sync entry."""
    node_id = get_str(obj, "node")
    inc = get_incarnation(obj, accusation=accusation)
    gen = get_generation(obj)
    if inc < gen:
        # A process starts its incarnation at its generation and only raises it.
        raise BoundsError(f"incarnation {inc} of {node_id!r} is below its generation {gen}")
    return node_id, inc, gen, get_addr(obj, "addr")


def get_float(
    obj: Mapping[str, Any], key: str, minimum: float = 0.0, maximum: float = float(MAX_COUNT)
) -> float:
    v = obj.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise WireError(f"field {key!r} must be a number")
    if not minimum <= v <= maximum:
        raise BoundsError(f"field {key!r} = {v} is outside {minimum}..{maximum}")
    return float(v)


def get_addr(obj: Mapping[str, Any], key: str) -> tuple[str, int]:
    v = obj.get(key)
    if (
        not isinstance(v, list)
        or len(v) != 2
        or not isinstance(v[0], str)
        or not v[0]
        or not isinstance(v[1], int)
        or isinstance(v[1], bool)
    ):
        raise WireError(f"field {key!r} must be [host, port]")
    if not 0 < v[1] < 65536:
        raise BoundsError(f"field {key!r}: port {v[1]} is outside 1..65535")
    return (v[0], v[1])


def parse_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise WireError(f"{text!r} is not host:port")
    return (host, int(port))


# NodeLoad's fields in wire order, each bounded on decode like every number.
_LOAD_FIELDS = dataclasses.fields(NodeLoad)
# The fields every sender has sent since the load had a wire form; those
# added later (dram_free_blocks) may be missing from an older node's list
# and take their defaults, so a cluster can be upgraded node by node.
_MIN_LOAD_FIELDS = 6


def _load_from_list(values: list[Any]) -> NodeLoad:
    fields = _LOAD_FIELDS[: len(values)]
    obj = dict(zip((f.name for f in fields), values, strict=True))
    return NodeLoad(
        **{
            f.name: (
                get_int(obj, f.name)
                if f.type in (int, "int")
                else get_float(obj, f.name, maximum=f.metadata.get("max", float(MAX_COUNT)))
            )
            for f in fields
        }
    )


def state_to_json(st: NodeState) -> dict[str, Any]:
    load = st.load
    return {
        "node": st.node_id,
        "gen": st.generation,
        "ver": st.version,
        "gaddr": st.gossip_addr,
        "role": st.role,
        "model": st.model_id,
        "api": st.api_addr,
        "drain": st.draining,
        "load": load.to_list(),
        "bver": st.block_version,
        "nblk": st.num_blocks,
        "sver": st.segments_version,
        "costs": st.costs.to_list(),
        "fc": [list(st.forecast.batch), list(st.forecast.context_tokens)],
        **({"stage": st.stage.to_list()} if st.stage is not None else {}),
        # Attention offloading: sent only by the nodes it concerns, so older
        # nodes' states (without them) still decode, and theirs here.
        **({"mem": st.memory.to_list()} if st.memory is not None else {}),
        **({"offl": st.offload.to_list()} if st.offload is not None else {}),
    }


def state_from_json(obj: Mapping[str, Any]) -> NodeState:
    load = obj.get("load")
    if not isinstance(load, list) or not _MIN_LOAD_FIELDS <= len(load) <= len(_LOAD_FIELDS):
        raise WireError(
            f"field 'load' must be a list of {_MIN_LOAD_FIELDS}..{len(_LOAD_FIELDS)} numbers"
        )
    drain = obj.get("drain")
    if not isinstance(drain, bool):
        raise WireError("field 'drain' must be a boolean")
    role, model, api = obj.get("role"), obj.get("model"), obj.get("api")
    if not isinstance(role, str) or not isinstance(model, str) or not isinstance(api, str):
        raise WireError("fields 'role', 'model', 'api' must be strings")
    return NodeState(
        node_id=get_str(obj, "node"),
        generation=get_generation(obj),
        version=get_int(obj, "ver"),
        gossip_addr=get_str(obj, "gaddr"),
        role=role,
        model_id=model,
        api_addr=api,
        draining=drain,
        load=_load_from_list(load),
        block_version=get_int(obj, "bver"),
        num_blocks=get_int(obj, "nblk"),
        segments_version=get_int(obj, "sver"),
        costs=_costs_from_list(obj.get("costs")),
        forecast=_forecast_from_list(obj.get("fc")),
        stage=_stage_from_list(obj.get("stage")),
        memory=_memory_from_list(obj.get("mem")),
        offload=_offload_from_list(obj.get("offl")),
    )


# Bounds of a gossiped KV shape: what no model comes near.
_SHAPE_NAMES = ("layers", "heads", "kv_heads", "head_dim", "dtype", "block")
_SHAPE_DTYPES = ("float32", "float16", "bfloat16")
_MAX_HEADS = 1 << 10
_MAX_HEAD_DIM = 1 << 12
_MAX_BLOCK = 1 << 12
_MAX_MICRO_BATCHES = 8
# A memory node's figures: its attention service's address, bytes and rates.
_MEMORY_NAMES = ("addr", "total", "free", "seqs", "bps", "model", "shape")


def _known_prefix(values: Any, key: str, names: tuple[str, ...]) -> dict[str, Any]:
    """A gossiped list as ``names`` -> value. A newer node may append items:
    those past ``names`` are ignored, so the list can grow compatibly."""
    if not isinstance(values, list) or len(values) < len(names):
        raise WireError(f"field {key!r} must be a list of at least {len(names)} items")
    return dict(zip(names, values[: len(names)], strict=True))


def _shape_from_list(values: Any, key: str) -> AttentionShape:
    obj = _known_prefix(values, key, _SHAPE_NAMES)
    dtype = get_str(obj, "dtype")
    if dtype not in _SHAPE_DTYPES:
        raise BoundsError(f"field {key!r}: KV dtype {dtype!r} is not one of {_SHAPE_DTYPES}")
    heads = get_int(obj, "heads", maximum=_MAX_HEADS, minimum=1)
    kv_heads = get_int(obj, "kv_heads", maximum=heads, minimum=1)
    if heads % kv_heads:
        raise BoundsError(f"field {key!r}: {heads} heads do not share {kv_heads} KV heads")
    return AttentionShape(
        get_int(obj, "layers", maximum=_MAX_LAYERS, minimum=1),
        heads,
        kv_heads,
        get_int(obj, "head_dim", maximum=_MAX_HEAD_DIM, minimum=1),
        dtype,
        get_int(obj, "block", maximum=_MAX_BLOCK, minimum=1),
    )


def _memory_from_list(values: Any) -> MemoryInfo | None:
    """``MemoryInfo.to_list`` back, every number bounded; absent: not a memory node."""
    if values is None:
        return None
    obj = _known_prefix(values, "mem", _MEMORY_NAMES)
    addr = get_str(obj, "addr")
    parse_addr(addr)
    total = get_int(obj, "total")
    model = obj["model"]
    if not isinstance(model, str):
        raise WireError("field 'model' must be a string")
    shape = obj["shape"]
    return MemoryInfo(
        attention_addr=addr,
        total_bytes=total,
        free_bytes=get_int(obj, "free", maximum=total),
        num_seqs=get_int(obj, "seqs"),
        kv_read_bps=get_float(obj, "bps"),
        model=model,
        shape=None if shape is None else _shape_from_list(shape, "mem.shape"),
    )


def _offload_from_list(values: Any) -> OffloadInfo | None:
    """``OffloadInfo.to_list`` back; absent: the node does not offload by placement."""
    if values is None:
        return None
    obj = _known_prefix(values, "offl", ("shape", "micro"))
    return OffloadInfo(
        _shape_from_list(obj["shape"], "offl.shape"),
        get_int(obj, "micro", maximum=_MAX_MICRO_BATCHES, minimum=1),
    )


_STAGE_NAMES = ("idx", "n", "lo", "hi", "layers", "actb", "chunk", "rows")
# Most stages of a group, and layers of a model, a node may claim.
_MAX_STAGES = 16
_MAX_LAYERS = 1 << 12


def _stage_from_list(values: Any) -> StageInfo | None:
    """``StageInfo.to_list`` back, every number bounded; absent: not a stage."""
    if values is None:
        return None
    if not isinstance(values, list) or len(values) != len(_STAGE_NAMES) + 1:
        raise WireError(f"field 'stage' must be a list of {len(_STAGE_NAMES) + 1} items")
    obj = dict(zip(("group", *_STAGE_NAMES), values, strict=True))
    group = get_str(obj, "group")
    num_stages = get_int(obj, "n", maximum=_MAX_STAGES, minimum=2)
    num_layers = get_int(obj, "layers", maximum=_MAX_LAYERS, minimum=1)
    index = get_int(obj, "idx", maximum=num_stages - 1)
    lo = get_int(obj, "lo", maximum=num_layers - 1)
    hi = get_int(obj, "hi", maximum=num_layers, minimum=lo + 1)
    return StageInfo(
        group,
        index,
        num_stages,
        lo,
        hi,
        num_layers,
        get_int(obj, "actb", maximum=1 << 24),
        get_int(obj, "chunk"),
        get_int(obj, "rows"),
    )


# A cost coefficient above this (seconds per token, per pair...) is nonsense.
_MAX_COEF = 1e6
_COST_NAMES = ("base_s", "token_s", "pair_s", "seq_s", "ctx_s")


def _costs_from_list(values: Any) -> NodeCosts:
    """``NodeCosts.to_list`` back, every number bounded; absent: unknown costs."""
    if values is None:
        return NodeCosts()
    if not isinstance(values, list) or len(values) != len(_COST_NAMES) + 4:
        raise WireError(f"field 'costs' must be a list of {len(_COST_NAMES) + 4} items")
    obj = dict(zip((*_COST_NAMES, "kvb", "chunk", "batch", "links"), values, strict=True))
    step = StepCost(*(get_float(obj, name, maximum=_MAX_COEF) for name in _COST_NAMES))
    links_in = obj["links"]
    if not isinstance(links_in, list) or len(links_in) > MAX_LINKS:
        raise WireError(f"field 'links' must be a list of at most {MAX_LINKS} links")
    links: list[tuple[str, float]] = []
    for item in links_in:
        if not isinstance(item, list) or len(item) != 2:
            raise WireError("a link must be [node id, bytes per second]")
        link = {"node": item[0], "bps": item[1]}
        links.append((get_str(link, "node"), get_float(link, "bps")))
    return NodeCosts(
        step=step,
        kv_bytes_per_token=get_int(obj, "kvb"),
        chunk_tokens=get_int(obj, "chunk"),
        max_batch=get_int(obj, "batch"),
        links=tuple(links),
    )


def _forecast_from_list(values: Any) -> DecodeForecast:
    if values is None:
        return DecodeForecast()
    if (
        not isinstance(values, list)
        or len(values) != 2
        or not all(isinstance(v, list) and len(v) in (0, len(FORECAST_HORIZONS_S)) for v in values)
        or len(values[0]) != len(values[1])
    ):
        raise WireError(f"field 'fc' must be two lists of {len(FORECAST_HORIZONS_S)} numbers")
    batch = tuple(get_float({"batch": v}, "batch") for v in values[0])
    ctx = tuple(get_float({"ctx": v}, "ctx") for v in values[1])
    return DecodeForecast(batch, ctx)


def get_segments(obj: Mapping[str, Any], key: str) -> tuple[dict[str, Any], ...]:
    v = obj.get(key)
    if not isinstance(v, list) or not all(isinstance(d, dict) for d in v):
        raise WireError(f"field {key!r} must be a list of objects")
    return tuple(v)
