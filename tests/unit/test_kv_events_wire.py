"""KV events on the wire: the bytes vLLM's subscribers decode.

Each payload is read back with plain msgpack, field by field, and compared
byte for byte with what msgspec makes of structs declared here after vLLM's
``vllm/distributed/kv_events.py`` (field order, the tag, ``omit_defaults``,
``array_like``): the encoder vLLM runs, on its own declarations.
"""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec
import pytest

from mooncaked.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from mooncaked.kv_events.wire import encode_batch, external_hash, frames

BLOCK = 4
# 16-byte hashes: the last 8 bytes make the int; the first has its top bit
# set there (a uint64 above 2**63 on the wire), the others do not.
H1 = bytes(range(8)) + bytes.fromhex("f0e1d2c3b4a59687")
H2 = bytes(range(100, 108)) + bytes.fromhex("0102030405060708")
H3 = bytes(16)
PARENT = b"\xaa" * 8 + bytes.fromhex("00000000000000ff")
TS = 1789095808.8378847


def sample_batch() -> EventBatch:
    return EventBatch(
        seq=7,
        ts=TS,
        events=(
            BlockStored((H1, H2), PARENT, tuple(range(2 * BLOCK)), BLOCK),
            BlockStored((H3,), None, (9, 8, 7, 300), BLOCK),
            BlockRemoved((H1, H3)),
            AllBlocksCleared(),
        ),
    )


def test_a_hash_is_its_last_eight_bytes_big_endian_unsigned() -> None:
    assert external_hash(H1) == 0xF0E1D2C3B4A59687
    assert external_hash(H2) == 0x0102030405060708
    assert external_hash(H3) == 0
    assert external_hash(PARENT) == 255
    # What vLLM does to its own hashes: int.from_bytes(big) masked to 64 bits.
    assert external_hash(H1) == int.from_bytes(H1, "big") & ((1 << 64) - 1)
    with pytest.raises(ValueError, match="at least 8 bytes"):
        external_hash(b"\x01\x02")


def test_map_payload_field_by_field() -> None:
    raw = encode_batch(sample_batch(), "map")
    doc = msgpack.unpackb(raw, raw=False)
    assert isinstance(doc, list) and len(doc) == 3
    ts, events, rank = doc
    assert ts == TS and isinstance(ts, float)
    assert rank == 0
    stored, stored_root, removed, cleared = events
    assert list(stored) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "group_idx",
        "kv_cache_spec_kind",
    ]
    assert stored == {
        "type": "BlockStored",
        "block_hashes": [0xF0E1D2C3B4A59687, 0x0102030405060708],
        "parent_block_hash": 255,
        "token_ids": list(range(8)),
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    assert stored_root["parent_block_hash"] is None
    assert stored_root["block_hashes"] == [0]
    assert stored_root["token_ids"] == [9, 8, 7, 300]
    assert list(removed) == ["type", "block_hashes", "medium", "group_idx"]
    assert removed == {
        "type": "BlockRemoved",
        "block_hashes": [0xF0E1D2C3B4A59687, 0],
        "medium": "GPU",
        "group_idx": 0,
    }
    assert cleared == {"type": "AllBlocksCleared"}
    # The big hash is a msgpack uint64 (0xcf), not a negative int64.
    assert b"\xcf\xf0\xe1\xd2\xc3\xb4\xa5\x96\x87" in raw


def test_array_payload_field_by_field() -> None:
    doc = msgpack.unpackb(encode_batch(sample_batch(), "array"), raw=False)
    ts, events, rank = doc
    assert (ts, rank) == (TS, 0)
    assert events == [
        [
            "BlockStored",
            [0xF0E1D2C3B4A59687, 0x0102030405060708],
            255,
            list(range(8)),
            BLOCK,
            None,
            "GPU",
            None,
        ],
        ["BlockStored", [0], None, [9, 8, 7, 300], BLOCK, None, "GPU", None],
        ["BlockRemoved", [0xF0E1D2C3B4A59687, 0], "GPU"],
        ["AllBlocksCleared"],
    ]


def test_frames_are_topic_sequence_payload() -> None:
    batch = sample_batch()
    topic, seq, payload = frames("kv@pod-a@tiny", batch, "map")
    assert topic == b"kv@pod-a@tiny"
    assert seq == b"\x00\x00\x00\x00\x00\x00\x00\x07"
    assert payload == encode_batch(batch, "map")
    assert frames("", batch)[0] == b""


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="'json'"):
        encode_batch(sample_batch(), "json")  # type: ignore[arg-type]


# -- vLLM's declarations, as msgspec structs -----------------------------------
# Map-shaped events in an array-shaped batch (vLLM since its named-field switch).


class EventBatch_(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class MapRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class MapCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapBatch(EventBatch_):
    events: list[MapStored | MapRemoved | MapCleared]


# Array-shaped events, as the releases from lora_name's addition to extra_keys'
# declared them (msgspec writes every field of an array-like struct, so a
# release's arity is its field count).


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class ArrayRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class ArrayCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayBatch(EventBatch_):
    events: list[ArrayStored | ArrayRemoved | ArrayCleared]


def _vllm_map_batch() -> MapBatch:
    h1, h2, h3 = external_hash(H1), external_hash(H2), external_hash(H3)
    common = {"lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0}
    return MapBatch(
        ts=TS,
        events=[
            MapStored(
                [h1, h2],
                255,
                list(range(8)),
                BLOCK,
                kv_cache_spec_kind="full_attention",
                **common,
            ),
            MapStored(
                [h3], None, [9, 8, 7, 300], BLOCK, kv_cache_spec_kind="full_attention", **common
            ),
            MapRemoved([h1, h3], "GPU", group_idx=0),
            MapCleared(),
        ],
        data_parallel_rank=0,
    )


def _vllm_array_batch() -> ArrayBatch:
    h1, h2, h3 = external_hash(H1), external_hash(H2), external_hash(H3)
    return ArrayBatch(
        ts=TS,
        events=[
            ArrayStored([h1, h2], 255, list(range(8)), BLOCK, None, "GPU", None),
            ArrayStored([h3], None, [9, 8, 7, 300], BLOCK, None, "GPU", None),
            ArrayRemoved([h1, h3], "GPU"),
            ArrayCleared(),
        ],
        data_parallel_rank=0,
    )


def test_map_payload_is_byte_for_byte_what_vllms_encoder_makes() -> None:
    assert encode_batch(sample_batch(), "map") == msgspec.msgpack.encode(_vllm_map_batch())


def test_array_payload_is_byte_for_byte_what_vllms_encoder_makes() -> None:
    assert encode_batch(sample_batch(), "array") == msgspec.msgpack.encode(_vllm_array_batch())


def test_vllms_typed_decoder_reads_both_formats() -> None:
    got = msgspec.msgpack.Decoder(MapBatch).decode(encode_batch(sample_batch(), "map"))
    assert got == _vllm_map_batch()
    got_array = msgspec.msgpack.Decoder(ArrayBatch).decode(encode_batch(sample_batch(), "array"))
    assert got_array == _vllm_array_batch()
