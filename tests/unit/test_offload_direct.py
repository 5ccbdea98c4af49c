"""A memory node's side of the direct handoff, without sockets: blocks
reserved for a prefill node's writes, granted to it alone, filled, claimed by
the peer's first step, and given back by deadline when anything fails."""

from __future__ import annotations

import pytest
import torch

from mooncaked.engine.offload.memory_kv import MemoryKV
from mooncaked.engine.offload.server import AttentionServer, _Conn
from mooncaked.engine.offload.wire import (
    HEADER,
    Kind,
    KVShape,
    Reserve,
    StepSeq,
    decode_granted,
    encode_filled,
    encode_step,
    parse_header,
)
from mooncaked.handoff import KVLayout

SHAPE = KVShape(
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _kv(clock: Clock, blocks: int = 6) -> MemoryKV:
    return MemoryKV(SHAPE, pool_bytes=SHAPE.token_kv_bytes() * 4 * blocks, clock=clock)


def test_a_reservation_is_filled_claimed_and_then_lives_with_its_peer() -> None:
    clock = Clock()
    kv = _kv(clock)
    seq = kv.reserve(("p", "r1"), 9, until=110.0)
    assert seq is not None and seq.block_ids == [0, 1, 2] and seq.filling
    # Not filled: a step cannot start on it, and its peer leaving keeps it.
    assert kv.drop_peer("p") == 0
    assert kv.fill(("p", "r1"), 9, claim_by=160.0)
    assert seq.num_tokens == 9 and seq.deadline == 160.0
    # Filled twice: refused (the reservation is over).
    assert not kv.fill(("p", "r1"), 9, claim_by=160.0)
    kv.claim(seq)
    assert seq.deadline == 0.0
    clock.now = 1000.0
    assert kv.sweep() == 0 and ("p", "r1") in kv.seqs
    assert kv.drop_peer("p") == 1 and kv.num_free == 6
    kv.check_integrity()


def test_an_unclaimed_or_unfilled_reservation_is_freed_at_its_deadline() -> None:
    clock = Clock()
    kv = _kv(clock)
    assert kv.reserve(("p", "filled"), 4, until=110.0) is not None
    assert kv.fill(("p", "filled"), 4, claim_by=120.0)
    assert kv.reserve(("p", "open"), 8, until=115.0) is not None
    assert kv.num_free == 3
    clock.now = 115.0
    assert kv.sweep() == 2 and set(kv.seqs) == {("p", "filled")}
    clock.now = 120.0
    assert kv.sweep() == 1 and not kv.seqs and kv.num_free == 6
    kv.check_integrity()


def test_a_given_up_reservation_is_quarantined_until_its_grant_ends() -> None:
    clock = Clock()
    kv = _kv(clock)
    assert kv.reserve(("p", "r"), 8, until=110.0) is not None
    # A second writer asked: fresh blocks; the first writer's stay out of use.
    again = kv.reserve(("p", "r"), 8, until=130.0)
    assert again is not None and again.block_ids == [2, 3]
    assert kv.num_free == 2 and kv.num_quarantined == 2
    kv.check_integrity()
    # Too few blocks for a third: nothing taken, the second is given up too.
    assert kv.reserve(("p", "r"), 12, until=140.0) is None
    assert kv.num_quarantined == 4 and ("p", "r") not in kv.seqs
    clock.now = 110.0
    assert kv.sweep() == 2 and kv.num_free == 4
    clock.now = 130.0
    assert kv.sweep() == 2 and kv.num_free == 6
    kv.check_integrity()


def test_the_pool_is_laid_out_as_a_prefill_node_addresses_it() -> None:
    kv = _kv(Clock(), blocks=3)
    lay = kv.layout
    assert lay == KVLayout(2, 3, 4, 2 * 8 * 4)
    # Layer 1's V, block 2, row 3: where KVLayout.offset says.
    kv.buffer[1, 1, 2, 3] = 7.0
    flat = kv.buffer.view(-1).view(torch.uint8)
    at = lay.offset(1, 1, 2, 3)
    assert flat[at : at + lay.row_bytes].view(torch.float32).eq(7.0).all()


class FakeSegments:
    node_id = "mem-1"
    segment = "offload-kv"
    address = "127.0.0.1:9"

    def __init__(self) -> None:
        self.grants: dict[int, tuple[str, list[int], float]] = {}
        self._next = 0

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def grant(self, peer: str, layout: KVLayout, block_ids: list[int], ttl_s: float) -> object:
        self._next += 1
        self.grants[self._next] = (peer, list(block_ids), ttl_s)
        return self._next

    def revoke(self, handle: object) -> None:
        self.grants.pop(handle, None)  # type: ignore[call-overload]


def _reply(raw: bytes | None) -> tuple[Kind, bytes]:
    assert raw is not None
    kind, _, length = parse_header(raw[: HEADER.size])
    return kind, raw[HEADER.size : HEADER.size + length]


async def _server(segs: FakeSegments | None) -> tuple[AttentionServer, _Conn]:
    server = AttentionServer(
        node_id="mem-1", secret=b"s", host="127.0.0.1", port=0, pool_bytes=1 << 20, segments=segs
    )
    server._open_pool(SHAPE)
    return server, _Conn(peer="decode#1")


async def test_reserve_grants_the_writer_and_filled_ends_the_grant() -> None:
    segs = FakeSegments()
    server, conn = await _server(segs)
    assert server.kv is not None
    ask = Reserve("req-1", 6, "prefill-a", 5.0)
    kind, body = _reply(await server._handle(conn, Kind.RESERVE, 0, bytearray(ask.encode())))
    assert kind is Kind.OK
    grant = decode_granted(body)
    assert (grant.node_id, grant.segment, grant.transfer_address) == (
        "mem-1",
        "offload-kv",
        "127.0.0.1:9",
    )
    assert grant.block_ids == (0, 1) and grant.layout == server.kv.layout
    assert list(segs.grants.values()) == [("prefill-a", [0, 1], 5.0)]
    filled = bytearray(encode_filled("req-1", 6))
    kind, _ = _reply(await server._handle(conn, Kind.FILLED, 0, filled))
    assert kind is Kind.OK and not segs.grants and server.stats.direct == 1
    # The peer's first decode starts after the prompt: no upload needed.
    step = bytearray(encode_step([StepSeq("req-1", 6, 1)], []))
    assert await server._handle(conn, Kind.STEP, 0, step) is None
    assert conn.step is not None and conn.step.error is None
    assert server.kv.seqs[("decode#1", "req-1")].deadline == 0.0
    server.kv.check_integrity()
    await server.close()


async def test_a_connection_closing_unfilled_revokes_and_quarantines() -> None:
    segs = FakeSegments()
    server, conn = await _server(segs)
    assert server.kv is not None
    for writer in ("prefill-a", "prefill-b"):
        ask = Reserve("req-1", 6, writer, 5.0)
        kind, _ = _reply(await server._handle(conn, Kind.RESERVE, 0, bytearray(ask.encode())))
        assert kind is Kind.OK
    # The first writer's grant ended when the second was asked.
    assert [g[0] for g in segs.grants.values()] == ["prefill-b"]
    server._give_up(conn)
    assert not segs.grants and not server.kv.seqs and server.kv.num_quarantined == 4
    # FILLED with no reservation: refused.
    kind, _ = _reply(
        await server._handle(conn, Kind.FILLED, 0, bytearray(encode_filled("req-1", 6)))
    )
    assert kind is Kind.ERROR and server.stats.direct == 0
    server.kv.check_integrity()
    await server.close()


async def test_a_memory_node_without_a_segment_refuses_reservations() -> None:
    server, conn = await _server(None)
    ask = Reserve("req-1", 6, "prefill-a", 5.0)
    kind, body = _reply(await server._handle(conn, Kind.RESERVE, 0, bytearray(ask.encode())))
    assert kind is Kind.ERROR and b"no direct" in body
    await server.close()


@pytest.mark.parametrize(
    "raw",
    [
        b"{}",
        b'{"key":"","num_tokens":1,"writer":"w","ttl_s":1}',
        b'{"key":"k","num_tokens":0,"writer":"w","ttl_s":1}',
    ],
)
def test_a_bad_reserve_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError, match="RESERVE"):
        Reserve.decode(raw)
