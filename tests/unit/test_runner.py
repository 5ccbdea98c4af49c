"""The runner on the builtin model: determinism, batching, block copies, bad plans."""

from __future__ import annotations

import copy

import pytest
import torch

from mooncaked.config import ModelConfig
from mooncaked.engine.loader import LoadedModel, load_model
from mooncaked.engine.plan import StepPlan, chunk_of
from mooncaked.engine.runner import ModelRunner, kv_bytes_per_block, num_blocks_for_bytes
from mooncaked.request import Request, SamplingParams
from tests.parity import greedy_together

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(ModelConfig(seed=0))


def _chat_ids(loaded: LoadedModel, text: str) -> list[int]:
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), False)


def test_block_sizing() -> None:
    arch = load_model(ModelConfig()).arch
    # 2 (K, V) x 4 layers x 16 tokens x 2 kv heads x 32 dims x 4 bytes.
    assert kv_bytes_per_block(arch, 16, torch.float32) == 32768
    assert kv_bytes_per_block(arch, 16, torch.bfloat16) == 16384
    assert num_blocks_for_bytes(arch, 16, torch.float32, 32768 * 10 + 5) == 10
    assert num_blocks_for_bytes(arch, 16, torch.float32, 100) == 0


def test_runner_allocates_caches(tiny: LoadedModel) -> None:
    runner = ModelRunner(tiny, num_blocks=8, block_size=BLOCK)
    assert len(runner.kv_caches) == tiny.arch.num_layers
    for k, v in runner.kv_caches:
        assert k.shape == v.shape == (8, BLOCK, 2, 32)
        assert k.dtype == torch.float32
    assert runner.backend.name == "sdpa"


def test_builtin_is_deterministic_per_seed(tiny: LoadedModel) -> None:
    again = load_model(ModelConfig(seed=0))
    other = load_model(ModelConfig(seed=1))
    assert tiny.model_id == again.model_id == "builtin:tiny@0"
    assert other.model_id == "builtin:tiny@1"
    w0 = tiny.model.model.embed_tokens.weight
    assert torch.equal(w0, again.model.model.embed_tokens.weight)
    assert not torch.equal(w0, other.model.model.embed_tokens.weight)
    assert tiny.max_model_len == 4096
    assert tiny.served_name == "builtin:tiny"
    assert tiny.arch.tie_word_embeddings
    assert tiny.model.lm_head.weight is tiny.model.model.embed_tokens.weight


@pytest.mark.slow
def test_builtin_greedy_output_is_diverse_and_runs_to_length(tiny: LoadedModel) -> None:
    runner = ModelRunner(tiny, num_blocks=64, block_size=BLOCK)
    texts = ["Hello there", "What is the capital of France?", "abc", "Tell me a story"]
    outs = greedy_together(runner, [_chat_ids(tiny, t) for t in texts], 48)
    assert len({tuple(o) for o in outs}) == len(texts)
    eos = set(tiny.tokenizer.eos_token_ids)
    for o in outs:
        assert len(set(o)) > 8, o  # not one token over and over
        assert not eos & set(o)


@pytest.mark.slow
def test_batch_composition_does_not_change_greedy_output(tiny: LoadedModel) -> None:
    prompts = [_chat_ids(tiny, t) for t in ["one", "a somewhat longer prompt here", "x"]]
    together = greedy_together(ModelRunner(tiny, num_blocks=64, block_size=BLOCK), prompts, 24)
    for p, expected in zip(prompts, together, strict=True):
        alone = greedy_together(ModelRunner(tiny, num_blocks=64, block_size=BLOCK), [p], 24)[0]
        assert alone == expected


def test_execute_does_not_mutate_requests(tiny: LoadedModel) -> None:
    runner = ModelRunner(tiny, num_blocks=8, block_size=BLOCK)
    ids = _chat_ids(tiny, "hi")
    req = Request("r", ids, SamplingParams(temperature=0.8, seed=3, logprobs=2))
    before = copy.deepcopy(req)
    out = runner.execute(StepPlan([chunk_of(req, ids, 0, [0, 1], True)]))
    assert out[0] is not None and out[0].logprob is not None
    assert len(out[0].logprob.top) == 2
    assert req == before


def test_seeded_sampling_resumes_identically_on_another_runner(tiny: LoadedModel) -> None:
    """A request moved mid-generation (another node, or after preemption) samples the same."""
    ids = _chat_ids(tiny, "seeded")
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=32)

    def run(runner: ModelRunner, req: Request, n: int) -> None:
        tokens = req.all_token_ids
        # Recompute everything so far in one prefill, then decode.
        chunk = chunk_of(req, tokens, 0, [0, 1, 2, 3], True)
        for _ in range(n):
            tok = runner.execute(StepPlan([chunk]))[0]
            assert tok is not None
            req.output_token_ids.append(tok.token_id)
            chunk = chunk_of(req, [tok.token_id], req.num_tokens - 1, [0, 1, 2, 3], True)

    straight = Request("a", ids, params)
    run(ModelRunner(tiny, num_blocks=4, block_size=BLOCK), straight, 20)
    moved = Request("b", ids, params)
    run(ModelRunner(tiny, num_blocks=4, block_size=BLOCK), moved, 8)
    run(ModelRunner(tiny, num_blocks=4, block_size=BLOCK), moved, 12)
    assert moved.output_token_ids == straight.output_token_ids
    assert len(set(straight.output_token_ids)) > 5


def test_copy_blocks_carries_the_context(tiny: LoadedModel) -> None:
    runner = ModelRunner(tiny, num_blocks=16, block_size=BLOCK)
    ids = _chat_ids(tiny, "copy me across blocks, please")  # 40 tokens: three blocks
    assert 32 < len(ids) < 48
    req = Request("r", ids, GREEDY)
    first = runner.execute(StepPlan([chunk_of(req, ids, 0, [0, 1, 2], True)]))[0]
    assert first is not None
    runner.copy_blocks([0, 1, 2], [9, 7, 5])
    for layer_k, layer_v in runner.kv_caches:
        assert torch.equal(layer_k[9], layer_k[0]) and torch.equal(layer_v[5], layer_v[2])
    req.output_token_ids.append(first.token_id)
    pos = len(ids)
    a = runner.forward_logits(StepPlan([chunk_of(req, [first.token_id], pos, [0, 1, 2], True)]))
    b = runner.forward_logits(StepPlan([chunk_of(req, [first.token_id], pos, [9, 7, 5], True)]))
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="equal lists"):
        runner.copy_blocks([1], [])


def test_bad_plans_are_caller_errors(tiny: LoadedModel) -> None:
    runner = ModelRunner(tiny, num_blocks=4, block_size=BLOCK)
    req = Request("r", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="outside"):
        runner.execute(StepPlan([chunk_of(req, [1, 2, 3], 0, [4], True)]))
    with pytest.raises(ValueError, match="are needed"):
        runner.execute(StepPlan([chunk_of(req, [1, 2, 3], 15, [0], True)]))
    with pytest.raises(ValueError, match="max_model_len"):
        runner.execute(StepPlan([chunk_of(req, [1], 4096, [0], True)]))
    with pytest.raises(ValueError, match="no tokens"):
        runner.execute(StepPlan([chunk_of(req, [], 0, [0], True)]))
    assert runner.execute(StepPlan()) == []


def test_backend_selection(tiny: LoadedModel) -> None:
    with pytest.raises(ValueError, match="CUDA"):
        ModelRunner(tiny, num_blocks=4, block_size=BLOCK, backend="flash")
    with pytest.raises(ValueError, match="unknown attention backend"):
        ModelRunner(tiny, num_blocks=4, block_size=BLOCK, backend="xformers")
    assert ModelRunner(tiny, num_blocks=4, block_size=BLOCK, backend="sdpa").backend.name == "sdpa"


def test_builtin_rejects_unknown_names_and_long_max_len() -> None:
    with pytest.raises(ValueError, match="unknown builtin"):
        load_model(ModelConfig(path="builtin:huge"))
    with pytest.raises(ValueError, match="max_model_len"):
        load_model(ModelConfig(max_model_len=5000))
    assert load_model(ModelConfig(max_model_len=1024)).max_model_len == 1024
