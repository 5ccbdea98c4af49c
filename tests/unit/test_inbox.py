"""The replica inbox (holder side of a put) and the replica plans, exactly."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import pytest
import torch

from mooncaked.cache.inbox import Outcome, ReplicaInbox
from mooncaked.cache.layout import BlockLayout
from mooncaked.cache.ssd import data_crc
from mooncaked.cache.store import TieredStore
from mooncaked.cluster.replicas import plan_drop, plan_put, rank_targets
from mooncaked.cluster.state import ClusterView, NodeLoad
from mooncaked.config import StoreConfig
from tests.cluster_views import add_node
from tests.conftest import ManualClock

LAYOUT = BlockLayout(num_layers=1, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float16)
BB = LAYOUT.block_bytes


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(i: int) -> torch.Tensor:
    return torch.full((BB,), i % 251, dtype=torch.uint8)


class Grants:
    """Records the grants the inbox opens and closes."""

    def __init__(self) -> None:
        self.open_rows: dict[int, tuple[str, tuple[int, ...]]] = {}
        self._next = 0

    def open(self, peer: str, rows: Sequence[int], ttl_s: float) -> object:
        self._next += 1
        self.open_rows[self._next] = (peer, tuple(rows))
        return self._next

    def close(self, handle: object) -> None:
        assert isinstance(handle, int)
        del self.open_rows[handle]


@pytest.fixture
async def store() -> AsyncIterator[TieredStore]:
    s = TieredStore(LAYOUT, StoreConfig(dram_bytes=4 * BB, high_watermark=1.0), pin_memory=False)
    await s.start()
    yield s
    await s.close()


def make_inbox(
    store: TieredStore,
    num_rows: int = 3,
    clock: ManualClock | None = None,
    max_rows_outside: int = 0,
) -> tuple[ReplicaInbox, Grants]:
    grants = Grants()
    rows = torch.zeros((num_rows, BB), dtype=torch.uint8)
    inbox = ReplicaInbox(
        store,
        rows,
        grants,
        ttl_s=10.0,
        max_rows_outside=max_rows_outside,
        clock=clock or ManualClock(),
    )
    return inbox, grants


def write(inbox: ReplicaInbox, rows: Sequence[int], blocks: Sequence[int]) -> None:
    """What the writer's transfer does: block i's bytes into its row."""
    for row, i in zip(rows, blocks, strict=True):
        inbox.rows[row].copy_(block(i))


async def test_checked_blocks_enter_dram_and_a_mismatch_is_refused(store: TieredStore) -> None:
    inbox, grants = make_inbox(store)
    res, held = inbox.reserve("writer-a", [h(0), h(1), h(2)])
    assert res is not None and held == []
    assert res.rows == (0, 1, 2) and grants.open_rows == {1: ("writer-a", (0, 1, 2))}
    write(inbox, res.rows, [0, 1, 2])
    crcs = [data_crc(h(i), block(i).numpy()) for i in range(3)]
    crcs[1] ^= 0x5A  # block 1's bytes do not match what the writer states
    outcomes = await inbox.commit(res.reservation_id, "writer-a", crcs)
    assert outcomes == [Outcome.STORED, Outcome.CORRUPT, Outcome.STORED]
    assert grants.open_rows == {}  # the grant ended before the check
    assert store.dram.contains(h(0)) and store.dram.contains(h(2))
    assert not store.dram.has(h(1))  # never visible
    slot = store.dram.get_slot(h(2))
    assert slot is not None and torch.equal(store.dram.slot(slot), block(2))
    stats = inbox.stats()
    assert (stats.stored, stats.corrupt, stats.rows_free) == (2, 1, 3)
    store.check_integrity()
    inbox.check_integrity()


async def test_held_blocks_are_skipped_and_a_full_inbox_takes_a_prefix(
    store: TieredStore,
) -> None:
    inbox, grants = make_inbox(store, num_rows=2)
    first, _ = inbox.reserve("w", [h(0)])
    assert first is not None
    write(inbox, first.rows, [0])
    await inbox.commit(first.reservation_id, "w", [data_crc(h(0), block(0).numpy())])
    res, held = inbox.reserve("w", [h(0), h(1), h(2), h(3)])
    assert held == [0] and res is not None and res.hashes == (h(1), h(2))
    assert inbox.reserve("w", [h(3)]) == (None, [])  # every row taken: a shortage
    assert inbox.stats().refused_full == 1
    # A failed write is said so: nothing to check, the row comes back.
    outcomes = await inbox.commit(res.reservation_id, "w", [None, None])
    assert outcomes == [Outcome.NOT_WRITTEN, Outcome.NOT_WRITTEN]
    assert inbox.stats().rows_free == 2 and grants.open_rows == {}


async def test_reservations_belong_to_their_writer_and_end_on_time(store: TieredStore) -> None:
    clock = ManualClock()
    inbox, grants = make_inbox(store, clock=clock)
    res, _ = inbox.reserve("w", [h(0), h(1)])
    assert res is not None
    with pytest.raises(ValueError, match="not held by 'other'"):
        await inbox.commit(res.reservation_id, "other", [1, 2])
    with pytest.raises(ValueError, match="holds 2 blocks, got 1 checksums"):
        await inbox.commit(res.reservation_id, "w", [1])
    clock.now += 11.0
    again, _ = inbox.reserve("w", [h(5)])  # reaps the one past its deadline
    assert again is not None and again.rows == (0,)  # its rows came back
    assert inbox.stats().expired == 1
    with pytest.raises(ValueError, match="not held"):
        await inbox.commit(res.reservation_id, "w", [1, 2])
    assert list(grants.open_rows.values()) == [("w", again.rows)]
    assert inbox.abort(again.reservation_id, "w")
    assert grants.open_rows == {} and inbox.stats().rows_free == 3
    inbox.check_integrity()


async def test_writers_outside_the_view_share_one_cap_members_do_not(
    store: TieredStore,
) -> None:
    inbox, grants = make_inbox(store, num_rows=3, max_rows_outside=2)
    a, _ = inbox.reserve("vllm-a", [h(0)], outside=True)
    b, _ = inbox.reserve("vllm-b", [h(1), h(2)], outside=True)
    # vllm-b gets what the cap leaves after vllm-a's row: one.
    assert a is not None and a.rows == (0,)
    assert b is not None and b.hashes == (h(1),) and b.rows == (1,)
    assert inbox.rows_outside() == 2
    assert inbox.reserve("vllm-c", [h(3)], outside=True) == (None, [])
    assert inbox.stats().refused_outside == 1
    # A member is not held to it: it takes the last free row.
    member, _ = inbox.reserve("node-b", [h(3)])
    assert member is not None and member.rows == (2,)
    # A commit gives the rows back to the outsiders' share.
    write(inbox, a.rows, [0])
    assert await inbox.commit(a.reservation_id, "vllm-a", [data_crc(h(0), block(0).numpy())]) == [
        Outcome.STORED
    ]
    assert inbox.rows_outside() == 1
    assert sorted(p for p, _ in grants.open_rows.values()) == ["node-b", "vllm-b"]
    inbox.check_integrity()


def test_inbox_rows_must_fit_the_store(store: TieredStore) -> None:
    with pytest.raises(ValueError, match=f"uint8 \\[n, {BB}\\]"):
        ReplicaInbox(store, torch.zeros((2, BB + 1), dtype=torch.uint8), Grants(), ttl_s=1.0)


# -- the plans -----------------------------------------------------------------


def view_of(free: dict[str, int], model: str = "m") -> ClusterView:
    view = ClusterView("a", clock=lambda: 0.0)
    for node, n in free.items():
        add_node(view, node, "both", model=model, load=NodeLoad(dram_free_blocks=n))
    return view


def test_targets_rank_by_free_dram_then_node_id() -> None:
    view = view_of({"a": 50, "b": 10, "c": 90, "d": 10})
    add_node(view, "e", "both", model="other", load=NodeLoad(dram_free_blocks=1000))
    assert rank_targets(view, "m", exclude={"a"}) == ["c", "b", "d"]


def test_plan_put_fills_each_block_to_its_count() -> None:
    held = [{"a"}, {"a", "c"}, {"a"}]
    assert plan_put(held, 2, ["c", "b", "d"]) == {"c": [0, 2]}
    assert plan_put(held, 3, ["c", "b", "d"]) == {"c": [0, 2], "b": [0, 1, 2]}
    assert plan_put(held, 4, ["c"]) == {"c": [0, 2]}  # the targets run out: short
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        plan_put(held, 0, ["c"])


def test_plan_drop_takes_the_least_free_holders_first_never_the_last_copy() -> None:
    view = view_of({"a": 5, "b": 1, "c": 9})
    held = [{"a", "b", "c"}, {"a", "c"}, {"c"}]
    assert plan_drop(view, held, 1, keep="a") == {"b": [0], "c": [0, 1]}
    assert plan_drop(view, held, 2, keep="a") == {"b": [0]}
    with pytest.raises(ValueError, match="last copy is never dropped"):
        plan_drop(view, held, 0, keep="a")
