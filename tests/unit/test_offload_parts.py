"""A step's decodes split by memory node: which chunks attend where, on which
connection, and which stay here; and the clients kept, one a memory node.

No sockets: the clients' ``available`` is what a test says, and nothing is
sent (``forward`` is the integration tests' job).
"""

from __future__ import annotations

from mooncaked.engine.offload.client import AttentionClient, ClientStats
from mooncaked.engine.offload.clients import ClientPool
from mooncaked.engine.offload.forward import OffloadedAttention
from mooncaked.engine.offload.wire import KVShape, StepSeq
from mooncaked.engine.plan import ScheduledChunk

SHAPE = KVShape(
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, dtype="float32", block_size=16
)
A, B = "10.0.0.1:7000", "10.0.0.2:7000"


class FakeClient(AttentionClient):
    """A client whose memory node is up or down as told; it never connects."""

    def __init__(self, address: str, stats: ClientStats, up: bool, clock: list[float]) -> None:
        super().__init__(
            address, node_id="c#1", secret=b"s", shape=SHAPE, stats=stats, clock=lambda: clock[0]
        )
        self.up = up
        self.closed = 0

    def available(self) -> bool:
        return self.up

    def close(self) -> None:
        self.closed += 1
        super().close()


class Pool:
    """A ``ClientPool`` of fake clients; ``down``: addresses that are down."""

    def __init__(self, *, down: tuple[str, ...] = (), keep: str = "") -> None:
        self.clock = [0.0]
        self.made: list[str] = []

        def connect(address: str, stats: ClientStats) -> AttentionClient:
            self.made.append(address)
            return FakeClient(address, stats, address not in down, self.clock)

        self.pool = ClientPool(connect, keep=keep)


def decode(rid: str, memory_node: str = "", kv_remote: bool = False) -> ScheduledChunk:
    return ScheduledChunk(rid, [7], 40, [], True, kv_remote=kv_remote, memory_node=memory_node)


def prefill(rid: str, memory_node: str) -> ScheduledChunk:
    # A prompt's chunk that is not its last: it computes here, samples nothing.
    return ScheduledChunk(rid, [1, 2, 3], 0, [0], False, memory_node=memory_node)


def mixed() -> list[ScheduledChunk]:
    return [
        prefill("p0", A),
        decode("a1", A),
        decode("l2"),
        decode("b3", B, kv_remote=True),
        decode("a4", A, kv_remote=True),
        decode("a5", A),
        decode("b6", B),
        # A prompt's last token: it samples, so it decodes on A after this step.
        ScheduledChunk("a7", [9], 30, [2], True, memory_node=A),
    ]


def split(
    offload: OffloadedAttention, chunks: list[ScheduledChunk]
) -> list[tuple[str, list[int], int, bool]]:
    by_node = offload._by_memory_node(chunks)
    return [
        (g.client.address, g.chunk_ids, g.conn, g.stranded)
        for g in offload._groups(chunks, by_node)
    ]


def test_auto_splits_decodes_by_their_memory_node_and_micro_batch() -> None:
    fake = Pool()
    offload = OffloadedAttention(fake.pool, micro_batches=2)
    chunks = mixed()
    assert offload._by_memory_node(chunks) == {A: [1, 4, 5, 7], B: [3, 6]}
    # Each memory node's decodes in two parts, each on a connection of its
    # own; the prefill chunk and the decode naming no memory node stay here.
    assert split(offload, chunks) == [
        (A, [1, 4], 0, False),
        (A, [5, 7], 1, False),
        (B, [3], 0, False),
        (B, [6], 1, False),
    ]
    assert fake.made == [A, B]
    assert offload.stats.local_fallbacks == 0


def test_one_micro_batch_is_one_part_a_memory_node() -> None:
    offload = OffloadedAttention(Pool().pool, micro_batches=1)
    assert split(offload, mixed()) == [(A, [1, 4, 5, 7], 0, False), (B, [3, 6], 0, False)]


def test_a_memory_node_down_strands_only_the_kv_it_held() -> None:
    fake = Pool(down=(B,))
    offload = OffloadedAttention(fake.pool, micro_batches=2)
    # B's decode whose KV is still here (b6) attends here; b3's KV was on B
    # only: its step is void. A's parts are as before.
    assert split(offload, mixed()) == [
        (A, [1, 4], 0, False),
        (A, [5, 7], 1, False),
        (B, [3], 0, True),
    ]
    assert offload.stats.local_fallbacks == 1


def test_no_decode_naming_an_available_memory_node_runs_the_step_here() -> None:
    offload = OffloadedAttention(Pool(down=(B,)).pool, micro_batches=2)
    chunks = [decode("l0"), decode("b1", B), prefill("p2", A)]
    assert split(offload, chunks) == []


def test_a_configured_memory_node_takes_every_decode_but_those_placed_elsewhere() -> None:
    m = "10.0.0.9:7000"
    offload = OffloadedAttention(Pool(keep=m).pool, micro_batches=1, configured=m)
    chunks = [decode("x0"), decode("a1", A), decode("x2"), prefill("p3", "")]
    assert offload._by_memory_node(chunks) == {m: [0, 2], A: [1]}
    assert offload.address_for("") == m and offload.address_for(B) == B
    # "auto" with no choice: here.
    assert OffloadedAttention(Pool().pool, 1).address_for("") == ""


def test_clients_holding_nothing_are_closed_once_a_step_goes_by_without_them() -> None:
    fake = Pool(keep=B)
    pool = fake.pool
    a, b, c = pool.get(A), pool.get(B), pool.get("10.0.0.3:7000")
    assert pool.get(A) is a and fake.made == [A, B, "10.0.0.3:7000"]
    a.end([StepSeq("s1", 0, 5)])
    c.end([StepSeq("s2", 0, 5)])
    # A holds s1: kept. B is the configured node: kept. C was used: kept.
    pool.prune(["10.0.0.3:7000"])
    assert (a.closed, b.closed, c.closed) == (0, 0, 0)
    # s2 finished: C holds nothing still wanted, and the step did not use it.
    pool.dropped("s2")
    pool.prune([A])
    assert c.closed == 1 and a.closed == 0
    assert pool.get("10.0.0.3:7000") is not c
    # A failed: down for retry_s, so it is kept (not retried every step)...
    assert a.fail("boom") == ["s1"]
    assert pool.last_error == f"{A}: boom" and pool.stats.failures == 1
    pool.prune([])
    assert a.closed == 0 and pool.get(A) is a
    # ... and closed once retry_s has passed.
    fake.clock[0] = 10.0
    pool.prune([])
    assert a.closed == 1 and pool.get(A) is not a
