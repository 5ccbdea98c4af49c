"""The vLLM connector's bookkeeping, without vLLM: its configuration, what it
asks the node for, what each step loads and saves, and which loads failed."""

from __future__ import annotations

import pytest

from mooncaked.cache.hashing import block_hashes
from mooncaked.cache.peer import Offer
from mooncaked.integrations.vllm_plan import (
    ConnectorConfig,
    LoadBook,
    LoadSpec,
    SchedulerBook,
    failed_vllm_blocks,
    matched_tokens,
)

BS = 16
MODEL = "hf:SmolLM2@0123"


def offer(n: int, lease_id: int = 7) -> Offer:
    return Offer("http://node", "node-a", lease_id, tuple(range(0, n * 100, 100)), 100, "kv", "a:1")


def test_the_config_names_what_is_wrong() -> None:
    extra = {"node_url": "http://127.0.0.1:8000/", "secret": "s" * 16, "load_rows": 4}
    cfg = ConnectorConfig.from_extra(extra, default_name="vllm-1", env={})
    assert (cfg.node_url, cfg.secret, cfg.name, cfg.load_rows) == (
        "http://127.0.0.1:8000",
        b"s" * 16,
        "vllm-1",
        4,
    )
    env = {"MOONCAKED_CLUSTER_SECRET": "from-the-env"}
    assert ConnectorConfig.from_extra(
        {"node_url": "http://n"}, default_name="x", env=env
    ).secret == (b"from-the-env")
    with pytest.raises(ValueError, match="node_url"):
        ConnectorConfig.from_extra({"secret": "s" * 16}, default_name="x", env={})
    with pytest.raises(ValueError, match="secret"):
        ConnectorConfig.from_extra(
            {"node_url": "http://n", "secret": "short"}, default_name="x", env={}
        )
    with pytest.raises(ValueError, match="save_rows"):
        ConnectorConfig.from_extra(
            {"node_url": "http://n", "secret": "s" * 16, "save_rows": 0}, default_name="x", env={}
        )


def test_a_secret_file_others_may_read_is_refused(tmp_path) -> None:
    f = tmp_path / "secret"
    f.write_text("a-long-enough-secret\n")
    f.chmod(0o644)
    with pytest.raises(ValueError, match="grants group or others"):
        ConnectorConfig.from_extra(
            {"node_url": "http://n", "secret_file": str(f)}, default_name="x", env={}
        )
    f.chmod(0o600)
    cfg = ConnectorConfig.from_extra(
        {"node_url": "http://n", "secret_file": str(f)}, default_name="x", env={}
    )
    assert cfg.secret == b"a-long-enough-secret"


def test_matched_tokens_leave_the_last_prompt_token_to_compute() -> None:
    # 64 prompt tokens, 4 node blocks held: 63 may be loaded, whole blocks: 48.
    assert matched_tokens(64, 0, 4, BS) == 48
    assert matched_tokens(65, 0, 4, BS) == 64
    # Past vLLM's own hit of 32 tokens.
    assert matched_tokens(65, 32, 4, BS) == 32
    assert matched_tokens(65, 64, 4, BS) == 0
    assert matched_tokens(10, 0, 4, BS) == 0


def test_the_scheduler_asks_past_vllms_hit_once_and_loads_what_vllm_allocated() -> None:
    book = SchedulerBook(MODEL, BS, max_load_blocks=8)
    prompt = list(range(100))  # 6 full blocks, the last token computed by vLLM
    hashes = book.hashes("r1", prompt)
    assert hashes == block_hashes(prompt, BS, MODEL)
    # vLLM's own prefix cache holds the first block: ask from block 1 on.
    first, asked = book.to_ask("r1", 16)  # type: ignore[misc]
    assert first == 1 and asked == hashes[1:6]
    assert book.offered("r1", 16, offer(3)) is None
    assert book.num_matched("r1") == 48
    # Asked again for the same hit: the answer stands, nothing is leased twice.
    assert book.to_ask("r1", 16) is None
    # vLLM took two of the three blocks: the load is cut to them.
    assert book.allocated("r1", [10, 11, 12, 13, 14, 15, 16], 32) is None
    book.scheduled("r1", [10, 11, 12, 13, 14, 15, 16], 100, replace=True)
    meta = book.build(save=True)
    (load,) = meta.loads
    assert (load.req_id, load.first, load.count, load.block_ids[:2]) == ("r1", 1, 2, (10, 11))
    # Blocks 0 (vLLM's hit) to 2 (loaded) are on the node; 3 to 5 are put.
    (save,) = meta.saves
    assert (save.first, save.hashes) == (3, tuple(hashes[3:6]))
    assert book.build(save=True).loads == []


def test_saves_follow_chunked_prefill_and_a_finished_request_gives_its_lease_back() -> None:
    book = SchedulerBook(MODEL, BS, max_load_blocks=8)
    hashes = book.hashes("r1", list(range(80)))
    book.to_ask("r1", 0)
    book.offered("r1", 0, None)
    assert book.allocated("r1", [0, 1, 2, 3, 4], 0) is None
    book.scheduled("r1", [0, 1, 2], 40, replace=True)
    assert [s.hashes for s in book.build(save=True).saves] == [tuple(hashes[0:2])]
    book.scheduled("r1", [3, 4], 80, replace=False)
    (save,) = book.build(save=True).saves
    assert (save.first, save.hashes, save.block_ids) == (2, tuple(hashes[2:5]), (0, 1, 2, 3, 4))
    # Decode steps add no prompt blocks.
    book.scheduled("r1", [], 81, replace=False)
    assert book.build(save=True).saves == []
    # A request that leased and never ran gives its lease back when it ends.
    book.hashes("r2", list(range(40)))
    book.offered("r2", 0, offer(2, lease_id=9))
    lease = book.finished("r2")
    assert lease is not None and lease.lease_id == 9
    assert book.finished("r1") is None
    assert book.num_requests() == 0


def test_a_partial_load_fails_every_vllm_block_from_its_first_missing_one() -> None:
    # Node blocks 2..7 into vLLM blocks of 32 tokens (2 node blocks each).
    spec = LoadSpec("r1", (40, 41, 42, 43), 2, offer(6))
    assert failed_vllm_blocks(spec, 6, 2) == set()
    assert failed_vllm_blocks(spec, 3, 2) == {42, 43}
    assert failed_vllm_blocks(spec, 0, 2) == {41, 42, 43}


def test_the_load_book_reports_each_load_once_with_its_failed_blocks() -> None:
    book = LoadBook(per_vllm_block=1)
    book.started(LoadSpec("ok", (1, 2), 0, offer(2)))
    book.started(LoadSpec("bad", (5, 6, 7), 0, offer(3)))
    assert book.num_in_flight() == 2
    book.landed("ok", 2)
    book.landed("bad", 1)
    assert book.take() == ({"ok", "bad"}, {"bad"}, {6, 7})
    assert book.take() == (set(), set(), set())
    assert (book.blocks_loaded, book.bytes_loaded, book.blocks_failed) == (3, 300, 2)
    assert book.num_in_flight() == 0
