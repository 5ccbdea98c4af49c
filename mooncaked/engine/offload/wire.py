"""The attention-offload protocol: frames between a compute node and a memory node.

One persistent TCP connection per micro-batch, opened by the compute node.
Per layer of a decode step the compute node sends one ``LAYER`` frame (the
batch's new q, k and v, raw) and reads one ``OUT`` frame (the attention
output): one round trip a layer, the least the split allows. A step starts
with a ``STEP`` frame naming its sequences (no reply: its errors come back
with the first layer's). Frames are ``[kind u8][layer u16][length u32]`` and
a payload.

Opening: the memory node sends ``CHALLENGE`` (a fresh nonce); the compute
node answers ``HELLO`` (its node id, the model's shape, and a keyed BLAKE2b
of both under the cluster secret); the memory node checks it, answers ``OK``
or ``ERROR``. A connection never authenticated is never served, and a peer
reaches only the sequences it opened itself.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import struct
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mooncaked.handoff import KVGrant, KVLayout

HEADER = struct.Struct("!BHI")
# A frame larger than this is refused: a batch of 16 long-context uploads of a
# 7B model stays well under it, a corrupt length does not.
MAX_FRAME = 1 << 31
_KEY_DOMAIN = b"mooncaked/attention-offload/v1"


class Kind(enum.IntEnum):
    CHALLENGE = 1
    HELLO = 2
    OK = 3
    ERROR = 4
    STEP = 5
    LAYER = 6
    OUT = 7
    # A sequence's KV from position 0, every layer: what the memory node lacks
    # (a prompt prefilled elsewhere, a prefix-cache hit, a restarted node).
    UPLOAD = 8
    # Sequences the compute node is done with, while no step carries them
    # (its engine went idle); no reply.
    DROP = 9
    # Direct handoff: blocks for a prompt a prefill node writes here, granted
    # to it (answered OK with the grant's figures); and the word that its KV
    # landed (answered OK). A prompt's KV never passes the compute node.
    RESERVE = 10
    FILLED = 11


class OffloadError(RuntimeError):
    """The memory node cannot serve this call (down, refused, timed out)."""


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class KVShape:
    """What a memory node needs of the model: no weights, its KV's shape."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"KV dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KV shape: {name} must be > 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("KV shape: num_heads must be a multiple of num_kv_heads")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def qkv_bytes(self, num_tokens: int) -> int:
        return (
            num_tokens * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim * self.elem_bytes
        )

    def out_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.num_heads * self.head_dim * self.elem_bytes

    def token_kv_bytes(self) -> int:
        """One token's K and V in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.elem_bytes

    @classmethod
    def of(cls, data: dict[str, Any]) -> KVShape:
        try:
            return cls(**{k: data[k] for k in cls.__dataclass_fields__})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"bad KV shape {data!r}: {exc}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"attention offloading does not carry {dtype}")


def _key(secret: bytes) -> bytes:
    return hashlib.blake2b(secret, key=_KEY_DOMAIN, digest_size=32).digest()


def hello_mac(secret: bytes, nonce: bytes, node_id: str, shape: KVShape) -> str:
    """The proof a compute node knows the cluster secret, bound to this
    connection's nonce (no replay), its id and the shape it asks for."""
    body = nonce + b"\0" + node_id.encode() + b"\0" + encode_json(asdict(shape))
    return hashlib.blake2b(body, key=_key(secret), digest_size=32).hexdigest()


def check_hello(secret: bytes, nonce: bytes, hello: dict[str, Any]) -> tuple[str, KVShape]:
    """(peer id, shape) of a valid HELLO; ValueError otherwise."""
    node_id, mac = hello.get("node"), hello.get("mac")
    if not isinstance(node_id, str) or not node_id or not isinstance(mac, str):
        raise ValueError("HELLO needs a node id and a mac")
    shape = KVShape.of(hello.get("shape") or {})
    if not hmac.compare_digest(mac, hello_mac(secret, nonce, node_id, shape)):
        raise ValueError("HELLO: bad signature (a different cluster secret?)")
    return node_id, shape


def encode_json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def frame(kind: Kind, payload: bytes | bytearray | memoryview = b"", layer: int = 0) -> bytes:
    return HEADER.pack(kind, layer, len(payload)) + bytes(payload)


def parse_header(raw: bytes) -> tuple[Kind, int, int]:
    kind, layer, length = HEADER.unpack(raw)
    if length > MAX_FRAME:
        raise ValueError(f"frame of {length} bytes is too large")
    try:
        return Kind(kind), layer, length
    except ValueError:
        raise ValueError(f"unknown frame kind {kind}") from None


@dataclass(frozen=True, slots=True)
class StepSeq:
    """One sequence of a step: ``n`` new tokens from position ``start``."""

    key: str
    start: int
    n: int


def encode_step(seqs: list[StepSeq], drop: list[str]) -> bytes:
    return encode_json({"seqs": [[s.key, s.start, s.n] for s in seqs], "drop": drop})


def decode_step(payload: bytes) -> tuple[list[StepSeq], list[str]]:
    data = json.loads(payload)
    seqs = [StepSeq(str(k), int(s), int(n)) for k, s, n in data["seqs"]]
    if not seqs or any(s.start < 0 or s.n <= 0 for s in seqs):
        raise ValueError("STEP needs sequences with a start >= 0 and tokens")
    if len({s.key for s in seqs}) != len(seqs):
        raise ValueError("STEP names a sequence twice")
    return seqs, [str(k) for k in data.get("drop", [])]


def encode_drop(keys: list[str]) -> bytes:
    return encode_json({"drop": keys})


def decode_drop(payload: bytes) -> list[str]:
    return [str(k) for k in json.loads(payload)["drop"]]


def encode_upload(key: str, kv: torch.Tensor) -> bytes:
    """``kv``: [layers, 2, n, kv_heads, head_dim], this sequence's first n tokens."""
    head = encode_json({"key": key, "n": int(kv.shape[2])})
    return struct.pack("!I", len(head)) + head + tensor_bytes(kv)


def decode_upload(payload: memoryview, shape: KVShape) -> tuple[str, int, torch.Tensor]:
    (size,) = struct.unpack_from("!I", payload)
    head = json.loads(bytes(payload[4 : 4 + size]))
    key, n = str(head["key"]), int(head["n"])
    body = payload[4 + size :]
    if n <= 0 or len(body) != n * shape.token_kv_bytes():
        raise ValueError(f"UPLOAD of {key!r}: {len(body)} bytes for {n} tokens")
    kv = bytes_tensor(body, shape.torch_dtype).view(
        shape.num_layers, 2, n, shape.num_kv_heads, shape.head_dim
    )
    return key, n, kv


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (bfloat16 has no numpy twin: go through uint8)."""
    flat = t.contiguous().view(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def bytes_tensor(data: bytes | bytearray | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``data``: shared when it is writable (a received
    bytearray), else a copy (torch wants writable memory)."""
    if (isinstance(data, memoryview) and data.readonly) or isinstance(data, bytes):
        data = bytearray(data)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype)


@dataclass(frozen=True, slots=True)
class Reserve:
    """A compute node's ask: ``num_tokens`` tokens of ``key``'s prompt, written
    here by the prefill node ``writer`` within ``ttl_s``."""

    key: str
    num_tokens: int
    writer: str
    ttl_s: float

    def encode(self) -> bytes:
        return encode_json(asdict(self))

    @classmethod
    def decode(cls, payload: bytes | bytearray) -> Reserve:
        try:
            d = json.loads(payload)
            out = cls(str(d["key"]), int(d["num_tokens"]), str(d["writer"]), float(d["ttl_s"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad RESERVE: {exc}") from None
        if not out.key or not out.writer or out.num_tokens <= 0 or not 0 < out.ttl_s <= 3600:
            raise ValueError(f"bad RESERVE: {out}")
        return out


def encode_filled(key: str, num_tokens: int) -> bytes:
    return encode_json({"key": key, "num_tokens": num_tokens})


def decode_filled(payload: bytes | bytearray) -> tuple[str, int]:
    try:
        d = json.loads(payload)
        return str(d["key"]), int(d["num_tokens"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"bad FILLED: {exc}") from None


def encode_granted(grant: KVGrant) -> bytes:
    """The memory node's answer to RESERVE: where the prefill node writes."""
    lay = grant.layout
    return encode_json(
        {
            "key": grant.request_id,
            "node_id": grant.node_id,
            "transfer_address": grant.transfer_address,
            "segment": grant.segment,
            "layout": [lay.num_layers, lay.num_blocks, lay.block_size, lay.row_bytes],
            "block_ids": list(grant.block_ids),
            "ttl_s": grant.ttl_s,
        }
    )


def decode_granted(payload: bytes | bytearray) -> KVGrant:
    try:
        d = json.loads(payload)
        return KVGrant(
            request_id=str(d["key"]),
            node_id=str(d["node_id"]),
            transfer_address=str(d["transfer_address"]),
            segment=str(d["segment"]),
            layout=KVLayout(*(int(x) for x in d["layout"])),
            first_block=0,
            block_ids=tuple(int(b) for b in d["block_ids"]),
            ttl_s=float(d["ttl_s"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"bad RESERVE answer: {exc}") from None
