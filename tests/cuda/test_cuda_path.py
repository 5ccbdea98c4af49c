"""The CUDA path: bf16 and flash-attn parity with transformers, paged decode, and a
1 prefill + 1 decode handoff of GPU-resident KV blocks on loopback.

Selected with ``pytest -m cuda`` (``tools/gpu_check.sh`` runs them); without
a CUDA device every test skips and says why. Tolerances are those of the CPU
bf16 tests (``tests/unit/test_precision.py``): a few bf16 steps of the
logits' size, and greedy tokens identical except at near ties.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mooncaked.config import ModelConfig
from mooncaked.daemon import Node
from mooncaked.engine.attention import FLASH_BLOCK_SIZE_MULTIPLE, flash_available
from mooncaked.engine.loader import load_model
from mooncaked.engine.plan import StepPlan, chunk_of
from mooncaked.engine.runner import ModelRunner
from mooncaked.request import Request, SamplingParams
from tests.conftest import make_config, wait_until
from tests.hf_fixtures import make_hf_model, plain_prompt
from tests.parity import check_greedy_parity, greedy_logits

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
needs_flash = pytest.mark.skipif(
    not flash_available(), reason="flash-attn is not installed (pip install -e '.[gpu]')"
)

BF16_TOL = 0.125


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def cuda_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = tmp_path_factory.mktemp(f"{request.param}_cuda")
    hf = make_hf_model(request.param, d, seed=7).to(device="cuda", dtype=torch.bfloat16)
    return hf, d


def _parity(hf: Any, d: Path, backend: str, cuda_graphs: str = "off") -> None:
    loaded = load_model(
        ModelConfig(path=str(d), device="cuda", dtype="bfloat16", attention_backend=backend)
    )
    assert loaded.device.type == "cuda" and loaded.dtype == torch.bfloat16
    # flash-attn's paged kernels need blocks of a multiple of 256 tokens;
    # backend="flash" raises rather than fall back to SDPA.
    block = FLASH_BLOCK_SIZE_MULTIPLE if backend == "flash" else 16
    for seed, n in ((3, 21), (4, 40)):
        prompt, new_tokens = plain_prompt(seed, n), 24
        # One prefill, then decode steps reading the paged cache in place.
        ours = greedy_logits(
            loaded, prompt, new_tokens, block_size=block, backend=backend, cuda_graphs=cuda_graphs
        ).cpu()
        ids = prompt + ours[len(prompt) - 1 :].argmax(-1).tolist()[: new_tokens - 1]
        with torch.no_grad():
            theirs = hf(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
        torch.testing.assert_close(ours, theirs, atol=BF16_TOL, rtol=0)
        assert check_greedy_parity(ours, theirs, BF16_TOL) <= 2


def test_bf16_sdpa_matches_hf_on_cuda(cuda_case: Any) -> None:
    hf, d = cuda_case
    _parity(hf, d, "sdpa")


@needs_flash
def test_bf16_flash_attn_paged_decode_matches_hf(cuda_case: Any) -> None:
    hf, d = cuda_case
    _parity(hf, d, "flash")


@needs_flash
def test_bf16_flash_decode_replayed_from_cuda_graphs_matches_hf(cuda_case: Any) -> None:
    hf, d = cuda_case
    _parity(hf, d, "flash", cuda_graphs="on")


@needs_flash
def test_cuda_graph_buckets_match_eager_as_the_batch_shrinks(cuda_case: Any) -> None:
    """Five sequences decoding together, finishing one by one: steps of 5, 4,
    3, 2 and 1 run the buckets 8, 4, 4, 2 and 1, padded where the batch is
    smaller. Each step's logits match the eager runner's (fed the same
    tokens), and the padding rows leave every block they do not own as it was."""
    _hf, d = cuda_case
    loaded = load_model(
        ModelConfig(path=str(d), device="cuda", dtype="bfloat16", attention_backend="flash")
    )
    bs = FLASH_BLOCK_SIZE_MULTIPLE

    def runner(mode: str) -> ModelRunner:
        return ModelRunner(
            loaded,
            num_blocks=8,
            block_size=bs,
            backend="flash",
            cuda_graphs=mode,
            max_graph_batch=8,
        )

    eager, graphed = runner("off"), runner("on")
    assert graphed.graphs is not None and graphed.graphs.sizes == [1, 2, 4, 8]
    prompts = [plain_prompt(10 + i, 17 + 9 * i) for i in range(5)]
    # Blocks 6 and 7 belong to no sequence.
    tables = [[i] for i in range(5)]
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)]
    prefill = StepPlan(
        [chunk_of(r, r.prompt_token_ids, 0, t, True) for r, t in zip(reqs, tables, strict=True)]
    )
    last = [lg[-1].argmax().item() for lg in eager.forward_logits(prefill)]
    graphed.forward_logits(prefill)
    lengths = [len(p) for p in prompts]
    steps = 0
    for live in (5, 5, 4, 3, 3, 2, 1):
        plan = StepPlan(
            [chunk_of(reqs[i], [last[i]], lengths[i], tables[i], True) for i in range(live)]
        )
        want = eager.forward_logits(plan)
        got = graphed.forward_logits(plan)
        steps += 1
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=BF16_TOL, rtol=0)
        for i in range(live):
            last[i] = int(want[i][-1].argmax())
            lengths[i] += 1
    assert graphed.graphs.num_replays == steps
    torch.testing.assert_close(
        graphed.kv_buffer.float(), eager.kv_buffer.float(), atol=BF16_TOL, rtol=0
    )
    assert not graphed.kv_buffer[:, :, 5:].any()


@pytest.fixture
async def nodes() -> AsyncIterator[list[Node]]:
    started: list[Node] = []
    try:
        yield started
    finally:
        for n in reversed(started):
            await n.stop()


async def _start(nodes: list[Node], role: str, seed: str | None) -> Node:
    node = Node(
        make_config(
            node={"id": f"{role}-{len(nodes)}", "role": role},
            model={"device": "cuda"},
            store={"dram_bytes": 16 << 20},
            cluster={"seeds": [seed] if seed else []},
            transfer={"transports": ["tcp"]},
        )
    )
    await node.start()
    nodes.append(node)
    return node


async def _complete(node: Node, prompts: list[list[int]]) -> list[tuple[str, dict[str, str]]]:
    import aiohttp

    out: list[tuple[str, dict[str, str]]] = []
    async with aiohttp.ClientSession() as session:
        for p in prompts:
            body = {
                "model": "builtin:tiny",
                "prompt": p,
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            }
            async with session.post(node.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                data = await resp.json()
                headers = {
                    k.lower(): v
                    for k, v in resp.headers.items()
                    if k.lower().startswith("x-mooncaked-")
                }
                out.append((data["choices"][0]["text"], headers))
    return out


async def test_one_prefill_one_decode_hand_over_gpu_blocks(nodes: list[Node]) -> None:
    prompts = [[(7 * i + j) % 250 + 3 for j in range(40 + 37 * i)] for i in range(6)]
    solo = await _start(nodes, "both", None)
    want = await _complete(solo, prompts)

    prefill = await _start(nodes, "prefill", None)
    assert prefill.cluster is not None
    decode = await _start(nodes, "decode", f"127.0.0.1:{prefill.cluster.gossip_port}")

    def converged() -> bool:
        for n in (prefill, decode):
            service = n.cluster
            if service is None:
                return False
            alive = {
                nid
                for nid, m in service.view.members.items()
                if m.status.value == "alive" and m.state is not None and m.state.model_id
            }
            if not {prefill.node_id, decode.node_id} <= alive:
                return False
        return True

    await wait_until(converged, "both nodes alive in both views", 60)
    got = await _complete(decode, prompts)
    assert [t for t, _h in got] == [t for t, _h in want]
    for _text, headers in got:
        assert headers.get("x-mooncaked-prefill-node") == prefill.node_id
        assert headers.get("x-mooncaked-decode-node") == decode.node_id
    for n in (prefill, decode):
        assert n.engine is not None and n.engine.loaded.device.type == "cuda"
        n.engine.check_integrity()
    assert decode.transfer is not None
    assert decode.transfer.metrics().bytes_by_transport.get("tcp", 0) > 0 or (
        prefill.transfer is not None
        and prefill.transfer.metrics().bytes_by_transport.get("tcp", 0) > 0
    )
