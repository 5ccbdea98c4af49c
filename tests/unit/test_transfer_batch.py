"""Batch bookkeeping: per-op verdicts, settlement, cancel, counters."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mooncaked.transfer.batch import (
    Batch,
    OpStatus,
    Slice,
    TransferError,
    TransferMetrics,
    TransferOp,
)
from mooncaked.transfer.segment import SegmentTable


def _setup(n_ops: int, slices_per_op: int) -> tuple[Batch, list[list[Slice]], TransferMetrics]:
    seg = SegmentTable().register("buf", bytearray(1 << 20))
    ops = [TransferOp.read("buf", 0, "peer", "pool", 0, 100 * slices_per_op) for _ in range(n_ops)]
    metrics = TransferMetrics()
    batch = Batch(ops, asyncio.get_running_loop(), metrics)
    slices = []
    for i in range(n_ops):
        mine = [
            Slice(batch, i, ops[i].kind, seg, k * 100, "pool", k * 100, 100, "tcp")
            for k in range(slices_per_op)
        ]
        batch._add_slices(i, len(mine), "tcp")
        slices.append(mine)
    batch._seal()
    return batch, slices, metrics


async def test_op_is_done_when_all_its_slices_are() -> None:
    batch, slices, metrics = _setup(2, 3)
    batch.slices_done(slices[0][:2])
    assert batch.statuses == [OpStatus.PENDING, OpStatus.PENDING]
    batch.slice_done(slices[0][2])
    assert batch.statuses == [OpStatus.DONE, OpStatus.PENDING]
    assert not batch.done
    batch.slices_done(slices[1])
    assert await batch.wait() is True
    assert batch.ok and batch.failures() == []
    assert metrics.ops_done == 2 and metrics.bytes_read == 600
    assert metrics.bytes_by_transport == {"tcp": 600}


async def test_first_failed_slice_fails_the_op_and_later_slices_are_ignored() -> None:
    batch, slices, metrics = _setup(2, 2)
    batch.slice_failed(slices[0][0], "boom")
    batch.slice_done(slices[0][1])  # too late: the op already failed
    batch.slices_done(slices[1])
    assert await batch.wait() is False
    assert batch.statuses == [OpStatus.FAILED, OpStatus.DONE]
    assert batch.reason(0) == "boom" and batch.reason(1) is None
    assert metrics.ops_failed == 1 and metrics.ops_done == 1
    with pytest.raises(TransferError, match="op 0: boom"):
        batch.raise_for_failures()


async def test_cancel_fails_pending_ops_but_wait_holds_until_slices_settle() -> None:
    batch, slices, _ = _setup(3, 1)
    batch.slice_done(slices[0][0])
    assert batch.cancel() == 2
    assert batch.statuses == [OpStatus.DONE, OpStatus.FAILED, OpStatus.FAILED]
    assert batch.reason(1) == "cancelled"
    # A transport still holds op 1's and op 2's slices: not settled yet.
    waiter = asyncio.create_task(batch.wait())
    await asyncio.sleep(0)
    assert not waiter.done() and not batch.done
    assert not slices[1][0].live
    batch.slice_dropped(slices[1][0])
    # Reported from another thread, as transports do.
    t = threading.Thread(target=batch.slice_done, args=(slices[2][0],))
    t.start()
    t.join()
    assert await asyncio.wait_for(waiter, 5) is False
    assert batch.statuses == [OpStatus.DONE, OpStatus.FAILED, OpStatus.FAILED]


async def test_empty_batch_settles_at_once() -> None:
    batch = Batch([], asyncio.get_running_loop(), TransferMetrics())
    batch._seal()
    assert await batch.wait() is True


def test_transfer_error_lists_a_few_reasons() -> None:
    err = TransferError([(i, f"r{i}") for i in range(8)])
    assert str(err).startswith("8 transfer op(s) failed: op 0: r0; op 1: r1")
    assert "(and 3 more)" in str(err)
