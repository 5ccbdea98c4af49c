"""Segment access rights: read-only segments, write grants, shm modes, RDMA flags.

The attacks are made as a peer holding the cluster secret would make them:
straight on the wire (a hand-built WRITE frame), not through our own client,
which refuses such ops before they leave.
"""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from mooncaked.config import TransferConfig
from mooncaked.transfer import Access, SegmentError, SharedBuffer, TransferEngine, TransferOp
from mooncaked.transfer import protocol as p
from mooncaked.transfer.access import GrantTable, WriteGrant, parse_access
from mooncaked.transfer.rdma import mr_access_flags
from mooncaked.transfer.segment import SegmentDescriptor
from tests.conftest import ManualClock
from tests.transfer_attack import raw_write

SECRET = b"access-unit-secret"
TCP = TransferConfig(transports=("tcp",))
# A "KV cache" of 3 planes (layers x K/V) of 4 blocks of 64 bytes.
BLOCK, BLOCKS, PLANES = 64, 4, 3


def plane_offset(plane: int, block: int) -> int:
    return (plane * BLOCKS + block) * BLOCK


# -- grants without I/O ------------------------------------------------------------


def test_a_grant_covers_its_blocks_in_every_plane_and_nothing_else() -> None:
    g = WriteGrant(1, "kv", "p", BLOCK, BLOCKS, frozenset({1, 2}), deadline=1.0)
    assert g.covers(plane_offset(0, 1), BLOCK)
    assert g.covers(plane_offset(2, 2) + 10, 20)
    # Blocks 1 and 2 are adjacent in a plane: one range may span both.
    assert g.covers(plane_offset(1, 1), 2 * BLOCK)
    assert not g.covers(plane_offset(0, 0), BLOCK)
    assert not g.covers(plane_offset(0, 2), BLOCK + 1)  # one byte into block 3
    assert not g.covers(plane_offset(1, 3), 1)
    assert not g.covers(-1, 1)
    assert g.covers(plane_offset(0, 0), 0)


def test_grant_table_names_its_peer_expires_and_revokes() -> None:
    clock = ManualClock()
    table = GrantTable(clock)
    g = table.grant("kv", "p", block_bytes=BLOCK, blocks_per_plane=BLOCKS, block_ids=[3], ttl_s=5)
    assert table.allows("kv", "p", plane_offset(1, 3), BLOCK)
    assert not table.allows("kv", "q", plane_offset(1, 3), BLOCK)  # another peer
    assert not table.allows("other", "p", plane_offset(1, 3), BLOCK)  # another segment
    clock.now += 5.0
    assert not table.allows("kv", "p", plane_offset(1, 3), BLOCK)
    assert len(table) == 0
    g = table.grant("kv", "p", block_bytes=BLOCK, blocks_per_plane=BLOCKS, block_ids=[3], ttl_s=5)
    assert table.has_live("kv", "p")
    table.revoke(g)
    table.revoke(g)
    assert not table.has_live("kv", "p") and len(table) == 0
    for kwargs, match in [
        ({"block_ids": [4]}, "outside 0..3"),
        ({"ttl_s": 0}, "ttl_s"),
        ({"block_bytes": 0}, "block_bytes"),
    ]:
        args = {"block_bytes": BLOCK, "blocks_per_plane": BLOCKS, "block_ids": [0], "ttl_s": 1}
        with pytest.raises(ValueError, match=match):
            table.grant("kv", "p", **(args | kwargs))
    with pytest.raises(ValueError, match="unknown segment access 'rw'"):
        parse_access("rw")


def test_rdma_regions_get_only_the_remote_rights_of_their_access() -> None:
    # ibv_access_flags values as verbs.h (and pyverbs.enums) define them.
    enums = SimpleNamespace(
        IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_WRITE=2, IBV_ACCESS_REMOTE_READ=4
    )
    assert mr_access_flags(enums, Access.READ) == 1 | 4
    assert mr_access_flags(enums, Access.GRANTED) == 1 | 2
    assert mr_access_flags(enums, Access.READ_WRITE) == 1 | 2 | 4
    try:
        import pyverbs.enums as real  # type: ignore[import-not-found]
    except ImportError:
        return
    assert mr_access_flags(real, Access.READ) & real.IBV_ACCESS_REMOTE_WRITE == 0


def test_descriptors_carry_access() -> None:
    desc = SegmentDescriptor("n", "kv", 10, "cpu", ("tcp",), "h:1", Access.GRANTED)
    assert SegmentDescriptor.from_bytes(desc.to_bytes()).access is Access.GRANTED
    with pytest.raises(SegmentError, match="unknown segment access"):
        SegmentDescriptor.from_dict(desc.to_dict() | {"access": "everyone"})


# -- engines on loopback ------------------------------------------------------------


@pytest.fixture
async def victim() -> AsyncIterator[TransferEngine]:
    async with TransferEngine(TransferConfig(), "victim", SECRET) as engine:
        yield engine


async def test_writing_into_a_read_only_segment_is_refused_and_counted(
    victim: TransferEngine,
) -> None:
    seg = victim.allocate("dram", 4096)  # Access.READ: the default
    assert seg.access is Access.READ
    seg.view[:] = bytes(range(256)) * 16
    status, _ = await asyncio.to_thread(
        raw_write, victim.address, SECRET, "evil", "dram", 0, b"\0" * 4096
    )
    assert status == p.Status.FORBIDDEN
    assert bytes(seg.view) == bytes(range(256)) * 16
    m = victim.metrics()
    assert (m.served_forbidden, m.served_bytes_written) == (1, 4096)

    # Through our own client: refused before it leaves, over tcp and over shm.
    for config in (TCP, TransferConfig()):
        async with TransferEngine(config, "peer", SECRET) as peer:
            peer.allocate("buf", 4096)
            peer.add_peer("victim", victim.address)
            batch = await peer.submit([TransferOp.write("buf", 0, "victim", "dram", 0, 4096)])
            assert not await batch.wait()
            assert "read-only to peers" in batch.failures()[0][1]
            # Reading is what peers may do.
            batch = await peer.submit([TransferOp.read("buf", 0, "victim", "dram", 0, 4096)])
            assert await batch.wait(), batch.failures()
            assert bytes(peer.segment("buf").view) == bytes(seg.view)  # type: ignore[union-attr,arg-type]
    assert bytes(seg.view) == bytes(range(256)) * 16


async def test_granted_blocks_take_writes_from_the_granted_peer_until_the_deadline(
    victim: TransferEngine,
) -> None:
    kv = victim.allocate("kv", PLANES * BLOCKS * BLOCK, Access.GRANTED)
    async with (
        TransferEngine(TCP, "prefill", SECRET) as prefill,
        TransferEngine(TCP, "other", SECRET) as other,
    ):
        for engine in (prefill, other):
            engine.allocate("src", BLOCK).view[:] = b"\x07" * BLOCK  # type: ignore[index]
            engine.add_peer("victim", victim.address)

        def write(block: int, plane: int = 0) -> TransferOp:
            return TransferOp.write("src", 0, "victim", "kv", plane_offset(plane, block), BLOCK)

        async def attempt(engine: TransferEngine, *ops: TransferOp) -> list[str]:
            batch = await engine.submit(list(ops))
            await batch.wait()
            return [reason for _, reason in batch.failures()]

        # No grant yet: nothing lands.
        assert len(await attempt(prefill, write(1))) == 1
        grant = victim.grant_write(
            "kv", "prefill", block_bytes=BLOCK, blocks_per_plane=BLOCKS, block_ids=[1], ttl_s=0.5
        )
        assert await attempt(prefill, write(1, 0), write(1, 2)) == []
        # Another block, or another peer: refused, with a reason naming it.
        failed = await attempt(prefill, write(2))
        assert len(failed) == 1 and "no access right or live grant" in failed[0]
        assert len(await attempt(other, write(1))) == 1
        # Peers do not read a granted segment.
        read = TransferOp.read("src", 0, "victim", "kv", plane_offset(0, 1), BLOCK)
        assert "may not read" in (await attempt(prefill, read))[0]
        expected = bytearray(PLANES * BLOCKS * BLOCK)
        for plane in (0, 2):
            o = plane_offset(plane, 1)
            expected[o : o + BLOCK] = b"\x07" * BLOCK
        assert bytes(kv.view) == bytes(expected)  # type: ignore[arg-type]
        # After the deadline the same write is refused.
        await asyncio.sleep(0.6)
        assert len(await attempt(prefill, write(1, 1))) == 1
        # And after a revoke, however long the ttl.
        grant = victim.grant_write(
            "kv", "prefill", block_bytes=BLOCK, blocks_per_plane=BLOCKS, block_ids=[1], ttl_s=60
        )
        victim.revoke(grant)
        assert len(await attempt(prefill, write(1, 1))) == 1
        assert bytes(kv.view) == bytes(expected)  # type: ignore[arg-type]
        assert victim.metrics().served_forbidden == 5
        assert victim.num_grants == 0
    victim.allocate("ro", 64)
    for name, match in (("ro", "is read, not granted"), ("nope", "not registered")):
        with pytest.raises(SegmentError, match=match):
            victim.grant_write(name, "p", block_bytes=1, blocks_per_plane=1, block_ids=[0], ttl_s=1)


async def test_no_write_outlives_its_grant_by_any_path_on_the_same_host(
    victim: TransferEngine,
) -> None:
    """A peer on this host, holding the secret and once a live grant: after the
    grant ends (revoked or expired) nothing it does lands in the segment."""
    kv = victim.allocate("kv", PLANES * BLOCKS * BLOCK, Access.GRANTED)
    # A read-only segment beside it: the peer does get a shared-memory session.
    victim.allocate("dram", 4096)
    o = plane_offset(0, 2)
    async with TransferEngine(TransferConfig(), "prefill", SECRET) as prefill:
        prefill.allocate("src", BLOCK).view[:] = b"\x09" * BLOCK  # type: ignore[index]
        prefill.add_peer("victim", victim.address)
        op = TransferOp.write("src", 0, "victim", "kv", o, BLOCK)
        batch = await prefill.submit([op])
        assert not await batch.wait()  # no grant: refused
        for ttl_s, end in ((30.0, "revoke"), (0.3, "expire")):
            grant = victim.grant_write(
                "kv",
                "prefill",
                block_bytes=BLOCK,
                blocks_per_plane=BLOCKS,
                block_ids=[2],
                ttl_s=ttl_s,
            )
            # Under the grant the write lands, over tcp: checked op by op.
            batch = await prefill.submit([op])
            assert await batch.wait(), batch.failures()
            transport = batch.transport(0)
            assert bytes(kv.view[o : o + BLOCK]) == b"\x09" * BLOCK  # type: ignore[index]
            # Asked for straight on the shared-memory channel, while the grant
            # is live, the mapping is refused: nothing to keep past the grant.
            link = prefill._peers["victim"]
            assert link.shm is not None
            remote = link.link.cached("kv")
            assert remote is not None
            link.shm.unwatch()
            mapping = await asyncio.to_thread(link.shm.open, remote)
            link.shm.watch(asyncio.get_running_loop())
            if end == "revoke":
                victim.revoke(grant)
            else:
                await asyncio.sleep(0.4)
            # Every path the peer has: its mapping (had it got one), and tcp.
            if mapping is not None:
                mapping.buffer.view[o : o + BLOCK] = b"\x66" * BLOCK
            prefill.allocate("evil", BLOCK).view[:] = b"\x77" * BLOCK  # type: ignore[index]
            batch = await prefill.submit([TransferOp.write("evil", 0, "victim", "kv", o, BLOCK)])
            assert not await batch.wait()
            assert "no access right or live grant" in batch.failures()[0][1]
            prefill.unregister("evil")
            assert bytes(kv.view[o : o + BLOCK]) == b"\x09" * BLOCK, end  # type: ignore[index]
            assert mapping is None and not remote.shm and transport == "tcp"
            kv.view[o : o + BLOCK] = bytes(BLOCK)  # type: ignore[index]
        assert victim.num_grants == 0
        # The first write, and per grant the shm open and the late write.
        assert victim.metrics().served_forbidden == 5


async def test_shared_memory_is_the_daemon_users_only_and_read_only_to_peers(
    victim: TransferEngine,
) -> None:
    ro = victim.allocate("dram", 4096)
    rw = victim.allocate("kv", 4096, Access.GRANTED)
    for seg in (ro, rw):
        assert stat.S_IMODE(os.fstat(seg.shm_fd).st_mode) == 0o600
    # What a peer of a read-only segment receives cannot be mapped writable.
    fd = ro.peer_fd()
    assert fd != ro.shm_fd
    assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    with pytest.raises(PermissionError):
        mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    assert rw.peer_fd() == rw.shm_fd

    # A peer on this host maps it read-only, and reads over shm.
    async with TransferEngine(TransferConfig(), "peer", SECRET) as peer:
        peer.allocate("buf", 4096)
        peer.add_peer("victim", victim.address)
        batch = await peer.submit([TransferOp.read("buf", 0, "victim", "dram", 0, 4096)])
        assert await batch.wait(), batch.failures()
        assert batch.transport(0) == "shm"
        link = peer._peers["victim"]
        mapping = link.shm.mapping(link.link.cached("dram"))  # type: ignore[union-attr,arg-type]
        assert mapping is not None and not mapping.buffer.writable
        assert mapping.buffer.view.readonly


async def test_a_file_mapped_read_only_is_served_and_nothing_lands_in_it(
    victim: TransferEngine, tmp_path: Path
) -> None:
    # An object's origin registers its file this way: peers read it (over shm
    # and tcp), and neither they nor this process can write it.
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 16)
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer = SharedBuffer(fd, 4096, owns_fd=False, writable=False)
    finally:
        os.close(fd)
    seg = victim.register("file", buffer)
    assert seg.read_only and seg.is_shared
    victim.allocate("scratch", 4096)
    with pytest.raises(SegmentError, match="read-only memory"):
        await victim.submit([TransferOp.read("file", 0, "victim", "scratch", 0, 4096)])
    status, _ = await asyncio.to_thread(
        raw_write, victim.address, SECRET, "evil", "file", 0, b"\0" * 4096
    )
    assert status == p.Status.FORBIDDEN
    for config in (TCP, TransferConfig()):
        async with TransferEngine(config, "peer", SECRET) as peer:
            peer.allocate("buf", 4096)
            peer.add_peer("victim", victim.address)
            batch = await peer.submit([TransferOp.read("buf", 0, "victim", "file", 0, 4096)])
            assert await batch.wait(), batch.failures()
            assert batch.transport(0) == ("tcp" if config is TCP else "shm")
            assert bytes(peer.segment("buf").view) == path.read_bytes()  # type: ignore[union-attr,arg-type]
    assert path.read_bytes() == bytes(range(256)) * 16
    victim.unregister("file")
    buffer.close()
