"""mooncakectl's cluster operation without daemons: the node plan and generated
configs of ``up``, the reference prefill/decode configs, request rows, and
``drain``'s node resolution."""

from __future__ import annotations

import io
import tomllib
from pathlib import Path
from typing import Any

import pytest

from mooncakectl.cluster_cmds import request_rows, resolve_node
from mooncakectl.local.commands import choose_model, pin_cpus
from mooncakectl.local.config import (
    model_from_peers,
    node_config,
    read_base_config,
    shared_model_name,
    to_toml,
)
from mooncakectl.local.plan import NodePlan, entry_index, node_cpus, plan_nodes, stage_cpus
from mooncakectl.local.process import describe_stage
from mooncaked.config import Config, config_from_dict, load_config

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name, role", [("prefill.toml", "prefill"), ("decode.toml", "decode")])
def test_reference_role_configs_load(name: str, role: str) -> None:
    cfg = load_config(REPO_ROOT / "config" / name)
    assert cfg.node.role == role
    assert cfg.node.id == f"{role}-0"
    assert cfg.cluster.gossip_port == 7946
    assert len(cfg.cluster.seeds) == 2
    assert cfg.disagg.layerwise is True
    # Reachable from other hosts: nothing that peers use listens on loopback.
    assert cfg.transfer.host != "127.0.0.1"
    assert cfg.cluster.gossip_host == cfg.transfer.host


def test_no_counts_plan_one_both_node_on_8000() -> None:
    assert plan_nodes(None, None, None) == [NodePlan("", "both", 8000, 0)]
    assert plan_nodes(None, None, 9123) == [NodePlan("", "both", 9123, 0)]


def test_cluster_plan_roles_ids_distinct_ports_and_one_seed() -> None:
    plans = plan_nodes(2, 1, None)
    assert [(p.node_id, p.role) for p in plans] == [
        ("prefill-0", "prefill"),
        ("prefill-1", "prefill"),
        ("decode-0", "decode"),
    ]
    ports = [p.port for p in plans] + [plans[0].gossip_port]
    assert len(set(ports)) == 4 and 0 not in ports
    # Only the first node has a fixed gossip port: it is everyone's seed.
    assert [p.gossip_port for p in plans[1:]] == [0, 0]
    assert plans[entry_index(plans)].node_id == "decode-0"
    # --port goes to the entry.
    assert plan_nodes(1, 2, 9555)[1] == NodePlan("decode-0", "decode", 9555, 0)


def test_cluster_plan_refuses_bad_counts() -> None:
    with pytest.raises(ValueError, match="--decode 0 with --prefill 2"):
        plan_nodes(2, None, None)
    with pytest.raises(ValueError, match="got -1 and 1"):
        plan_nodes(-1, 1, None)


def test_generated_config_is_valid_and_keeps_the_base(tmp_path: Path) -> None:
    base_path = tmp_path / "base.toml"
    base_path.write_text('[kv]\nnum_blocks = 64\n[server]\nport = 1\nhost = "0.0.0.0"\n')
    base = read_base_config(str(base_path))
    plan = NodePlan("decode-0", "decode", 18000, 0)
    doc = node_config(
        base,
        plan,
        cluster=True,
        seeds=["127.0.0.1:17946"],
        secret="s" * 43,
        # A --config was given: its model (none here: the builtin default).
        model=choose_model(None, str(base_path), io.StringIO()),
        data_dir=tmp_path / "data",
    )
    cfg = config_from_dict(tomllib.loads(to_toml(doc)))
    assert cfg.kv.num_blocks == 64  # from the base
    assert (cfg.server.host, cfg.server.port) == ("127.0.0.1", 18000)  # ours win
    assert (cfg.node.id, cfg.node.role, cfg.node.cluster_secret) == ("decode-0", "decode", "s" * 43)
    assert cfg.cluster.seeds == ("127.0.0.1:17946",)
    assert cfg.model.path == "builtin:tiny"
    assert base["server"]["port"] == 1  # the base is not modified


def test_bad_base_config_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[kv\n")
    with pytest.raises(ValueError, match=r"cannot read --config .*bad\.toml"):
        read_base_config(str(bad))


def test_request_rows_oldest_first() -> None:
    doc = {
        "node_id": "decode-0",
        "requests": [
            {"id": "b", "phase": "queued", "age_s": 0.5, "role": "engine"},
            {
                "id": "a",
                "phase": "decoding",
                "prefill_node": "prefill-0",
                "decode_node": "decode-0",
                "prompt_tokens": 19,
                "output_tokens": 40,
                "age_s": 3.25,
                "role": "entry",
            },
        ],
    }
    assert request_rows(doc) == [
        ("a", "entry", "decoding", "prefill-0", "decode-0", "19", "40", "3.2s"),
        ("b", "engine", "queued", "-", "-", "0", "0", "0.5s"),
    ]


def _cluster_doc() -> dict[str, object]:
    return {
        "self": "decode-0",
        "nodes": [
            {"node_id": "decode-0", "status": "alive", "state": {"api_addr": "127.0.0.1:1"}},
            {"node_id": "prefill-0", "status": "alive", "state": {"api_addr": "127.0.0.1:2"}},
            {"node_id": "prefill-1", "status": "dead", "state": {"api_addr": "127.0.0.1:3"}},
        ],
    }


def test_resolve_node_by_id() -> None:
    assert resolve_node(_cluster_doc(), "prefill-0") == ("prefill-0", "http://127.0.0.1:2")


def test_resolve_node_names_the_unknown_and_the_known() -> None:
    with pytest.raises(ValueError) as err:
        resolve_node(_cluster_doc(), "decode-9")
    assert str(err.value) == (
        "unknown node 'decode-9': the cluster seen by decode-0 has decode-0, prefill-0, prefill-1"
    )
    with pytest.raises(ValueError, match="'prefill-1' is dead"):
        resolve_node(_cluster_doc(), "prefill-1")


def test_to_toml_round_trips_awkward_values() -> None:
    doc = {
        "node": {"id": 'a "quoted" \\ name\n\x7f ☾ 🌕', "weird key": True},
        "cluster": {
            "seeds": ["h:1", "h:2"],
            "probe_interval_s": 0.25,
            "x": 1e-05,
            "y": float("inf"),
        },
    }
    assert tomllib.loads(to_toml(doc)) == doc


def test_to_toml_names_a_value_it_cannot_write() -> None:
    with pytest.raises(ValueError, match=r"cannot write config key node\.extra = \{'a': 1\}"):
        to_toml({"node": {"extra": {"a": 1}}})


def _cluster_node_config(tmp_path: Path, base: dict[str, dict[str, Any]], **kw: Any) -> Config:
    """The config ``up`` writes for one prefill node of a local cluster, as the daemon reads it."""
    doc = node_config(
        base,
        NodePlan("prefill-0", "prefill", 18000, 0),
        cluster=True,
        seeds=["127.0.0.1:17946"],
        secret="s" * 43,
        model=None,
        data_dir=tmp_path / "data",
        **kw,
    )
    return config_from_dict(tomllib.loads(to_toml(doc)))


def test_local_nodes_share_the_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mooncakectl.local.config as local_config

    monkeypatch.setattr(local_config, "cores", lambda: 8)

    def threads(base: dict[str, dict[str, Any]], num_nodes: int) -> int:
        return _cluster_node_config(tmp_path, base, num_nodes=num_nodes).model.cpu_threads

    # One node alone measures its team at start-up (0); several share the cores.
    assert threads({}, 1) == 0
    assert threads({}, 3) == 2 and threads({}, 2) == 4 and threads({}, 16) == 1
    # A base config that sets the threads keeps them.
    assert threads({"model": {"cpu_threads": 3}}, 2) == 3


def test_pin_gives_each_local_node_cores_of_its_own(tmp_path: Path) -> None:
    assert node_cpus(2, [0, 1]) == ["0", "1"]
    assert node_cpus(3, [7, 0, 1, 2, 3, 4, 5, 6]) == ["0,1", "2,3", "4,5"]
    with pytest.raises(ValueError, match="--pin: 3 nodes need a core each"):
        node_cpus(3, [0, 1])
    assert _cluster_node_config(tmp_path, {}, num_nodes=3, cpus="4,5").node.cpus == "4,5"


def test_cpp_plan_groups_the_prefill_nodes_in_order() -> None:
    plans = plan_nodes(4, 1, None, num_stages=2)
    assert [(p.node_id, p.group, p.stage, p.num_stages) for p in plans] == [
        ("prefill-0", "cpp-0", 0, 2),
        ("prefill-1", "cpp-0", 1, 2),
        ("prefill-2", "cpp-1", 0, 2),
        ("prefill-3", "cpp-1", 1, 2),
        ("decode-0", "", 0, 0),
    ]
    # The entry is still the decode node, with --port.
    assert plan_nodes(3, 1, 9555, num_stages=3)[3] == NodePlan("decode-0", "decode", 9555, 0)


def test_cpp_plan_refuses_what_no_group_can_be() -> None:
    with pytest.raises(ValueError, match=r"--cpp 2 does not divide --prefill 3"):
        plan_nodes(3, 1, None, num_stages=2)
    with pytest.raises(ValueError, match=r"--cpp 2 does not divide --prefill 0"):
        plan_nodes(0, 1, None, num_stages=2)
    with pytest.raises(ValueError, match=r"--cpp 1: pipeline\.num_stages: must be in 2\.\.16"):
        plan_nodes(2, 1, None, num_stages=1)
    with pytest.raises(ValueError, match=r"--cpp 2 needs prefill nodes"):
        plan_nodes(None, None, None, num_stages=2)


def test_a_stage_gets_its_pipeline_section_under_the_base(tmp_path: Path) -> None:
    base = {"pipeline": {"chunk_tokens": 128, "num_stages": 4}}

    def config(plan: NodePlan) -> Config:
        doc = node_config(
            base,
            plan,
            cluster=True,
            seeds=[],
            secret="s" * 43,
            model=None,
            data_dir=tmp_path / plan.name,
        )
        return config_from_dict(tomllib.loads(to_toml(doc)))

    configs = [config(plan) for plan in plan_nodes(2, 1, None, num_stages=2)]
    # Ours win for the group, the stage and its count; the base keeps the rest.
    assert [
        (c.node.role, c.pipeline.group, c.pipeline.stage, c.pipeline.num_stages) for c in configs
    ] == [("prefill", "cpp-0", 0, 2), ("prefill", "cpp-0", 1, 2), ("decode", "", 0, 4)]
    assert [c.pipeline.chunk_tokens for c in configs] == [128, 128, 128]
    assert not configs[2].pipeline.enabled


def test_stage_cpus_give_each_stage_a_core_and_decode_shares() -> None:
    assert stage_cpus(2, 1, [1, 0, 2]) == ["0", "1", "2"]
    # No core left: the decode node shares the last stage's.
    assert stage_cpus(2, 1, [0, 1]) == ["0", "1", "1"]
    assert stage_cpus(1, 1, [3]) == ["3", "3"]
    # Decode nodes take the cores left in turn.
    assert stage_cpus(2, 3, [0, 1, 2, 3]) == ["0", "1", "2", "3", "2"]
    with pytest.raises(
        ValueError, match="--pin: 3 prefill nodes need a core each, and this process may use 2"
    ):
        stage_cpus(3, 1, [0, 1])


def test_up_pin_with_groups_shares_a_core_only_when_short_and_says_so() -> None:
    err = io.StringIO()
    plans = plan_nodes(2, 1, None, num_stages=2)
    # Enough cores: an equal share each, as without --cpp, and nothing said.
    assert pin_cpus(plans, list(range(6)), err) == ["0,1", "2,3", "4,5"]
    assert err.getvalue() == ""
    assert pin_cpus(plans, [0, 1], err) == ["0", "1", "1"]
    assert err.getvalue() == (
        "mooncakectl: --pin: 2 cores for 3 nodes: each prefill node (a stage) gets one "
        "of its own; decode-0 shares core 1 with prefill-1\n"
    )
    # Without groups, too few cores is refused as before.
    with pytest.raises(ValueError, match="--pin: 3 nodes need a core each"):
        pin_cpus(plan_nodes(2, 1, None), [0, 1], err)


def test_describe_stage_counts_layers_from_zero_both_ends_in() -> None:
    stage = {"group": "cpp-0", "index": 1, "num_stages": 2, "layer_lo": 15}
    assert describe_stage(stage | {"layer_hi": 30, "num_layers": 30}) == (
        "cpp-0 stage 1/2, layers 15-29 of 30"
    )
    assert describe_stage(stage | {"layer_lo": 3, "layer_hi": 4, "num_layers": 4}) == (
        "cpp-0 stage 1/2, layer 3 of 4"
    )
    assert describe_stage({"group": "cpp-1", "index": 0, "num_stages": 3}) == "cpp-1 stage 0/3"


def test_model_from_peers_shares_the_first_nodes_model_with_the_others(tmp_path: Path) -> None:
    plans = plan_nodes(1, 2, None)
    model = str(tmp_path / "SmolLM2 135M.gguf")
    sections = model_from_peers(plans, model)
    first, other = sections(plans[0]), sections(plans[1])
    assert first == {
        "model": {"path": model},
        "objects": {"share_model": "models/SmolLM2-135M.gguf"},
    }
    assert other == {
        "model": {"path": "object:models/SmolLM2-135M.gguf"},
        "objects": {"peers": [plans[0].url]},
    }
    for plan in plans:
        doc = node_config(
            sections(plan), plan, cluster=True, seeds=[], secret="s" * 32, model=None,
            data_dir=tmp_path / plan.name,
        )  # fmt: skip
        config_from_dict(doc)  # each one a valid config
    with pytest.raises(ValueError, match="shares a model file or directory; 'builtin:tiny'"):
        model_from_peers(plans, "builtin:tiny")
    with pytest.raises(ValueError, match="needs a cluster"):
        model_from_peers(plan_nodes(None, None, None), model)
    assert shared_model_name("/m/My Model+1/") == "models/My-Model-1"
