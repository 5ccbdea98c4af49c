"""NodeBlocks, BlockLog, deltas, longest_prefix, the wire codec and the view's JSON."""

from __future__ import annotations

import dataclasses
import random

import pytest

from mooncaked.cache.tiers import Tier
from mooncaked.cluster import wire
from mooncaked.cluster.block_index import (
    ApplyResult,
    BlockDelta,
    BlockLog,
    BlockOp,
    NodeBlocks,
    join_chunks,
    merge_deltas,
    tier_mask,
)
from mooncaked.cluster.state import ClusterView, Member, MemberStatus, NodeLoad, StageInfo
from tests.cluster_views import member

GEN = 5


def h(i: int) -> bytes:
    # Some hashes end in zero bytes: packing must not strip them.
    return i.to_bytes(4, "big") + bytes(12)


def new_log(max_log_entries: int = 1000) -> BlockLog:
    return BlockLog("a", GEN, NodeBlocks(GEN), max_log_entries)


def stored(*ids: int, tier: Tier = Tier.DRAM) -> list[tuple[bytes, Tier, BlockOp]]:
    return [(h(i), tier, BlockOp.STORED) for i in ids]


def removed(*ids: int, tier: Tier = Tier.DRAM) -> list[tuple[bytes, Tier, BlockOp]]:
    return [(h(i), tier, BlockOp.REMOVED) for i in ids]


def test_record_keeps_a_tier_mask_per_block() -> None:
    log = new_log()
    assert log.record(stored(1, 2)) == 2
    assert log.record(stored(1, tier=Tier.SSD)) == 1
    assert log.record(stored(1)) == 0  # already there: no change, no event
    assert log.record(removed(2)) == 1
    assert log.index.masks == {h(1): 0b110}
    assert log.num_events == 5


def test_flush_coalesces_upserts_first_then_removals() -> None:
    log = new_log()
    log.record(stored(1, 2, 3))
    first = log.flush()
    assert first is not None
    assert (first.from_version, first.to_version, first.num_upserts) == (0, 3, 3)
    log.record(removed(2))
    log.record(stored(4))
    log.record(removed(4))  # stored and removed in one batch: a removal
    log.record(stored(5))
    d = log.flush()
    assert d is not None
    assert (d.from_version, d.to_version, d.num_upserts) == (3, 6, 1)
    assert d.hashes == h(5) + h(2) + h(4)
    assert d.masks == bytes([0b10, 0, 0])
    assert log.flush() is None


def test_replica_applies_in_order_ignores_stale_and_reports_gaps() -> None:
    log = new_log()
    log.record(stored(1, 2))
    d1 = log.flush()
    log.record(removed(1))
    log.record(stored(3))
    d2 = log.flush()
    assert d1 is not None and d2 is not None
    replica = NodeBlocks(GEN)
    assert replica.apply(d2) is ApplyResult.GAP
    assert replica.masks == {}
    assert replica.apply(d1) is ApplyResult.APPLIED
    assert replica.apply(d1) is ApplyResult.STALE
    assert replica.apply(d2) is ApplyResult.APPLIED
    assert replica.masks == log.index.masks
    assert replica.version == log.version == 4


def test_overlapping_merged_delta_is_harmless() -> None:
    log = new_log()
    log.record(stored(1))
    d1 = log.flush()
    log.record(removed(1))
    log.record(stored(2))
    d2 = log.flush()
    log.record(stored(1, tier=Tier.SSD))
    d3 = log.flush()
    assert d1 and d2 and d3
    replica = NodeBlocks(GEN)
    replica.apply(d1)
    replica.apply(d2)
    # A replica at version 3 gets the merge of all three (from 0): same result.
    merged = merge_deltas([d1, d2, d3])
    assert (merged.from_version, merged.to_version) == (0, 4)
    assert replica.apply(merged) is ApplyResult.APPLIED
    assert replica.masks == log.index.masks == {h(1): 0b100, h(2): 0b010}


def test_since_gives_a_delta_from_the_log_or_a_snapshot_once_trimmed() -> None:
    log = new_log(max_log_entries=4)
    for i in range(5):
        log.record(stored(10 * i, 10 * i + 1))
        log.flush()
    # 10 entries in batches of 2; the log keeps the last 2 batches (4 entries).
    assert log.since(GEN, log.version) is None
    recent = log.since(GEN, 6)
    assert recent is not None and not recent.is_snapshot
    assert (recent.from_version, recent.to_version) == (6, 10)
    old = log.since(GEN, 2)
    assert old is not None and old.is_snapshot
    other_gen = log.since(GEN - 1, 6)
    assert other_gen is not None and other_gen.is_snapshot
    replica = NodeBlocks(GEN)
    replica.masks[h(999)] = 1  # junk a snapshot must wipe
    assert replica.apply(old) is ApplyResult.APPLIED
    assert replica.masks == log.index.masks and replica.version == 10


def test_new_generation_resets_the_replica() -> None:
    replica = NodeBlocks(GEN)
    replica.masks[h(1)] = 1
    replica.version = 7
    d = BlockDelta("a", GEN + 1, 0, 1, h(2), b"\x01", 1)
    assert replica.apply(d) is ApplyResult.APPLIED
    assert replica.masks == {h(2): 1} and replica.generation == GEN + 1
    old = BlockDelta("a", GEN, 7, 8, h(3), b"\x01", 1)
    assert replica.apply(old) is ApplyResult.STALE


def test_split_pieces_chain_and_chunks_rejoin() -> None:
    log = new_log()
    log.record(stored(*range(10)))
    log.record(removed(3))  # stored and removed before a flush: goes out as a removal
    log.flush()
    log.record(removed(*range(4)))  # 3 is already gone: no change
    log.record(stored(20, 21))
    d = log.flush()
    assert d is not None and d.num_entries == 5 and d.num_upserts == 2
    pieces = d.split(4)
    assert [(p.from_version, p.to_version, p.num_upserts) for p in pieces] == [
        (10, 14, 2),
        (14, 15, 0),
    ]
    whole = log.since(GEN, 0)
    assert whole is not None and (whole.from_version, whole.to_version) == (0, 15)
    replica = NodeBlocks(GEN)
    assert replica.apply(whole) is ApplyResult.APPLIED
    assert replica.masks == log.index.masks
    chunks = d.chunks(4)
    assert [(c.from_version, c.to_version, c.num_upserts) for c in chunks] == [
        (10, 15, 2),
        (10, 15, 0),
    ]
    assert join_chunks(chunks) == d
    with pytest.raises(ValueError):
        join_chunks([chunks[0], BlockDelta("b", GEN, 10, 15, b"", b"", 0)])
    with pytest.raises(RuntimeError):
        whole.split(1)


def test_split_pieces_apply_in_sequence() -> None:
    log = new_log()
    log.record(stored(*range(7)))
    d = log.flush()
    assert d is not None
    replica = NodeBlocks(GEN)
    pieces = d.split(3)
    assert len(pieces) == 3
    assert replica.apply(pieces[1]) is ApplyResult.GAP
    for p in pieces:
        assert replica.apply(p) is ApplyResult.APPLIED
    assert replica.masks == log.index.masks


def test_record_rejects_bad_events() -> None:
    log = new_log()
    with pytest.raises(ValueError, match="tier"):
        log.record([(h(1), "nvme", BlockOp.STORED)])
    with pytest.raises(ValueError, match="16 bytes"):
        log.record([(b"short", Tier.DRAM, BlockOp.STORED)])
    with pytest.raises(ValueError, match="op"):
        log.record([(h(1), Tier.DRAM, "kept")])


def _member(node_id: str, status: MemberStatus = MemberStatus.ALIVE) -> Member:
    return member(
        node_id,
        "decode",
        status=status,
        version=3,
        api_addr="127.0.0.1:8000",
        load=NodeLoad(10, 2, 0.5, 0.1),
    )


def _replica(masks: dict[bytes, int]) -> NodeBlocks:
    blocks = NodeBlocks(1)
    blocks.masks.update(masks)
    return blocks


def test_longest_prefix_counts_leading_blocks_and_tiers() -> None:
    view = ClusterView("a", clock=lambda: 10.0)
    seq = [h(i) for i in range(6)]
    view.blocks["a"] = _replica({seq[0]: 0b001, seq[1]: 0b011, seq[2]: 0b100, seq[4]: 0b001})
    view.blocks["b"] = _replica(
        {seq[0]: 0b100, seq[1]: 0b100, seq[2]: 0b110, seq[3]: 1, seq[4]: 1, seq[5]: 1}
    )
    # No first block: no prefix at all.
    view.blocks["c"] = _replica({seq[1]: 1, seq[2]: 1})
    m = view.longest_prefix(seq)
    assert sorted(m) == ["a", "b"]
    assert (m["a"].num_blocks, m["a"].tier_blocks) == (3, (2, 0, 1))
    assert (m["b"].num_blocks, m["b"].tier_blocks) == (6, (3, 1, 2))
    assert m["a"].slowest_tier is Tier.SSD
    assert view.longest_prefix([]) == {}


def test_longest_prefix_in_some_tiers_only() -> None:
    view = ClusterView("a", clock=lambda: 10.0)
    seq = [h(i) for i in range(4)]
    # Device and DRAM, DRAM only, device only, SSD: a lease reaches two.
    view.blocks["a"] = _replica({seq[0]: 0b011, seq[1]: 0b010, seq[2]: 0b001, seq[3]: 0b100})
    # The first block on the device only.
    view.blocks["b"] = _replica({seq[0]: 0b001, seq[1]: 0b110})
    leasable = tier_mask("dram", "ssd")
    assert leasable == tier_mask(Tier.DRAM, Tier.SSD) == 0b110
    m = view.longest_prefix(seq, tiers=leasable)
    assert sorted(m) == ["a"]
    # A block in device and DRAM counts under DRAM once the device is left out.
    assert (m["a"].num_blocks, m["a"].tier_blocks) == (2, (0, 2, 0))
    m = view.longest_prefix(seq)
    assert (m["a"].num_blocks, m["a"].tier_blocks) == (4, (2, 1, 1))
    assert (m["b"].num_blocks, m["b"].tier_blocks) == (2, (1, 1, 0))
    assert view.longest_prefix(seq, tiers=tier_mask("ssd")) == {}
    with pytest.raises(ValueError, match="unknown tier"):
        tier_mask("hbm")


def test_both_prefixes_in_one_pass_are_the_two_lookups() -> None:
    rng = random.Random(7)
    seq = [h(i) for i in range(12)]
    for _ in range(200):
        view = ClusterView("a", clock=lambda: 10.0)
        for node in "abcdef":
            blocks = NodeBlocks(1)
            for x in seq:
                if rng.random() < 0.85:
                    blocks.masks[x] = rng.randrange(1, 8)
            view.blocks[node] = blocks
        tiers = rng.choice([0b110, 0b010, 0b100, 0b111])
        every, some = view.longest_prefixes(seq, tiers)
        assert every == view.longest_prefix(seq)
        assert some == view.longest_prefix(seq, tiers=tiers)
    assert view.longest_prefixes([], 0b110) == ({}, {})


def test_to_json_lists_members_and_summary() -> None:
    view = ClusterView("a", clock=lambda: 10.0)
    view.members["a"] = _member("a")
    view.members["b"] = _member("b", MemberStatus.SUSPECT)
    view.members["c"] = _member("c", MemberStatus.DEAD)
    view.blocks["a"] = NodeBlocks(1)
    view.blocks["a"].masks[h(1)] = 1
    doc = view.to_json()
    assert doc["self"] == "a"
    assert [n["node_id"] for n in doc["nodes"]] == ["a", "b", "c"]
    assert [n["status"] for n in doc["nodes"]] == ["alive", "suspect", "dead"]
    assert doc["nodes"][0]["cached_blocks"] == 1 and doc["nodes"][0]["last_heard_s"] == 10.0
    assert doc["summary"]["by_status"] == {"alive": 1, "suspect": 1, "dead": 1, "left": 0}
    assert doc["summary"]["by_role"] == {"decode": 2}
    assert doc["summary"]["queued_prefill_tokens"] == 20
    assert "packets_sent" in doc["counters"]
    assert [m.node_id for m in view.schedulable()] == ["a"]


def test_wire_roundtrip_of_state_and_blocks() -> None:
    codec = wire.Codec(b"secret-secret", "node-1")
    st = _member("node-1").state
    assert st is not None
    d = BlockDelta("node-1", 7, 3, 5, h(1) + h(2), b"\x05\x00", 1)
    packet = codec.seal(
        [wire.msg_frame({"t": "state", **wire.state_to_json(st)}), wire.blocks_frame(d)]
    )
    sender, frames = wire.Codec(b"secret-secret", "other").open(packet, 1400)
    assert sender == "node-1"
    assert [k for k, _ in frames] == [wire.FRAME_MSG, wire.FRAME_BLOCKS]
    assert wire.state_from_json(wire.decode_msg(frames[0][1])) == st
    assert wire.decode_blocks(frames[1][1]) == d
    assert len(wire.blocks_frame(d)) == wire.blocks_frame_size("node-1", 2)
    with pytest.raises(wire.AuthError):
        wire.Codec(b"another-secret", "x").open(packet, 1400)
    with pytest.raises(wire.WireError, match="exceeds"):
        codec.open(packet, 10)
    bad = dict(wire.state_to_json(st), load=[1, 2, "x", 4, 0, 0])
    with pytest.raises(wire.WireError):
        wire.state_from_json(bad)
    with pytest.raises(ValueError):
        wire.Codec(b"short", "x")


def test_a_stage_s_place_in_its_group_travels_and_is_bounded() -> None:
    st = _member("node-1").state
    assert st is not None
    staged = dataclasses.replace(st, stage=StageInfo("g", 1, 2, 15, 30, 30, 1152, 512, 4096))
    doc = wire.state_to_json(staged)
    assert wire.state_from_json(doc) == staged
    assert wire.state_from_json(wire.state_to_json(st)).stage is None
    for bad in (
        ["g", 2, 2, 15, 30, 30, 1152, 512, 0],  # index past the stages
        ["g", 1, 2, 30, 30, 30, 1152, 512, 0],  # an empty layer range
        ["g", 1, 99, 15, 30, 30, 1152, 512, 0],  # more stages than allowed
        ["", 1, 2, 15, 30, 30, 1152, 512, 0],
        ["g", 1, 2, 15, 30, 30, 1152, 512, -1],
        ["g", 1, 2, 15, 30],
    ):
        with pytest.raises(wire.WireError):
            wire.state_from_json({**doc, "stage": bad})


def test_check_integrity_catches_contradictions() -> None:
    view = ClusterView("a", clock=lambda: 0.0)
    with pytest.raises(RuntimeError, match="own node"):
        view.check_integrity()
    view.members["a"] = _member("a")
    view.blocks["a"] = NodeBlocks(1)
    view.check_integrity()
    view.members["b"] = _member("b", MemberStatus.DEAD)
    view.blocks["b"] = NodeBlocks(1)
    view.blocks["b"].masks[h(1)] = 1
    with pytest.raises(RuntimeError, match="dead but still holds blocks"):
        view.check_integrity()
    view.blocks["b"].masks.clear()
    view.blocks["c"] = NodeBlocks(1)
    with pytest.raises(RuntimeError, match="unknown members"):
        view.check_integrity()


def test_to_json_shows_a_stage_of_a_pipelined_group() -> None:
    view = ClusterView("a", clock=lambda: 10.0)
    stage = StageInfo("cpp-0", 1, 2, 2, 4, 4, 256, 512)
    view.members["a"] = member("a", "prefill", stage=stage)
    view.members["b"] = _member("b")
    states = [n["state"] for n in view.to_json()["nodes"]]
    assert states[0]["stage"] == {
        "group": "cpp-0",
        "index": 1,
        "num_stages": 2,
        "layer_lo": 2,
        "layer_hi": 4,
        "num_layers": 4,
        "act_bytes_per_token": 256,
        "chunk_tokens": 512,
        "max_tokens": 0,
    }
    assert states[1]["stage"] is None
