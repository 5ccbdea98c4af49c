"""EngineCore with the host tiers: prefixes loaded instead of computed, same output."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mooncaked.cache.hashing import BlockHash
from mooncaked.cache.store import BlockLayout, TieredStore
from mooncaked.config import Config, StoreConfig, with_overrides
from mooncaked.engine.core import EngineCore
from mooncaked.engine.loader import LoadedModel, load_model
from mooncaked.engine.store_connector import TieredStoreConnector
from mooncaked.request import FinishReason, RequestOutput, SamplingParams
from tests.conftest import wait_until

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(Config().model)


async def start(
    loaded: LoadedModel, store_config: StoreConfig, **kw: object
) -> tuple[EngineCore, TieredStore]:
    engine = EngineCore(with_overrides(Config(), kv={"num_blocks": 256}), loaded)
    store = TieredStore(BlockLayout.from_kv_caches(engine.runner.kv_caches), store_config)
    await store.start()
    await engine.start(connector=TieredStoreConnector(store, **kw))  # type: ignore[arg-type]
    return engine, store


async def stop(engine: EngineCore, store: TieredStore) -> None:
    await engine.close()
    engine.check_integrity()
    await store.close()


async def run(engine: EngineCore, prompt: list[int]) -> tuple[list[int], RequestOutput]:
    ids: list[int] = []
    last: RequestOutput | None = None
    stream: AsyncIterator[RequestOutput] = engine.add_request(prompt, GREEDY)
    async for out in stream:
        ids += out.new_token_ids
        last = out
    assert last is not None
    return ids, last


def prompt_of(engine: EngineCore, n: int = 150) -> list[int]:
    return engine.tokenizer.encode("a long shared document about the sea " * 10)[:n]


async def test_second_serving_loads_from_dram_with_the_device_cache_cleared(
    loaded: LoadedModel,
) -> None:
    engine, store = await start(loaded, StoreConfig(dram_bytes=16 << 20))
    prompt = prompt_of(engine)
    cold_ids, cold = await run(engine, prompt)
    assert cold.num_cached_tokens == 0
    await store.flush()
    assert store.dram.num_cached >= len(prompt) // engine.block_size
    assert engine.reset_prefix_cache() > 0
    warm_ids, warm = await run(engine, prompt)
    assert warm_ids == cold_ids
    # Every full block but the one holding the last prompt token came from DRAM.
    assert warm.num_cached_tokens == (len(prompt) - 1) // engine.block_size * engine.block_size
    assert engine.stats().num_loads_total == 1
    assert engine.stats().kv_num_used_blocks == 0
    await stop(engine, store)


async def test_restart_on_the_same_ssd_path_serves_hits_from_ssd(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    cfg = StoreConfig(dram_bytes=16 << 20, ssd_path=str(tmp_path / "kv"), ssd_bytes=64 << 20)
    engine, store = await start(loaded, cfg)
    prompt = prompt_of(engine, 100)
    cold_ids, _ = await run(engine, prompt)
    await stop(engine, store)  # close flushes DRAM to the SSD

    engine, store = await start(loaded, cfg)
    assert store.dram.num_cached == 0
    warm_ids, warm = await run(engine, prompt)
    assert warm_ids == cold_ids
    assert warm.num_cached_tokens == (len(prompt) - 1) // engine.block_size * engine.block_size
    assert store.stats().ssd.hits > 0
    await stop(engine, store)


async def test_prefetch_gates_admission_and_a_timeout_only_costs_a_recompute(
    loaded: LoadedModel,
) -> None:
    asked: list[list[BlockHash]] = []
    gate = asyncio.Event()

    async def prefetch(hashes: list[BlockHash]) -> int:
        asked.append(hashes)
        await gate.wait()
        return 0

    engine, store = await start(
        loaded, StoreConfig(dram_bytes=16 << 20), prefetch=prefetch, prefetch_timeout_s=30.0
    )
    prompt = prompt_of(engine, 64)
    stream = engine.add_request(prompt, GREEDY)
    await wait_until(lambda: len(asked) == 1, "the prefetch to be asked")
    assert len(asked[0]) == 3  # 4 full blocks, the last recomputed
    # The engine's loop ran meanwhile and kept the request waiting.
    await wait_until(lambda: engine.load.num_waiting == 1, "a scheduling pass")
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 1
    gate.set()
    ids = [t async for out in stream for t in out.new_token_ids]
    assert len(ids) == GREEDY.max_tokens
    await stop(engine, store)

    gate.clear()
    engine, store = await start(
        loaded, StoreConfig(dram_bytes=16 << 20), prefetch=prefetch, prefetch_timeout_s=0.05
    )
    timed_out_ids, last = await run(engine, prompt)
    assert timed_out_ids == ids and last.finish_reason is FinishReason.LENGTH
    await stop(engine, store)


async def test_abort_while_waiting_for_prefetch_frees_everything(loaded: LoadedModel) -> None:
    never = asyncio.Event()

    async def prefetch(hashes: list[BlockHash]) -> int:
        await never.wait()
        return 0

    engine, store = await start(
        loaded, StoreConfig(dram_bytes=16 << 20), prefetch=prefetch, prefetch_timeout_s=30.0
    )
    stream = engine.add_request(prompt_of(engine, 64), GREEDY)
    await stream.aclose()
    await asyncio.wait_for(engine.wait_idle(), 10)
    engine.check_integrity()
    await stop(engine, store)
