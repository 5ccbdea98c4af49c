"""deploy/kubernetes: every manifest is valid for the Kubernetes versions it is
meant for (the validator's bundled API schemas, strict: unknown fields
refused), and holds together where no schema looks: the probes, the drain's
time, the seeds, each pool's config as the daemon will read it, the secret,
the scrape annotations, the image. No cluster and no network are needed."""

from __future__ import annotations

import re
import socket
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from mooncaked.__main__ import _parser, build_config
from mooncaked.api.http import api_addr
from mooncaked.config import Config, ConfigError, ConfigValueError, NodeConfig, load_config
from mooncaked.secrets import (
    ENV_CLUSTER_SECRET,
    check_cluster_secret,
    generate_secret,
    resolve_cluster_secret,
)
from tests.kube_manifests import (
    DEPLOY,
    POOLS,
    daemon,
    documents,
    find,
    manifest_files,
    of_kind,
    pod_command,
    pod_spec,
    port_number,
)

# The oldest Kubernetes the manifests are for (preStop's sleep action is on
# by default from 1.30) and the newest whose schemas the validator bundles.
KUBERNETES_VERSIONS = ("1.30", "1.37")
# What the kubelet puts in $(POD_IP) (the downward API's status.podIP).
POD_IP = "10.244.3.17"
# After the drain the daemon closes its engine, the KV cache's SSD writes and
# its HTTP server; the systemd unit allows 15 s for that (TimeoutStopSec).
CLOSE_MARGIN_S = 15.0


def pod_config(sts: dict[str, Any], tmp_path: Path) -> Config:
    """The config the pod's mooncaked runs with, read by the daemon's own
    command line (strict: an unknown key is refused)."""
    args = pod_command(sts, POD_IP, tmp_path / sts["metadata"]["name"])
    return build_config(_parser().parse_args(args))


@pytest.fixture(params=POOLS)
def pool(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[dict[str, Any], Config]:
    sts = find("StatefulSet", request.param)
    return sts, pod_config(sts, tmp_path)


# ------------------------------------------------------------ the schemas


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_for_kubernetes(version: str) -> None:
    assert documents()
    for file_name, doc in documents():
        what = f"{file_name}: {doc['kind']}/{doc['metadata']['name']}"
        try:
            checked = kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{what} is not valid Kubernetes {version}: {path}: {exc.message}")
        assert checked == version, f"{what} was checked against {checked}, not {version}"


def test_a_wrong_field_is_refused() -> None:
    # The validation above means something: strict schemas refuse a misspelt field.
    sts = yaml.safe_load((DEPLOY / "prefill.yaml").read_text())
    daemon(sts)["readinessProbe"]["httpGet"]["paht"] = "/ready"
    with pytest.raises(kubernetes_validate.ValidationError, match="paht"):
        kubernetes_validate.validate(sts, KUBERNETES_VERSIONS[0], strict=True)


def test_the_kustomization_applies_every_manifest() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in manifest_files()]
    # The seeds name pods and the Service as written: no prefix may rename them.
    assert "namePrefix" not in kustomization and "nameSuffix" not in kustomization


# ------------------------------------------------------ the pools' config


def test_every_configmap_toml_loads_with_the_daemons_loader(tmp_path: Path) -> None:
    for config_map in of_kind("ConfigMap"):
        for key, text in config_map["data"].items():
            path = tmp_path / key
            path.write_text(text)
            load_config(path)  # raises ConfigError naming the key


def test_a_key_the_daemon_does_not_know_is_refused(tmp_path: Path) -> None:
    text = find("ConfigMap", "mooncaked-config")["data"]["prefill.toml"]
    path = tmp_path / "prefill.toml"
    path.write_text(text.replace("[server]\n", "[server]\nhots = '0.0.0.0'\n"))
    with pytest.raises(ConfigError, match=r"unknown key 'server\.hots'"):
        load_config(path)


def test_each_pool_runs_its_role_as_its_stable_pod_name(
    pool: tuple[dict[str, Any], Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    sts, config = pool
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert config.node.role == labels["app.kubernetes.io/component"]
    # node.id is left to its default, the host name (the pod's name) and port.
    name = f"{sts['metadata']['name']}-0"
    monkeypatch.setattr(socket, "gethostname", lambda: name)
    assert config.node_id == f"{name}-{config.server.port}"


def test_peers_reach_each_pod_at_its_ip(pool: tuple[dict[str, Any], Config]) -> None:
    sts, config = pool
    container = daemon(sts)
    assert config.cluster.gossip_host == config.transfer.host == POD_IP
    # Listening everywhere, announcing the pod IP.
    assert config.server.host == "0.0.0.0"
    assert api_addr(config, config.server.port) == f"{POD_IP}:{config.server.port}"
    assert port_number(container, "api") == config.server.port
    # Gossip: UDP and TCP on one port; the transfer engine on a fixed one.
    assert config.cluster.gossip_port != 0 and config.transfer.port != 0
    assert port_number(container, "gossip-udp", "UDP") == config.cluster.gossip_port
    assert port_number(container, "gossip-tcp") == config.cluster.gossip_port
    assert port_number(container, "transfer") == config.transfer.port
    # Pods share no IPC or network namespace: shared memory cannot apply.
    assert config.transfer.transports == ("tcp",)
    headless = find("Service", sts["spec"]["serviceName"])
    exposed = {(p["port"], p["protocol"]) for p in headless["spec"]["ports"]}
    for port, protocol in (
        (config.server.port, "TCP"),
        (config.cluster.gossip_port, "UDP"),
        (config.cluster.gossip_port, "TCP"),
        (config.transfer.port, "TCP"),
    ):
        assert (port, protocol) in exposed


def test_readiness_is_ready_on_the_api_port(pool: tuple[dict[str, Any], Config]) -> None:
    sts, config = pool
    container = daemon(sts)
    for probe, path in (
        ("readinessProbe", "/ready"),
        ("livenessProbe", "/health"),
        ("startupProbe", "/ready"),
    ):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert port_number(container, get["port"]) == config.server.port, probe
        assert get.get("scheme", "HTTP") == "HTTP", probe


def test_the_drain_ends_within_the_grace_period(pool: tuple[dict[str, Any], Config]) -> None:
    sts, config = pool
    spec = pod_spec(sts)
    pre_stop = daemon(sts)["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = spec["terminationGracePeriodSeconds"]
    # SIGTERM comes after preStop, then the drain, then closing: all before SIGKILL.
    assert grace > config.server.drain_timeout_s
    assert grace >= pre_stop + config.server.drain_timeout_s + CLOSE_MARGIN_S


def test_the_seeds_are_pods_of_the_headless_service(pool: tuple[dict[str, Any], Config]) -> None:
    sts, config = pool
    headless = find("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    # A node's name resolves before it is ready: gossip does not wait for /ready.
    assert headless["spec"]["publishNotReadyAddresses"] is True
    pools = {name: find("StatefulSet", name) for name in POOLS}
    for other in pools.values():
        assert other["spec"]["serviceName"] == headless["metadata"]["name"]
        labels = other["spec"]["template"]["metadata"]["labels"]
        assert headless["spec"]["selector"].items() <= labels.items()
    # Every pod name the headless Service gives: <statefulset>-<ordinal>.<service>.
    names = {
        f"{name}-{i}.{headless['metadata']['name']}"
        for name, other in pools.items()
        for i in range(other["spec"]["replicas"])
    }
    hosts = set()
    for seed in config.cluster.seeds:
        host, _, port = seed.rpartition(":")
        assert host in names, f"seed {seed!r} names no pod of {sorted(names)}"
        assert int(port) == config.cluster.gossip_port
        hosts.add(host)
    # Every pool's first pod is a seed: a cluster of one pool still forms.
    assert {f"{name}-0.{headless['metadata']['name']}" for name in POOLS} <= hosts


def test_the_secret_comes_from_a_secret_not_the_configmap(
    pool: tuple[dict[str, Any], Config],
) -> None:
    sts, config = pool
    for config_map in of_kind("ConfigMap"):
        for key, text in config_map["data"].items():
            for section, table in tomllib.loads(text).items():
                for name in table:
                    assert not re.search("secret|token|api_keys", name), (
                        f"{config_map['metadata']['name']}/{key} sets {section}.{name}"
                    )
    # No secret is committed as a manifest either: the README has it made.
    assert not of_kind("Secret")
    assert config.node.cluster_secret == NodeConfig().cluster_secret
    assert not config.node.cluster_secret_file
    # Without the Secret the node refuses to start: it is reachable by others.
    with pytest.raises(ConfigValueError, match="published default"):
        check_cluster_secret(config)
    env = {e["name"]: e for e in daemon(sts)["env"]}
    ref = env[ENV_CLUSTER_SECRET]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == "mooncaked-secrets" and not ref.get("optional", False)
    check_cluster_secret(resolve_cluster_secret(config, {ENV_CLUSTER_SECRET: generate_secret()}))
    # A Secret volume's files turn group-readable under fsGroup, which the
    # daemon refuses (chmod 600): with fsGroup, the secret comes by variable.
    if pod_spec(sts)["securityContext"].get("fsGroup") is not None:
        assert not any(v.get("secret") for v in pod_spec(sts)["volumes"])


def test_prometheus_scrapes_metrics_on_the_api_port(pool: tuple[dict[str, Any], Config]) -> None:
    sts, config = pool
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/port"] == str(config.server.port)
    # Prometheus sends no token.
    assert not config.server.metrics_require_auth


def test_state_lives_on_the_pods_volume(pool: tuple[dict[str, Any], Config]) -> None:
    sts, config = pool
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    (mount,) = [m for m in daemon(sts)["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert str(config.data_dir) == mount["mountPath"]
    assert config.store.ssd_path.startswith(mount["mountPath"] + "/")
    storage = claim["spec"]["resources"]["requests"]["storage"]
    assert storage.endswith("Gi") and int(storage[:-2]) << 30 > config.store.ssd_bytes


def test_cpu_threads_fit_the_cpu_request(pool: tuple[dict[str, Any], Config]) -> None:
    sts, config = pool
    cpu = daemon(sts)["resources"]["requests"]["cpu"]
    cores = int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
    # 0 would mean every core of the Kubernetes node, whatever the pod was given.
    assert 0 < config.model.cpu_threads <= cores


def test_the_image_holds_the_model_and_runs_as_the_pods_user(
    pool: tuple[dict[str, Any], Config],
) -> None:
    sts, config = pool
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(rf"ln -s \S+ {re.escape(config.model.path)}$", dockerfile, re.M)
    assert 'ENTRYPOINT ["mooncaked"]' in dockerfile
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    assert user is not None
    security = pod_spec(sts)["securityContext"]
    assert (str(security["runAsUser"]), str(security["runAsGroup"])) == user.groups()


def test_clients_reach_the_decode_pool() -> None:
    service = find("Service", "mooncaked")
    decode = find("StatefulSet", "mooncaked-decode")
    labels = decode["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "api"
