"""Daemon configuration: frozen dataclasses per subsystem, loaded from TOML.

Every key has a default that works on one machine, so an empty file (or no
file) starts a single-node daemon on the builtin model. Loading is strict: an
unknown section or key, a value of the wrong type, or a value out of range
stops start-up with a ConfigError naming the file and the key.

Each section's dataclass validates its own values in ``__post_init__`` by
raising ``ConfigValueError(key, message)``; the loader adds the file and the
section to the message.

The sections live by group: ``node.py`` (node, server, log), ``engine.py``
(model, kv, scheduler), ``data.py`` (transfer, store), ``cluster.py``
(cluster, disagg, conductor, slo); ``loader.py`` holds ``Config`` and reads
it. Every name is importable from ``mooncaked.config``.
"""

from __future__ import annotations

from mooncaked.config.cluster import (
    ClusterConfig,
    ConductorConfig,
    DisaggConfig,
    PipelineConfig,
    SloConfig,
)
from mooncaked.config.data import CHECKSUMS, ObjectsConfig, StoreConfig, TransferConfig
from mooncaked.config.engine import (
    BUILTIN_PREFIX,
    KVConfig,
    ModelConfig,
    OffloadConfig,
    SchedulerConfig,
)
from mooncaked.config.errors import ConfigError, ConfigValueError
from mooncaked.config.loader import (
    Config,
    apply_flags,
    config_from_dict,
    load_config,
    with_overrides,
)
from mooncaked.config.names import (
    MAX_OBJECT_NAME,
    OBJECT_PREFIX,
    check_object_name,
    object_name_error,
    object_of_path,
)
from mooncaked.config.node import (
    ORIGIN_DEFAULT_PORTS,
    LogConfig,
    NodeConfig,
    Role,
    ServerConfig,
    parse_cpu_list,
    split_origin,
)

__all__ = [
    "BUILTIN_PREFIX",
    "CHECKSUMS",
    "MAX_OBJECT_NAME",
    "OBJECT_PREFIX",
    "ORIGIN_DEFAULT_PORTS",
    "ClusterConfig",
    "ConductorConfig",
    "Config",
    "ConfigError",
    "ConfigValueError",
    "DisaggConfig",
    "KVConfig",
    "LogConfig",
    "ModelConfig",
    "NodeConfig",
    "ObjectsConfig",
    "OffloadConfig",
    "PipelineConfig",
    "Role",
    "SchedulerConfig",
    "ServerConfig",
    "SloConfig",
    "StoreConfig",
    "TransferConfig",
    "apply_flags",
    "check_object_name",
    "config_from_dict",
    "load_config",
    "object_name_error",
    "object_of_path",
    "parse_cpu_list",
    "split_origin",
    "with_overrides",
]
