"""compose/k8s: each overlay rendered by `kubectl kustomize`, validated against the
Kubernetes schemas (kubernetes-validate), every splitserve container's arguments and
environment (ConfigMaps resolved) checked against the real CLI, the pools kept apart:
each has its own Deployment, PodDisruptionBudget and HorizontalPodAutoscaler, and the
workers set up for the KV transport (NIXL over UCX between pods, NATS as the fallback).

kubectl comes from Debian's `kubernetes-client` package (.ci/run installs it); without it
these tests skip and say so."""

from __future__ import annotations

import dataclasses
import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.planner.config import parse_slo
from services.worker.config import WorkerConfig
from tests.unit.test_deploy_cli import invocation_problems, unreachable_engine_settings

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("cpu", "gpu", "tls")
POOLS = ("prefill", "decode")
KUBERNETES_VERSION = "1.30"
KUBECTL = shutil.which("kubectl")
UCX_RANGE = re.compile(r"^(\d+)-(\d+)$")
WORKER_GRACE_S = next(
    f.default for f in dataclasses.fields(WorkerConfig) if f.name == "grace_period"
)

pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl not found (Debian: apt-get install kubernetes-client)"
)


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    result = subprocess.run(
        [str(KUBECTL), "kustomize", str(ROOT / "compose" / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def find(overlay: str, kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in render(overlay) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def config_maps(overlay: str) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d["data"] for d in render(overlay) if d["kind"] == "ConfigMap"}


def container_env(overlay: str, container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom, then env."""
    maps = config_maps(overlay)
    env = {
        k: v
        for ref in container.get("envFrom", [])
        for k, v in maps[ref["configMapRef"]["name"]].items()
    }
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["configMapKeyRef"]
            env[item["name"]] = maps[ref["name"]][ref["key"]]
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion of container arguments."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def pod_templates(overlay: str) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]
        for d in render(overlay)
        if d["kind"] in ("Deployment", "StatefulSet")
    }


def splitserve_containers(overlay: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{name}/{c['name']}", c)
        for name, spec in pod_templates(overlay).items()
        for c in spec.get("initContainers", []) + spec["containers"]
        if c["image"].startswith("splitserve:")
    ]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions) against a pod's labels."""
    tests = {
        "In": lambda key, values: labels.get(key) in values,
        "NotIn": lambda key, values: labels.get(key) not in values,
        "Exists": lambda key, _: key in labels,
        "DoesNotExist": lambda key, _: key not in labels,
    }
    return selector.get("matchLabels", {}).items() <= labels.items() and all(
        tests[e["operator"]](e["key"], e.get("values", []))
        for e in selector.get("matchExpressions", [])
    )


def pod_labels(overlay: str) -> dict[str, dict[str, str]]:
    return {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in render(overlay)
        if d["kind"] in ("Deployment", "StatefulSet")
    }


def worker_container(overlay: str, pool: str) -> dict[str, Any]:
    (container,) = pod_templates(overlay)[f"splitserve-{pool}"]["containers"]
    return container


def ucx_ports(overlay: str, pool: str) -> tuple[int, int]:
    """The first and last of the TCP ports UCX listens on in this pool's workers."""
    env = container_env(overlay, worker_container(overlay, pool))
    match = UCX_RANGE.match(env["UCX_TCP_PORT_RANGE"])
    assert match, env["UCX_TCP_PORT_RANGE"]
    first, last = int(match.group(1)), int(match.group(2))
    assert 1024 <= first < last < 65536
    return first, last


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renders_and_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    errors = {}
    for doc in render(overlay):
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors[f"{doc['kind']}/{doc['metadata']['name']}"] = str(exc)
    assert errors == {}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_matches_the_cli(overlay: str) -> None:
    containers = splitserve_containers(overlay)
    assert len(containers) == 8  # scheduler, planner; gateway, prefill, decode with their pull
    problems = {}
    for name, container in containers:
        env = container_env(overlay, container)
        argv = [expand(arg, env) for arg in container["args"]]
        # A variable that only feeds `$(VAR)` in the arguments is Kubernetes', not ours.
        ours = {k: v for k, v in env.items() if not any(f"$({k})" in a for a in container["args"])}
        problems[name] = invocation_problems(argv, ours)
    assert problems == {name: [] for name in problems}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_engine_setting_reaches_every_worker_pool(overlay: str) -> None:
    missing = {}
    for name, container in splitserve_containers(overlay):
        if container["args"][0] == "worker":
            env = container_env(overlay, container)
            argv = [expand(arg, env) for arg in container["args"]]
            missing[name] = unreachable_engine_settings(argv, env)
    assert missing == {f"splitserve-{pool}/worker": [] for pool in POOLS}


def test_gpu_workers_run_bfloat16() -> None:
    for overlay, dtype in (("cpu", ""), ("gpu", "bfloat16")):
        for pool in POOLS:
            (container,) = pod_templates(overlay)[f"splitserve-{pool}"]["containers"]
            assert container_env(overlay, container)["SPLITSERVE_DTYPE"] == dtype


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_models_are_pulled_where_the_services_read_them(overlay: str) -> None:
    for name, spec in pod_templates(overlay).items():
        pulls = spec.get("initContainers", [])
        main = spec["containers"][0]
        model_dirs = [a for a in main.get("args", []) if a.startswith("--model-dir=")]
        if not model_dirs:
            continue
        (pull,) = pulls
        pull_env = container_env(overlay, pull)
        model = expand(pull["args"][1], pull_env)
        home = pull_env["SPLITSERVE_HOME"]
        assert expand(model_dirs[0], container_env(overlay, main)) == (
            f"--model-dir={home}/models/{model}"
        ), name
        mounts = {(m["name"], m["mountPath"]) for m in main["volumeMounts"]}
        assert {(m["name"], m["mountPath"]) for m in pull["volumeMounts"]} <= mounts, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_pool_scales_and_disrupts_alone(overlay: str) -> None:
    labels = {
        pool: find(overlay, "Deployment", f"splitserve-{pool}")["spec"]["template"]["metadata"][
            "labels"
        ]
        for pool in POOLS
    }
    for pool in POOLS:
        other = next(p for p in POOLS if p != pool)
        hpa = find(overlay, "HorizontalPodAutoscaler", f"splitserve-{pool}")
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": f"splitserve-{pool}",
        }
        metrics = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
        assert all(m.startswith("splitserve_") for m in metrics)
        for kind in ("Deployment", "PodDisruptionBudget"):
            spec = find(overlay, kind, f"splitserve-{pool}")["spec"]
            selector = spec["selector"]["matchLabels"]
            assert selector.items() <= labels[pool].items()
            assert not selector.items() <= labels[other].items(), f"{kind} {pool} selects {other}"
    hpa_metrics = {
        pool: {
            m["pods"]["metric"]["name"]
            for m in find(overlay, "HorizontalPodAutoscaler", f"splitserve-{pool}")["spec"][
                "metrics"
            ]
        }
        for pool in POOLS
    }
    assert "splitserve_num_requests_waiting" in hpa_metrics["prefill"]
    assert "splitserve_kv_cache_usage_ratio" in hpa_metrics["decode"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_get_longer_than_their_drain_to_stop(overlay: str) -> None:
    for pool in POOLS:
        spec = pod_templates(overlay)[f"splitserve-{pool}"]
        assert spec["terminationGracePeriodSeconds"] > WORKER_GRACE_S


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_reach_ports_the_containers_declare(overlay: str) -> None:
    gateway = pod_templates(overlay)["splitserve-gateway"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert f"--port={ports['http']}" in gateway["args"]
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    nats = pod_templates(overlay)["nats"]["containers"][0]
    assert nats["readinessProbe"]["httpGet"]["port"] in {p["name"] for p in nats["ports"]}
    conf = next(v for k, v in config_maps(overlay).items() if k.startswith("nats-config"))
    assert conf["nats.conf"] == (ROOT / "compose" / "nats" / "nats.conf").read_text()


def test_gpu_overlay_puts_one_gpu_on_each_worker_and_none_elsewhere() -> None:
    for overlay, expected in (("cpu", None), ("gpu", 1)):
        for name, spec in pod_templates(overlay).items():
            for container in spec["containers"]:
                limit = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
                is_worker = name in {f"splitserve-{pool}" for pool in POOLS}
                assert limit == (expected if is_worker else None), (overlay, name)
    images = {c["image"] for _, c in splitserve_containers("gpu")}
    assert images == {"splitserve:0.1.0-cuda"}
    assert {c["image"] for _, c in splitserve_containers("cpu")} == {"splitserve:0.1.0"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_pick_their_kv_transport_auto_and_get_shared_memory(overlay: str) -> None:
    for pool in POOLS:
        spec = pod_templates(overlay)[f"splitserve-{pool}"]
        container = worker_container(overlay, pool)
        env = container_env(overlay, container)
        assert (env["SPLITSERVE_KV_TRANSPORT"], env["UCX_TLS"]) == ("auto", "all"), pool
        ucx_ports(overlay, pool)
        (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == shm["name"]]
        assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"]["sizeLimit"]
    others = [c for n, c in splitserve_containers(overlay) if not n.endswith("/worker")]
    assert not any("SPLITSERVE_KV_TRANSPORT" in container_env(overlay, c) for c in others)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_admits_ucx_between_workers_and_metrics_from_anyone(overlay: str) -> None:
    policy = find(overlay, "NetworkPolicy", "splitserve-workers")["spec"]
    labels = pod_labels(overlay)
    workers = {f"splitserve-{pool}" for pool in POOLS}
    assert {n for n, pod in labels.items() if selects(policy["podSelector"], pod)} == workers
    assert policy["policyTypes"] == ["Ingress"]  # NATS and OTLP go out unhindered
    (ucx,) = {ucx_ports(overlay, pool) for pool in POOLS}  # one range for both pools
    admitted: dict[tuple[int, int], set[str]] = {}
    for rule in policy["ingress"]:
        peers = [peer["podSelector"] for peer in rule.get("from", [])]
        sources = {n for n, pod in labels.items() if any(selects(p, pod) for p in peers)}
        sources = sources if peers else set(labels)  # no `from`: from anyone
        for port in rule["ports"]:
            assert port["protocol"] == "TCP"
            admitted[(port["port"], port.get("endPort", port["port"]))] = sources
    assert admitted[ucx] == workers  # UCX: from the workers only
    for pool in POOLS:
        for port in worker_container(overlay, pool)["ports"]:
            number = port["containerPort"]
            assert admitted[(number, number)] == set(labels), port  # Prometheus: from anyone


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_planner_runs_as_its_nats_user_and_serves_its_metrics(overlay: str) -> None:
    deployment = find(overlay, "Deployment", "splitserve-planner")["spec"]
    assert (deployment["replicas"], deployment["strategy"]["type"]) == (1, "Recreate")
    pod = deployment["template"]["spec"]
    (container,) = pod["containers"]
    env = container_env(overlay, container)
    assert container["args"] == ["planner"]
    assert env["SPLITSERVE_NATS_USER"] == "planner"
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "nats-credentials"]
    assert env["SPLITSERVE_NATS_PASSWORD_FILE"] == mount["mountPath"] + "/password"
    (volume,) = [v for v in pod["volumes"] if v["name"] == "nats-credentials"]
    assert volume["secret"]["items"] == [{"key": "planner", "path": "password"}]
    assert parse_slo(env["SPLITSERVE_PLANNER_SLO"]) == (1.0, 0.04)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == int(env["SPLITSERVE_METRICS_PORT"])
    service = find(overlay, "Service", "splitserve-planner")["spec"]
    assert selects({"matchLabels": service["selector"]}, pod_labels(overlay)["splitserve-planner"])
    assert [p["targetPort"] for p in service["ports"]] == ["metrics"]
