"""Segments: what can be registered, bounds, ids, descriptors, shared buffers."""

from __future__ import annotations

import os
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

from mooncaked.transfer.segment import (
    SegmentDescriptor,
    SegmentError,
    SegmentTable,
    SharedBuffer,
)


def test_registers_host_buffers_as_zero_copy_byte_views() -> None:
    table = SegmentTable()
    raw = bytearray(100)
    arr = np.zeros((4, 8), dtype=np.float32)
    tensor = torch.zeros(3, 5, dtype=torch.bfloat16)

    a = table.register("raw", raw)
    b = table.register("arr", arr)
    c = table.register("tensor", tensor)

    assert (a.length, b.length, c.length) == (100, 4 * 8 * 4, 3 * 5 * 2)
    assert (a.location, c.location) == ("cpu", "cpu")
    # Writes through the segment land in the caller's object: no copy was made.
    a.view[7] = 42
    assert raw[7] == 42
    b.view[0:4] = np.float32(1.5).tobytes()
    assert arr[0, 0] == 1.5
    c.view[0:2] = torch.tensor([2.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    assert tensor[0, 0].item() == 2.0
    assert not a.is_shared and not c.is_shared


def test_shared_memory_segments_carry_an_fd() -> None:
    table = SegmentTable()
    buf = SharedBuffer.create(4096)
    shm = shared_memory.SharedMemory(create=True, size=8192)
    try:
        s1 = table.register("memfd", buf)
        s2 = table.register("posix", shm)
        assert s1.is_shared and s1.length == 4096
        assert s2.is_shared and s2.length >= 8192
        table.unregister("posix")
    finally:
        shm.close()
        shm.unlink()
        buf.close()


def test_refuses_what_a_peer_could_not_safely_use() -> None:
    table = SegmentTable()
    with pytest.raises(SegmentError, match="read-only"):
        table.register("ro", b"abc")
    with pytest.raises(SegmentError, match="non-contiguous"):
        table.register("nc", torch.zeros(4, 4).t())
    with pytest.raises(SegmentError, match="empty"):
        table.register("empty", bytearray(0))
    with pytest.raises(SegmentError, match="cannot register a int"):
        table.register("int", 5)
    with pytest.raises(SegmentError, match=r"1\.\.255 bytes"):
        table.register("x" * 256, bytearray(1))
    table.register("dup", bytearray(1))
    with pytest.raises(SegmentError, match="already registered"):
        table.register("dup", bytearray(1))
    assert table.names() == ["dup"]


def test_check_range_names_the_segment_and_its_length() -> None:
    seg = SegmentTable().register("pool", bytearray(1000))
    assert seg.check_range(0, 1000) is None
    assert seg.check_range(999, 1) is None
    assert seg.check_range(1000, 0) is None
    assert seg.check_range(990, 11) == "range [990, 1001) is outside segment 'pool' of 1000 bytes"
    assert seg.check_range(-1, 4) is not None


def test_ids_are_never_reused_and_busy_segments_stay() -> None:
    table = SegmentTable()
    first = table.register("a", bytearray(10))
    first.acquire()
    with pytest.raises(SegmentError, match="1 local batch"):
        table.unregister("a")
    first.release()
    table.unregister("a")
    assert table.by_id(first.seg_id) is None
    again = table.register("a", bytearray(10))
    assert again.seg_id != first.seg_id
    assert table.by_id(again.seg_id) is again
    with pytest.raises(SegmentError, match="not registered"):
        table.unregister("b")


def test_descriptor_round_trips_and_rejects_junk() -> None:
    d = SegmentDescriptor("node-a", "kv.0", 1 << 20, "cpu", ("shm", "tcp"), "127.0.0.1:7000")
    assert SegmentDescriptor.from_bytes(d.to_bytes()) == d
    assert SegmentDescriptor.from_dict(d.to_dict()) == d
    with pytest.raises(SegmentError, match="not JSON"):
        SegmentDescriptor.from_bytes(b"{nope")
    bad = d.to_dict() | {"transports": ["carrier-pigeon"]}
    with pytest.raises(SegmentError, match="transports"):
        SegmentDescriptor.from_dict(bad)
    with pytest.raises(SegmentError, match="length"):
        SegmentDescriptor.from_dict(d.to_dict() | {"length": -1})
    with pytest.raises(SegmentError, match="lacks"):
        SegmentDescriptor.from_dict({"node_id": "a"})


def test_shared_buffer_maps_the_same_memory_through_an_fd() -> None:
    owner = SharedBuffer.create(1 << 16)
    peer = SharedBuffer.attach(os.dup(owner.fd), 1 << 16)
    try:
        owner.view[100:105] = b"hello"
        assert bytes(peer.view[100:105]) == b"hello"
        peer.view[0] = 7
        assert owner.view[0] == 7
        with pytest.raises(SegmentError, match="holds 65536 bytes"):
            SharedBuffer.attach(os.dup(owner.fd), 1 << 17)
    finally:
        peer.close()
        owner.close()
    owner.close()  # idempotent
