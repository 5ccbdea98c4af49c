"""Loader failure paths: a checkpoint the config does not describe is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncaked.config import ModelConfig
from mooncaked.engine.loader import load_model
from tests.hf_fixtures import make_hf_model


def test_weights_the_config_does_not_describe_are_refused(tmp_path: Path) -> None:
    make_hf_model("qwen2", tmp_path)
    load_model(ModelConfig(path=str(tmp_path)))  # as saved: loads
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # Declared as Llama without attention bias, the q/k/v biases have no home.
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=False)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"does not describe: .*q_proj\.bias"):
        load_model(ModelConfig(path=str(tmp_path)))


def test_missing_directory_and_config_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"nowhere' is neither builtin:<name>, a directory nor"):
        load_model(ModelConfig(path=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match=r"config\.json"):
        load_model(ModelConfig(path=str(tmp_path)))


def test_builtin_weights_are_the_same_on_every_load() -> None:
    a = load_model(ModelConfig()).model.state_dict()
    b = load_model(ModelConfig()).model.state_dict()
    assert all(a[k].equal(b[k]) for k in a)
    c = load_model(ModelConfig(seed=1)).model.state_dict()
    assert not a["model.embed_tokens.weight"].equal(c["model.embed_tokens.weight"])


_WEIGHTS_DIGEST = """
import hashlib
from mooncaked.config import ModelConfig
from mooncaked.engine.loader import load_model
sd = load_model(ModelConfig()).model.state_dict()
h = hashlib.sha256()
for k in sorted(sd):
    h.update(k.encode()); h.update(sd[k].contiguous().numpy().tobytes())
print(h.hexdigest())
"""


@pytest.mark.slow
def test_builtin_weights_do_not_depend_on_the_cpu_instruction_set() -> None:
    # torch picks vectorized kernels by ATEN_CPU_CAPABILITY; nodes with other
    # CPUs must build the same builtin model under the same model id.
    import os
    import subprocess
    import sys

    digests = set()
    for capability in ("default", "avx2", None):
        env = dict(os.environ)
        if capability is None:
            env.pop("ATEN_CPU_CAPABILITY", None)
        else:
            env["ATEN_CPU_CAPABILITY"] = capability
        out = subprocess.run(
            [sys.executable, "-c", _WEIGHTS_DIGEST],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        digests.add(out.stdout.strip())
    assert len(digests) == 1, digests
