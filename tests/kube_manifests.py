"""deploy/kubernetes read as the API server and the kubelet read it: the
objects of every manifest, a pod's daemon container, its ports by name, and
the command line its daemon runs with (``$(VAR)`` expanded, the config file
taken from the ConfigMap mounted where the arguments name it)."""

from __future__ import annotations

import functools
import re
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
POOLS = ("mooncaked-prefill", "mooncaked-decode")


def manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")


@functools.cache
def documents() -> tuple[tuple[str, dict[str, Any]], ...]:
    """(file name, object) for every object of every manifest."""
    out = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return tuple(out)


def find(kind: str, name: str) -> dict[str, Any]:
    for _, doc in documents():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} named {name!r} in {DEPLOY}")


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in documents() if doc["kind"] == kind]


def pod_spec(sts: dict[str, Any]) -> dict[str, Any]:
    return sts["spec"]["template"]["spec"]


def daemon(sts: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod_spec(sts)["containers"] if c["name"] == "mooncaked"]
    return container


def port_number(container: dict[str, Any], port: int | str, protocol: str = "TCP") -> int:
    """A probe's or Service's port: a number, or the name of a container port."""
    if isinstance(port, int):
        return port
    (match,) = [
        p for p in container["ports"] if p["name"] == port and p.get("protocol", "TCP") == protocol
    ]
    return match["containerPort"]


def expand(arg: str, values: dict[str, str]) -> str:
    """``$(VAR)`` replaced as the kubelet replaces it in a container's args."""
    return re.sub(r"\$\((\w+)\)", lambda m: values[m[1]], arg)


def mounted_file(sts: dict[str, Any], path: str) -> tuple[str, str]:
    """(ConfigMap name, key) of the file at ``path`` in the daemon's container."""
    target = PurePosixPath(path)
    volumes = {v["name"]: v for v in pod_spec(sts)["volumes"]}
    for mount in daemon(sts)["volumeMounts"]:
        if target.parent == PurePosixPath(mount["mountPath"]):
            config_map = volumes[mount["name"]]["configMap"]
            return config_map["name"], target.name
    raise AssertionError(f"{path} is on no volume of {sts['metadata']['name']}")


def pod_command(sts: dict[str, Any], pod_ip: str, config_dir: Path) -> list[str]:
    """The arguments of the pod's daemon, ``$(POD_IP)`` expanded as the kubelet
    does, its ``--config`` file written from the ConfigMap into ``config_dir``."""
    container = daemon(sts)
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # The image's entrypoint is mooncaked; the pod gives only its arguments.
    assert "command" not in container
    args = [expand(a, {"POD_IP": pod_ip}) for a in container["args"]]
    at = args.index("--config") + 1
    name, key = mounted_file(sts, args[at])
    local = config_dir / key
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_text(find("ConfigMap", name)["data"][key])
    args[at] = str(local)
    return args
