"""EngineCore end to end on the builtin model: batching never changes greedy output."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from mooncaked.config import Config, with_overrides
from mooncaked.engine.core import EngineCore, PromptTooLongError, QueueFullError
from mooncaked.engine.kv_sender import KVSender
from mooncaked.engine.loader import LoadedModel, load_model
from mooncaked.handoff import Handoff, KVGrant
from mooncaked.request import FinishReason, KVSent, RequestOutput, SamplingParams
from tests.conftest import wait_until

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(Config().model)


async def start(loaded: LoadedModel, **sections: dict[str, object]) -> EngineCore:
    engine = EngineCore(with_overrides(Config(), **sections), loaded)
    await engine.start()
    return engine


async def collect(stream: AsyncIterator[RequestOutput]) -> tuple[list[int], str, RequestOutput]:
    ids: list[int] = []
    text = ""
    last: RequestOutput | None = None
    async for out in stream:
        ids += out.new_token_ids
        text += out.text
        last = out
    assert last is not None and last.finished
    return ids, text, last


def prompts(engine: EngineCore, n: int, length: int = 40) -> list[list[int]]:
    # Distinct prompts of varied lengths, some longer than one chunk.
    out = []
    for i in range(n):
        text = f"request {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 5)
        out.append(engine.tokenizer.encode(text)[: length + 13 * i])
    return out


async def solo_outputs(engine: EngineCore, ps: list[list[int]]) -> list[list[int]]:
    return [(await collect(engine.add_request(p, GREEDY)))[0] for p in ps]


async def test_concurrent_chunked_and_preempted_runs_match_solo_greedy(
    loaded: LoadedModel,
) -> None:
    reference = await start(loaded)
    ps = prompts(reference, 12)
    expected = await solo_outputs(reference, ps)
    await reference.close()
    assert len({tuple(e) for e in expected}) == len(expected), "prompts should diverge"

    # Tight budget (chunked prefill) and a pool too small for all at once
    # (preemption by recompute), prefix caching off so nothing is shared.
    engine = await start(
        loaded,
        scheduler={"max_num_batched_tokens": 32, "max_num_seqs": 12},
        kv={"num_blocks": 40, "enable_prefix_caching": False},
    )
    results = await asyncio.gather(*(collect(engine.add_request(p, GREEDY)) for p in ps))
    assert [r[0] for r in results] == expected
    assert all(r[2].finish_reason is FinishReason.LENGTH for r in results)
    stats = engine.stats()
    assert stats.num_preemptions_total > 0
    assert stats.kv_num_used_blocks == 0
    engine.check_integrity()
    await engine.close()


async def test_prefix_hit_reports_cached_tokens_and_keeps_output(loaded: LoadedModel) -> None:
    engine = await start(loaded)
    prompt = engine.tokenizer.encode("a shared system prompt " * 8)
    ids1, text1, last1 = await collect(engine.add_request(prompt, GREEDY))
    ids2, text2, last2 = await collect(engine.add_request(prompt, GREEDY))
    assert last1.num_cached_tokens == 0
    full_blocks = len(prompt) // engine.block_size
    # All full blocks hit, except the last when the prompt is block-aligned.
    assert last2.num_cached_tokens in (
        full_blocks * engine.block_size,
        (full_blocks - 1) * engine.block_size,
    )
    assert last2.num_cached_tokens > 0
    assert (ids1, text1) == (ids2, text2)
    assert engine.stats().prefix_hit_tokens == last2.num_cached_tokens
    await engine.close()


async def test_stop_string_cuts_text_and_finishes(loaded: LoadedModel) -> None:
    engine = await start(loaded)
    prompt = engine.tokenizer.encode("tell me a story")
    _, text, _ = await collect(engine.add_request(prompt, GREEDY))
    stop = text[10:13]
    assert stop and stop not in text[:10]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    ids, stopped, last = await collect(engine.add_request(prompt, sp))
    assert stopped == text[: text.index(stop)]
    assert last.finish_reason is FinishReason.STOP
    assert len(ids) < 24
    engine.check_integrity()
    assert engine.stats().kv_num_used_blocks == 0
    await engine.close()


async def test_seeded_sampling_is_reproducible_and_logprobs_are_reported(
    loaded: LoadedModel,
) -> None:
    engine = await start(loaded)
    prompt = engine.tokenizer.encode("sample me")

    def sp(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=seed, logprobs=3)

    a = await collect(engine.add_request(prompt, sp(1)))
    # The same seed alongside other traffic: batch composition must not matter.
    b, _ = await asyncio.gather(
        collect(engine.add_request(prompt, sp(1))),
        collect(engine.add_request(prompt, sp(2))),
    )
    c = await collect(engine.add_request(prompt, sp(3)))
    assert a[0] == b[0]
    assert a[0] != c[0]
    logprobs = []
    async for out in engine.add_request(prompt, sp(1)):
        logprobs += out.logprobs
    assert [lp.token_id for lp in logprobs] == a[0]
    assert all(lp.logprob <= 0 and len(lp.top) == 3 for lp in logprobs)
    await engine.close()


async def test_abort_mid_stream_frees_blocks(loaded: LoadedModel) -> None:
    engine = await start(loaded)
    long = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    stream = engine.add_request(engine.tokenizer.encode("never ending"), long)
    async for out in stream:
        if out.new_token_ids:
            break
    assert engine.stats().kv_num_used_blocks > 0
    await stream.aclose()
    await asyncio.wait_for(engine.wait_idle(), 30)
    engine.check_integrity()
    assert engine.stats().kv_num_used_blocks == 0
    await engine.close()


async def test_bad_requests_are_refused_up_front(loaded: LoadedModel) -> None:
    engine = await start(loaded, scheduler={"max_waiting": 1, "max_num_seqs": 1})
    with pytest.raises(PromptTooLongError, match="maximum context length is 4096"):
        engine.add_request([1] * 4000, SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([10**6], SamplingParams())
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request([], SamplingParams())
    # One request runs, one waits, the next is refused until the queue drains.
    first = engine.add_request([65, 66], SamplingParams(max_tokens=50))
    await anext(first)  # it has been admitted and runs
    second = engine.add_request([65, 67], SamplingParams(max_tokens=5))
    with pytest.raises(QueueFullError):
        engine.add_request([65, 68], SamplingParams(max_tokens=5))
    await collect(first)
    await collect(second)
    await engine.close()


async def test_close_aborts_in_flight_requests(loaded: LoadedModel) -> None:
    engine = await start(loaded)
    stream = engine.add_request([65] * 10, SamplingParams(max_tokens=3000, ignore_eos=True))
    await engine.close()
    _, _, last = await collect(stream)
    assert last.finish_reason is FinishReason.ABORT


async def test_idle_engine_runs_the_pool_self_check(loaded: LoadedModel) -> None:
    engine = await start(loaded)
    await collect(engine.add_request([65, 66, 67], SamplingParams(max_tokens=3)))
    await asyncio.wait_for(engine.wait_idle(), 10)
    # The loop reaches its idle point, where it checks the pool.
    await wait_until(lambda: engine.num_checks == 1, "the first idle self-check")
    assert engine.num_integrity_failures == 0
    # Break an invariant behind the engine's back: the next idle check sees it.
    engine.pool.blocks[-1].ref_cnt += 1
    await collect(engine.add_request([65, 68], SamplingParams(max_tokens=2)))
    await wait_until(lambda: engine.num_checks == 2, "the second idle self-check")
    assert engine.num_integrity_failures == 1
    engine.pool.blocks[-1].ref_cnt -= 1
    await engine.close()


class _Writer:
    """Takes every KV write and says it landed (the decode node is not real)."""

    def __init__(self) -> None:
        self.num_bytes = 0

    def add_peer(self, node_id: str, address: str) -> None:
        pass

    async def write(
        self, segment: str, writes: list[tuple[int, str, str, int, int]], timeout_s: float
    ) -> tuple[bool, str]:
        self.num_bytes += sum(w[4] for w in writes)
        return True, ""


async def test_a_granted_requests_last_output_says_what_its_kv_came_to(
    loaded: LoadedModel,
) -> None:
    engine = EngineCore(with_overrides(Config(), scheduler={"max_num_batched_tokens": 32}), loaded)
    layout = engine.runner.kv_layout
    writer = _Writer()
    sender = KVSender(writer, segment="kv", layout=layout, loop=asyncio.get_running_loop())
    await engine.start(connector=sender)
    prompt = list(range(3, 73))  # 70 tokens: three chunks of 32
    grant = KVGrant(
        request_id="r",
        node_id="d1",
        transfer_address="127.0.0.1:1",
        segment="kv",
        layout=layout,
        first_block=0,
        block_ids=tuple(range(100, 100 + -(-len(prompt) // layout.block_size))),
        ttl_s=30.0,
    )
    one = SamplingParams(max_tokens=1, temperature=0.0)
    outs = [o async for o in engine.add_request(prompt, one, "r", handoff=Handoff(sink=grant))]
    assert len(outs) == 1 and outs[0].new_token_ids
    # Every prompt row, K and V, every layer; all landed.
    want = len(prompt) * layout.row_bytes * 2 * layout.num_layers
    assert outs[-1].kv_sent == KVSent(want) and writer.num_bytes == want
    assert sender.stats.num_steps_sent == 1 and sender.stats.sent_bytes == want
    # A request that sends nothing has nothing to say.
    plain = [o async for o in engine.add_request([65, 66], one)]
    assert plain[-1].kv_sent is None
    await engine.close()
    engine.check_integrity()
