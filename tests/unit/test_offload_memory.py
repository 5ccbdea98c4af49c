"""A memory node's pieces without sockets: its KV pool and its gossiped load."""

from __future__ import annotations

import pytest
import torch

from mooncaked.cluster.load import LoadMeter
from mooncaked.cluster.state import NodeLoad
from mooncaked.engine.offload.memory_kv import MemoryKV
from mooncaked.engine.offload.wire import KVShape, check_hello, hello_mac

SHAPE = KVShape(
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4
)


def test_sequences_grow_by_blocks_and_are_freed_per_peer() -> None:
    kv = MemoryKV(SHAPE, pool_bytes=SHAPE.token_kv_bytes() * 4 * 5)
    assert kv.num_blocks == 5
    a = kv.open(("p1", "a"))
    assert kv.extend(a, 6) and a.block_ids == [0, 1]
    b = kv.open(("p2", "b"))
    assert kv.extend(b, 9) and b.block_ids == [2, 3, 4]
    # Too few free: nothing taken.
    assert not kv.extend(a, 13) and a.block_ids == [0, 1]
    kv.check_integrity()
    assert kv.drop_peer("p2") == 1 and kv.num_free == 3
    data = torch.arange(2 * 2 * 6 * 2 * 8, dtype=torch.float32).view(2, 2, 6, 2, 8)
    kv.write(a, data)
    assert a.num_tokens == 6
    # Token 5 is slot 1 of block 1, in every layer, K and V.
    assert torch.equal(kv.buffer[1, 0, 1, 1], data[1, 0, 5])
    kv.check_integrity()


def test_hello_is_bound_to_the_nonce_and_the_secret() -> None:
    mac = hello_mac(b"secret-one", b"n" * 16, "node-a", SHAPE)
    hello = {
        "node": "node-a",
        "mac": mac,
        "shape": {k: getattr(SHAPE, k) for k in SHAPE.__dataclass_fields__},
    }
    assert check_hello(b"secret-one", b"n" * 16, hello) == ("node-a", SHAPE)
    with pytest.raises(ValueError, match="signature"):
        check_hello(b"secret-two", b"n" * 16, hello)
    with pytest.raises(ValueError, match="signature"):
        check_hello(b"secret-one", b"m" * 16, hello)


def test_a_memory_node_gossips_its_role_and_kv_use() -> None:
    load = NodeLoad(running_decode_batch=3, kv_usage=0.25, decode_context_tokens=900)
    meter = LoadMeter(
        role="memory",
        api_addr="127.0.0.1:1",
        engine=lambda: None,
        draining=lambda: False,
        clock=lambda: 0.0,
        memory_load=lambda: load,
    )
    state = meter()
    assert state.role == "memory" and state.load == load
