"""RDMA transport: the parts that need no NIC, and a skip for the rest."""

from __future__ import annotations

import random

import pytest

from mooncaked.config import TransferConfig
from mooncaked.transfer import Access, OpKind, TransferEngine, TransferOp
from mooncaked.transfer.rdma import (
    QpInfo,
    RdmaUnavailable,
    RemoteRegion,
    load_pyverbs,
    new_psn,
    plan_work_requests,
    rdma_configured_reason,
)

NO_RDMA = rdma_configured_reason("")


def test_qp_info_round_trips_and_validates() -> None:
    info = QpInfo(lid=7, gid="fe800000000000000000000000000001", qpn=0x1234, psn=99, mtu=4096)
    assert QpInfo.from_dict(info.to_dict()) == info
    assert info.gid_text == "fe80:0000:0000:0000:0000:0000:0000:0001"
    assert QpInfo.from_dict(info.to_dict() | {"gid": ""}).gid == ""
    for bad, match in [
        ({"qpn": 1 << 24}, "qpn"),
        ({"psn": -1}, "psn"),
        ({"lid": True}, "lid"),
        ({"mtu": 1500}, "mtu"),
        ({"gid": "zz"}, "gid"),
    ]:
        with pytest.raises(ValueError, match=match):
            QpInfo.from_dict(info.to_dict() | bad)
    with pytest.raises(ValueError, match="lacks"):
        QpInfo.from_dict({"lid": 1})
    psn = new_psn(random.Random(1))
    assert 0 <= psn < (1 << 24)


def test_work_requests_are_cut_and_bounds_checked() -> None:
    region = RemoteRegion(addr=0x10000, rkey=42, length=10_000)
    plan = plan_work_requests(
        [
            (1, OpKind.READ, 0x9000, 5, 100, region, 2500),
            (2, OpKind.WRITE, 0xA000, 5, 0, region, 1000),
        ],
        max_message=1024,
    )
    assert [(w.wr_id, w.local_addr, w.remote_addr, w.length) for w in plan] == [
        (1, 0x9000, 0x10000 + 100, 1024),
        (1, 0x9000 + 1024, 0x10000 + 1124, 1024),
        (1, 0x9000 + 2048, 0x10000 + 2148, 452),
        (2, 0xA000, 0x10000, 1000),
    ]
    assert {w.rkey for w in plan} == {42} and {w.lkey for w in plan} == {5}
    assert [w.kind for w in plan] == [OpKind.READ] * 3 + [OpKind.WRITE]
    with pytest.raises(ValueError, match=r"range \[9500, 10001\) is outside a region of 10000"):
        plan_work_requests([(3, OpKind.READ, 0, 0, 9500, region, 501)])


@pytest.mark.skipif(NO_RDMA is None, reason="pyverbs and an RDMA NIC are present")
def test_missing_pyverbs_or_nic_is_explained() -> None:
    try:
        load_pyverbs()
    except RdmaUnavailable as exc:
        assert "python3-pyverbs" in str(exc)
        assert NO_RDMA == str(exc)
    else:
        assert NO_RDMA is not None and "no RDMA NIC" in NO_RDMA


@pytest.mark.skipif(NO_RDMA is None, reason="pyverbs and an RDMA NIC are present")
async def test_engine_configured_for_rdma_falls_back_without_it() -> None:
    config = TransferConfig(transports=("rdma", "tcp"))
    async with (
        TransferEngine(config, "a", b"rdma-fallback-secret") as a,
        TransferEngine(config, "b", b"rdma-fallback-secret") as b,
    ):
        b.register("pool", bytearray(b"x" * 4096), access=Access.READ_WRITE)
        local = a.register("buf", bytearray(4096))
        assert b.descriptor("pool").transports == ("tcp",)
        a.add_peer("b", b.address)
        batch = await a.submit([TransferOp.read("buf", 0, "b", "pool", 0, 4096)])
        assert await batch.wait() and batch.transport(0) == "tcp"
        assert bytes(local.view) == b"x" * 4096


@pytest.mark.rdma
@pytest.mark.skipif(NO_RDMA is not None, reason=f"no RDMA NIC usable on this machine: {NO_RDMA}")
async def test_rdma_read_and_write_between_two_engines() -> None:
    config = TransferConfig(transports=("rdma", "tcp"))
    async with (
        TransferEngine(config, "a", b"rdma-hardware-secret") as a,
        TransferEngine(config, "b", b"rdma-hardware-secret") as b,
    ):
        remote = b.register("pool", bytearray(range(256)) * 4096, access=Access.READ_WRITE)
        local = a.register("buf", bytearray(256 * 4096))
        a.add_peer("b", b.address)
        batch = await a.submit([TransferOp.read("buf", 0, "b", "pool", 0, 256 * 4096)])
        assert await batch.wait(), batch.failures()
        assert batch.transport(0) == "rdma"
        assert bytes(local.view) == bytes(remote.view)
        local.view[:4] = b"abcd"
        batch = await a.submit([TransferOp.write("buf", 0, "b", "pool", 100, 4)])
        assert await batch.wait(), batch.failures()
        assert bytes(remote.view[100:104]) == b"abcd"
