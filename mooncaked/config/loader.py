"""The whole configuration, one section per field, and how it is read.

``load_config`` reads TOML, ``config_from_dict`` checks a parsed document,
``with_overrides`` and ``apply_flags`` replace keys (tests, command-line
flags) with the same checks.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mooncaked.config.cluster import (
    ClusterConfig,
    ConductorConfig,
    DisaggConfig,
    PipelineConfig,
    SloConfig,
)
from mooncaked.config.data import ObjectsConfig, StoreConfig, TransferConfig
from mooncaked.config.engine import KVConfig, ModelConfig, OffloadConfig, SchedulerConfig
from mooncaked.config.errors import ConfigError, ConfigValueError
from mooncaked.config.node import LogConfig, NodeConfig, ServerConfig


@dataclass(frozen=True, slots=True)
class Config:
    node: NodeConfig = field(default_factory=NodeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    objects: ObjectsConfig = field(default_factory=ObjectsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    conductor: ConductorConfig = field(default_factory=ConductorConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    # Where the config came from, for messages; not a TOML key.
    source: str = field(default="<defaults>", compare=False)

    def __post_init__(self) -> None:
        if self.pipeline.enabled and self.node.role != "prefill":
            raise ConfigError(
                f"{self.source}: 'pipeline.group' = {self.pipeline.group!r} makes this node a "
                f"stage of a pipelined prefill group, which needs node.role = 'prefill' "
                f"(got {self.node.role!r})"
            )
        if self.node.role == "memory" and (self.offload.enabled or self.offload.placed):
            raise ConfigError(
                f"{self.source}: a memory node computes attention for others; "
                f"'offload.memory_node' = {self.offload.memory_node!r} is for compute nodes"
            )
        if self.model.object_name is not None:
            if not self.objects.peers:
                raise ConfigError(
                    f"{self.source}: 'model.path' = {self.model.path!r} is fetched from peers "
                    "at start-up, before the node joins the cluster: set 'objects.peers' to the "
                    "URLs of nodes that have it (or know who does)"
                )
            if self.objects.share_model:
                raise ConfigError(
                    f"{self.source}: 'objects.share_model' = {self.objects.share_model!r} shares "
                    f"a model file, but 'model.path' = {self.model.path!r} is an object already "
                    "(and is served to peers as it is)"
                )
        if self.objects.share_model and self.model.is_builtin:
            raise ConfigError(
                f"{self.source}: 'objects.share_model' = {self.objects.share_model!r}, but "
                f"'model.path' = {self.model.path!r} has no file to share"
            )
        # The node's files live under its state directory: a relative SSD tier
        # path is taken from there, not from wherever the daemon was started.
        ssd = self.store.ssd_path
        if ssd and not os.path.isabs(ssd):
            store = dataclasses.replace(self.store, ssd_path=str(self.data_dir / ssd))
            object.__setattr__(self, "store", store)

    @property
    def node_id(self) -> str:
        return self.node.id_at(self.server.port)

    @property
    def data_dir(self) -> Path:
        """``node.data_dir``, or a per-user, per-node directory under the system
        temp dir; the parent of a relative ``store.ssd_path``."""
        if self.node.data_dir:
            return Path(self.node.data_dir)
        import tempfile

        return Path(tempfile.gettempdir()) / f"mooncaked-{os.getuid()}" / self.node_id


_SECTIONS: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in dataclasses.fields(Config)
    if f.name != "source"
}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; TOML ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigValueError(key, f"must be one of {list(allowed)}, got {value!r}")
        return value
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigValueError(key, f"must be a list, got {type(value).__name__}")
        return tuple(_coerce(v, item_tp, key) for v in value)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _coerce(value, arm, key)
            except ConfigValueError:
                continue
        raise ConfigValueError(key, f"has the wrong type: {value!r}")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigValueError(key, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigValueError(key, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigValueError(key, f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigValueError(key, f"must be a string, got {value!r}")
        return value
    raise RuntimeError(f"config type {tp!r} of {key} is not supported by the loader")


def _build_section(name: str, cls: type, table: Any, source: str) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [{name}] must be a table")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(
                f"{source}: unknown key '{name}.{key}' (known keys of [{name}]: "
                f"{', '.join(sorted(known))})"
            )
        try:
            kwargs[key] = _coerce(value, hints[key], key)
        except ConfigValueError as exc:
            raise ConfigError(f"{source}: '{name}.{exc.key}' {exc.message}") from None
    try:
        return cls(**kwargs)
    except ConfigValueError as exc:
        raise ConfigError(f"{source}: '{name}.{exc.key}' {exc.message}") from None


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    sections: dict[str, Any] = {}
    for name, table in data.items():
        cls = _SECTIONS.get(name)
        if cls is None:
            raise ConfigError(
                f"{source}: unknown section [{name}] (known: {', '.join(sorted(_SECTIONS))})"
            )
        sections[name] = _build_section(name, cls, table, source)
    return Config(**sections, source=source)


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Load a TOML file; ``None`` gives the defaults."""
    if path is None:
        return Config()
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config file: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    return config_from_dict(data, str(p))


def apply_flags(config: Config, values: dict[str, Any], keys: dict[str, tuple[str, str]]) -> Config:
    """``config`` with command-line values applied: ``keys`` maps a flag to its
    (section, key); flags left at None keep the file's value."""
    sections: dict[str, dict[str, Any]] = {}
    for flag, (section, key) in keys.items():
        value = values.get(flag)
        if value is not None:
            sections.setdefault(section, {})[key] = value
    if not sections:
        return config
    try:
        return with_overrides(config, **sections)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (from the command line)") from None


def with_overrides(config: Config, **sections: dict[str, Any]) -> Config:
    """A copy of ``config`` with some keys replaced, validated like the file.

    ``with_overrides(cfg, server={"port": 0})``: used by the CLI flags and tests.
    """
    merged: dict[str, Any] = {}
    for f in dataclasses.fields(Config):
        if f.name == "source":
            continue
        current = dataclasses.asdict(getattr(config, f.name))
        current = {k: list(v) if isinstance(v, tuple) else v for k, v in current.items()}
        current.update(sections.get(f.name, {}))
        merged[f.name] = current
    unknown = set(sections) - set(merged)
    if unknown:
        raise ConfigError(f"unknown section(s) {sorted(unknown)}")
    return config_from_dict(merged, config.source)
