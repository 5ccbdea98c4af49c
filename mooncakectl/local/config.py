"""Each local node's config: a base laid under the node's own settings, written as TOML.

``to_toml`` is the one TOML writer of the project: the launchers, the
benchmarks and the tests all write their daemons' configs through it.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mooncakectl.local.plan import LOOPBACK, NodePlan
from mooncaked.config import BUILTIN_PREFIX, OBJECT_PREFIX, check_object_name
from mooncaked.process import cores

Sections = dict[str, dict[str, Any]]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def _toml_value(value: Any, key: str) -> str:
    if isinstance(value, float):
        return repr(value)  # 0.25, 1e-05, inf, nan: all TOML floats
    if isinstance(value, bool | int | str):
        # JSON's strings, integers and booleans are TOML's too, once DEL (which
        # JSON leaves raw and TOML forbids) is escaped; non-ASCII stays as is
        # (JSON would split it into surrogate pairs TOML does not accept).
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v, key) for v in value) + "]"
    raise ValueError(
        f"cannot write config key {key} = {value!r} (not a string, number, "
        "boolean or array of them)"
    )


def to_toml(doc: Mapping[str, Mapping[str, Any]]) -> str:
    """A config (sections of scalars and arrays, as mooncaked's) as TOML text."""
    lines: list[str] = []
    for section, table in doc.items():
        if not isinstance(table, Mapping):
            raise ValueError(f"config key {section!r} must be a [section], got {table!r}")
        lines.append(f"[{_toml_key(section)}]")
        for key, value in table.items():
            lines.append(f"{_toml_key(key)} = {_toml_value(value, f'{section}.{key}')}")
        lines.append("")
    return "\n".join(lines)


def merge_sections(*docs: Mapping[str, Mapping[str, Any]]) -> Sections:
    """The sections of ``docs`` laid over each other, a later key winning; the inputs are kept."""
    out: Sections = {}
    for doc in docs:
        for section, table in doc.items():
            out.setdefault(section, {}).update(table)
    return out


def read_base_config(path: str | None) -> Sections:
    if not path:
        return {}
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read --config {path}: {exc}") from None
    return {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}


def node_config(
    base: Mapping[str, Mapping[str, Any]],
    plan: NodePlan,
    *,
    cluster: bool,
    seeds: Sequence[str],
    secret: str,
    model: str | None,
    data_dir: Path,
    num_nodes: int = 1,
    cpus: str = "",
) -> Sections:
    """``base`` with what makes this node one of the local cluster laid over it."""
    doc = merge_sections(base)

    def put(section: str, **values: Any) -> None:
        doc.setdefault(section, {}).update(values)

    put("server", host=LOOPBACK, port=plan.port)
    put("log", format="json")
    if cpus:
        put("node", cpus=cpus)
    if model is not None:
        put("model", path=model)
    if num_nodes > 1 and not doc.get("model", {}).get("cpu_threads"):
        # The nodes share this machine's cores. Left to itself each daemon would
        # measure its best team alone and take every core; N teams of every
        # core then spin against each other. A share each, unless the base
        # config says otherwise.
        put("model", cpu_threads=max(1, cores() // num_nodes))
    if plan.node_id:
        put("node", id=plan.node_id)
    if cluster:
        put("node", role=plan.role, cluster_secret=secret, data_dir=str(data_dir))
        put("transfer", host=LOOPBACK)
        put("cluster", gossip_host=LOOPBACK, gossip_port=plan.gossip_port, seeds=list(seeds))
    if plan.group:
        # Its place in the group; the base config may set the rest of the
        # section (split, chunk_tokens), the same for every stage.
        put("pipeline", group=plan.group, stage=plan.stage, num_stages=plan.num_stages)
    return doc


def shared_model_name(model: str) -> str:
    """The object name ``up --model-from-peers`` shares ``model`` (a path) under:
    ``models/`` and its file or directory name, with what a name may not hold
    made '-'."""
    base = Path(model.rstrip("/")).name
    word = re.sub(r"[^A-Za-z0-9._-]", "-", base).lstrip("._-") or "model"
    return check_object_name(f"models/{word}")


def model_from_peers(plans: Sequence[NodePlan], model: str) -> Callable[[NodePlan], Sections]:
    """Each node's sections for ``up --model-from-peers``: the first node
    shares its ``model`` file or directory as an object, every other one
    loads its model from that object (asking the first node where it is)."""
    if model.startswith((BUILTIN_PREFIX, OBJECT_PREFIX)):
        raise ValueError(f"--model-from-peers shares a model file or directory; {model!r} is none")
    if len(plans) < 2:
        raise ValueError("--model-from-peers needs a cluster: give --prefill and --decode")
    # The daemons do not start where this process runs.
    model = os.path.abspath(model)
    name = shared_model_name(model)
    first = plans[0]

    def sections(plan: NodePlan) -> Sections:
        if plan == first:
            return {"model": {"path": model}, "objects": {"share_model": name}}
        return {
            "model": {"path": OBJECT_PREFIX + name},
            "objects": {"peers": [first.url]},
        }

    return sections
