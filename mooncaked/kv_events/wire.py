"""vLLM's KV-event wire format, reproduced: one ZMQ message per batch.

The message has three frames, as vLLM's ``ZmqEventPublisher`` sends them:
the topic (UTF-8), the batch's sequence number (8 bytes, big-endian,
unsigned) and the msgpack payload.

The payload is the batch as msgspec encodes vLLM's ``KVEventBatch``: an
array ``[ts, events, data_parallel_rank]`` (a float64, a list, the rank; one
engine per node, so always 0). Each event is one of two shapes:

- ``map`` (vLLM since it switched its event structs to named fields): a map
  whose first key, ``"type"``, holds the tag (the class name), then the fields
  in vLLM's declaration order. Fields vLLM declares without a default are
  always there, ``None`` included; defaulted ones are left out when they
  hold their default, as msgspec's ``omit_defaults`` does.
- ``array`` (earlier releases): ``[tag, field, ...]`` in declaration order.
  msgspec writes every field of an array-like struct, so each release's
  arity is its field count, and decoders of fixed arity read one release
  only. This is the 8-element form of the releases from ``lora_name``'s
  addition until ``extra_keys``' (tag, block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name), which llm-d's array
  decoder reads exactly and decoders that skip trailing fields (msgspec's,
  Dynamo's) read too.

What mooncaked fills:

- ``block_hashes`` and ``parent_block_hash`` are unsigned 64-bit ints: the
  last 8 bytes of the 16-byte block hash, big-endian. vLLM truncates its own
  hashes so (``int.from_bytes(h, "big")`` masked to 64 bits), and so does
  llm-d when it is handed a hash as bytes, so either way a consumer derives
  the same int. The hash is a keyed digest: its low 8 bytes are as uniform as
  any other 8. Values above 2**63 go out as msgpack uint64, as vLLM's do.
- ``token_ids``: every token of the run's blocks; ``block_size`` the node's.
- ``lora_id`` and ``lora_name``: None (mooncaked serves no adapters).
- ``medium``: "GPU", vLLM's name for the engine's own cache.
- ``group_idx`` 0 and ``kv_cache_spec_kind`` "full_attention" (map only): the
  one KV-cache group of a model whose every layer attends to the whole
  context, as vLLM labels such a model's events.
- ``extra_keys``: left out. vLLM fills it for consumers that recompute its
  hashes; mooncaked's are its own (model-seeded BLAKE2b), which no consumer
  recomputes, and routers key their index on the tokens instead.
"""

from __future__ import annotations

from typing import Any, Literal

import msgpack

from mooncaked.cache.hashing import BlockHash
from mooncaked.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)

EventFormat = Literal["map", "array"]

_DATA_PARALLEL_RANK = 0
_U64 = (1 << 64) - 1


def external_hash(block_hash: BlockHash) -> int:
    """The 64-bit int a consumer sees for ``block_hash``: its last 8 bytes, big-endian."""
    if len(block_hash) < 8:
        raise ValueError(f"a block hash has at least 8 bytes, got {len(block_hash)}")
    return int.from_bytes(block_hash, "big") & _U64


def _stored(event: BlockStored, fmt: EventFormat) -> Any:
    hashes = [external_hash(h) for h in event.block_hashes]
    parent = None if event.parent_block_hash is None else external_hash(event.parent_block_hash)
    tokens = list(event.token_ids)
    if fmt == "array":
        return ["BlockStored", hashes, parent, tokens, event.block_size, None, event.medium, None]
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": event.block_size,
        "lora_id": None,
        "medium": event.medium,
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def _removed(event: BlockRemoved, fmt: EventFormat) -> Any:
    hashes = [external_hash(h) for h in event.block_hashes]
    if fmt == "array":
        return ["BlockRemoved", hashes, event.medium]
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": event.medium, "group_idx": 0}


def _event(event: KVEvent, fmt: EventFormat) -> Any:
    if isinstance(event, BlockStored):
        return _stored(event, fmt)
    if isinstance(event, BlockRemoved):
        return _removed(event, fmt)
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"] if fmt == "array" else {"type": "AllBlocksCleared"}
    raise ValueError(f"not a KV event: {event!r}")


def encode_batch(batch: EventBatch, fmt: EventFormat = "map") -> bytes:
    """The msgpack payload of ``batch``, byte for byte what vLLM's encoder makes
    of the same events (floats as float64, strings as str, ints in their
    smallest form)."""
    if fmt not in ("map", "array"):
        raise ValueError(f"format must be 'map' or 'array', got {fmt!r}")
    doc = [float(batch.ts), [_event(e, fmt) for e in batch.events], _DATA_PARALLEL_RANK]
    return msgpack.packb(doc, use_bin_type=True)


def frames(topic: str, batch: EventBatch, fmt: EventFormat = "map") -> list[bytes]:
    """The three frames of the ZMQ message carrying ``batch``."""
    return [topic.encode("utf-8"), batch.seq.to_bytes(8, "big"), encode_batch(batch, fmt)]
