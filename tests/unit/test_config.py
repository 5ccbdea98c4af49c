"""Config loading: the reference file, strict validation, overrides, CLI flags."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from mooncaked.__main__ import _parser, build_config
from mooncaked.config import (
    Config,
    ConfigError,
    config_from_dict,
    load_config,
    parse_cpu_list,
    with_overrides,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SINGLE = REPO_ROOT / "config" / "single.toml"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "mooncaked.toml"
    p.write_text(text)
    return p


def test_single_toml_is_the_defaults() -> None:
    # config/single.toml doubles as the reference: it must not drift from
    # the dataclasses. No key is deliberately different from its default.
    assert load_config(SINGLE) == Config()


def test_single_toml_lists_every_key_with_a_comment() -> None:
    data = tomllib.loads(SINGLE.read_text())
    for f in dataclasses.fields(Config):
        if f.name == "source":
            continue
        section = getattr(Config(), f.name)
        keys = {k.name for k in dataclasses.fields(section)}
        assert set(data[f.name]) == keys, f"[{f.name}] keys differ from the dataclass"
    lines = SINGLE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "=" in line and not line.startswith("#"):
            assert lines[i - 1].startswith("#"), f"no comment above {line!r}"


def test_no_file_and_empty_file_give_the_defaults(tmp_path: Path) -> None:
    assert load_config(None) == Config()
    assert load_config(write(tmp_path, "")) == Config()


def test_values_are_read_and_ints_accepted_for_floats(tmp_path: Path) -> None:
    cfg = load_config(
        write(
            tmp_path,
            (
                "[server]\nport = 9000\ndrain_timeout_s = 5\n"
                '[transfer]\ntransports = ["tcp"]\n'
                '[node]\nrole = "prefill"\n'
            ),
        )
    )
    assert cfg.server.port == 9000
    assert cfg.server.drain_timeout_s == 5.0 and isinstance(cfg.server.drain_timeout_s, float)
    assert cfg.transfer.transports == ("tcp",)
    assert cfg.node.role == "prefill"
    assert cfg.source == str(tmp_path / "mooncaked.toml")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[server]\nprot = 1\n", ["'server.prot'", "unknown key", "port"]),
        ("[servr]\nport = 1\n", ["unknown section [servr]", "server"]),
        ('[server]\nport = "80"\n', ["'server.port'", "integer"]),
        ("[server]\nport = true\n", ["'server.port'", "integer"]),
        ("[server]\nport = 70000\n", ["'server.port'", "65535"]),
        ("[kv]\nenable_prefix_caching = 1\n", ["'kv.enable_prefix_caching'", "true or false"]),
        ("[kv]\nblock_size = 24\n", ["'kv.block_size'", "power of two"]),
        ('[log]\nlevel = "loud"\n', ["'log.level'", "loud", "debug"]),
        (
            '[transfer]\ntransports = ["carrier-pigeon"]\n',
            ["'transfer.transports'", "carrier-pigeon"],
        ),
        ('[transfer]\ntransports = "tcp"\n', ["'transfer.transports'", "list"]),
        ("[cluster]\nprobe_timeout_s = 1.0\n", ["'cluster.probe_timeout_s'", "probe_interval_s"]),
        ('[cluster]\nseeds = ["nohostport"]\n', ["'cluster.seeds'", "host:port"]),
        ("[cluster]\nmax_clock_skew_s = 0\n", ["'cluster.max_clock_skew_s'", "> 0"]),
        ("[cluster]\nmax_clock_skew_s = inf\n", ["'cluster.max_clock_skew_s'", "86400"]),
        (
            '[cluster]\nkv_events_endpoint = "localhost:5557"\n',
            ["'cluster.kv_events_endpoint'", "'localhost:5557'", "tcp://HOST:PORT"],
        ),
        (
            '[cluster]\nkv_events_endpoint = "tcp://*"\n',
            ["'cluster.kv_events_endpoint'", "'tcp://*'", "1..65535"],
        ),
        (
            '[cluster]\nkv_events_endpoint = "tcp://*:0"\n',
            ["'cluster.kv_events_endpoint'", "1..65535"],
        ),
        (
            '[cluster]\nkv_events_endpoint = "ipc://"\n',
            ["'cluster.kv_events_endpoint'", "no address"],
        ),
        ('[cluster]\nkv_events_format = "json"\n', ["'cluster.kv_events_format'", "json", "map"]),
        ('[node]\ncluster_secret = "short"\n', ["'node.cluster_secret'", "8 characters"]),
        ('[node]\ncpus = "0-x"\n', ["'node.cpus'", "'0-x'", "not a CPU"]),
        ('[node]\ncpus = "3-1"\n', ["'node.cpus'", "'3-1'"]),
        ('[node]\ncpus = "0,,1"\n', ["'node.cpus'", "''"]),
        ("[disagg]\nlayer_batch_bytes = -1\n", ["'disagg.layer_batch_bytes'", "[0, 2**30]"]),
        ("server = 1\n", ["[server] must be a table"]),
        ("[server\nport = 1\n", ["not valid TOML"]),
    ],
)
def test_bad_config_names_key_and_file(tmp_path: Path, text: str, words: list[str]) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert msg.startswith(str(path)), msg
    for w in words:
        assert w in msg, msg


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.toml")


def test_config_error_is_a_value_error() -> None:
    # A caller's mistake: callers may catch ValueError.
    assert issubclass(ConfigError, ValueError)


def test_with_overrides_validates_like_the_file() -> None:
    cfg = with_overrides(Config(), server={"port": 0}, model={"path": "builtin:tiny"})
    assert cfg.server.port == 0
    assert cfg.server.host == Config().server.host
    with pytest.raises(ConfigError, match=re.escape("'server.port'")):
        with_overrides(Config(), server={"port": -1})
    with pytest.raises(ConfigError, match=re.escape("unknown key 'kv.blocks'")):
        with_overrides(Config(), kv={"blocks": 1})
    with pytest.raises(ConfigError, match="unknown section"):
        with_overrides(Config(), gpu={"x": 1})


def test_configs_compare_by_value_not_source() -> None:
    assert config_from_dict({}, "a.toml") == config_from_dict({}, "b.toml")


def test_node_id_defaults_to_host_and_port() -> None:
    import socket

    assert Config().node_id == f"{socket.gethostname()}-8000"
    assert with_overrides(Config(), node={"id": "n1"}).node_id == "n1"


def test_a_relative_ssd_path_lives_under_the_data_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    path = write(tmp_path, f'[node]\ndata_dir = "{state}"\n[store]\nssd_path = "kv-ssd"\n')
    config = load_config(str(path))
    assert config.data_dir == state
    assert config.store.ssd_path == str(state / "kv-ssd")
    # Resolved once: overriding something else keeps it where it is.
    assert with_overrides(config, server={"port": 1}).store.ssd_path == str(state / "kv-ssd")
    # An absolute path stays; no data_dir: a per-node dir under the temp dir.
    absolute = with_overrides(Config(), store={"ssd_path": str(tmp_path / "elsewhere")})
    assert absolute.store.ssd_path == str(tmp_path / "elsewhere")
    default = with_overrides(Config(), node={"id": "n7"}, store={"ssd_path": "kv-ssd"})
    assert Path(default.store.ssd_path).parts[-2:] == ("n7", "kv-ssd")
    assert with_overrides(Config(), node={"data_dir": str(state)}).store.ssd_path == ""


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nhost = "127.0.0.1"\nport = 9000\n[node]\nrole = "decode"\n')
    args = _parser().parse_args(
        ["--config", str(path), "--port", "0", "--role", "prefill", "--log-format", "json"]
    )
    cfg = build_config(args)
    assert cfg.server.port == 0
    assert cfg.server.host == "127.0.0.1"
    assert cfg.node.role == "prefill"
    assert cfg.log.format == "json"
    assert build_config(_parser().parse_args(["--config", str(path)])) == load_config(path)


def test_peer_addresses_come_from_flags(tmp_path: Path) -> None:
    # One file for many nodes: each node's own addresses on its command line.
    path = write(tmp_path, "[cluster]\ngossip_port = 7946\n[transfer]\nport = 7947\n")
    args = ["--config", str(path), "--gossip-host", "10.1.2.3", "--transfer-host", "10.1.2.3"]
    cfg = build_config(_parser().parse_args(args))
    assert (cfg.cluster.gossip_host, cfg.cluster.gossip_port) == ("10.1.2.3", 7946)
    assert (cfg.transfer.host, cfg.transfer.port) == ("10.1.2.3", 7947)
    assert cfg.server.host == "127.0.0.1"
    file_only = build_config(_parser().parse_args(["--config", str(path)]))
    assert file_only.cluster.gossip_host == file_only.transfer.host == "127.0.0.1"


def test_bad_flag_names_key_file_and_command_line(tmp_path: Path) -> None:
    path = write(tmp_path, "")
    with pytest.raises(ConfigError) as exc:
        build_config(_parser().parse_args(["--config", str(path), "--role", "router"]))
    msg = str(exc.value)
    assert "'node.role'" in msg and str(path) in msg and "command line" in msg


def test_cpu_lists_read_as_taskset_writes_them() -> None:
    assert parse_cpu_list("0") == {0}
    assert parse_cpu_list("0-2,5, 7-8") == {0, 1, 2, 5, 7, 8}
    for bad in ("", "-1", "a", "1-", "2-1"):
        with pytest.raises(ValueError, match="not a CPU"):
            parse_cpu_list(bad)


def test_a_model_named_as_an_object_is_checked_and_needs_peers() -> None:
    peers = {"peers": ["http://10.0.0.1:8000"]}
    cfg = with_overrides(Config(), model={"path": "object:models/smollm2"}, objects=peers)
    assert cfg.model.object_name == "models/smollm2"
    assert Config().model.object_name is None
    for name in ("", "a/../b", "/abs", "x y", "a//b", "-a"):
        with pytest.raises(ConfigError, match=r"'model\.path' names an object .* got"):
            with_overrides(Config(), model={"path": f"object:{name}"}, objects=peers)
    with pytest.raises(ConfigError, match=r"'model\.path' = 'object:m' .* 'objects\.peers'"):
        with_overrides(Config(), model={"path": "object:m"})
    with pytest.raises(ConfigError, match=r"'objects\.share_model' = 'm' .* is an object"):
        with_overrides(Config(), model={"path": "object:m"}, objects={**peers, "share_model": "m"})
    with pytest.raises(ConfigError, match=r"'objects\.share_model' = 'm', but 'model\.path'"):
        with_overrides(Config(), objects={"share_model": "m"})
    with pytest.raises(ConfigError, match=r"'objects\.share_model' an object name"):
        with_overrides(Config(), model={"path": "/m.gguf"}, objects={"share_model": "a b"})
    for key, value in (("shard_bytes", 100), ("max_fetches", 0), ("peers", ["10.0.0.1"])):
        with pytest.raises(ConfigError, match=rf"'objects\.{key}'"):
            with_overrides(Config(), objects={key: value})
