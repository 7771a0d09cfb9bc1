"""compose/k8s/overlays/multi-model: two models in one mesh on Kubernetes, rendered by
`kubectl kustomize` — a prefill and a decode Deployment per model, each with its own HPA,
PodDisruptionBudget and Service selecting only its own pods; every worker names a model of
the router's config, which the gateway reads from a ConfigMap; every container matches
the CLI and every manifest the Kubernetes schemas."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.mesh_config import load_mesh_config
from tests.unit.test_deploy_cli import invocation_problems
from tests.unit.test_deploy_k8s import (
    KUBECTL,
    KUBERNETES_VERSION,
    ROOT,
    config_maps,
    container_env,
    expand,
    find,
    pod_labels,
    render,
    selects,
    splitserve_containers,
)

OVERLAY = "multi-model"
POOLS = {  # Deployment -> (model, role)
    "splitserve-prefill": ("smol-a", "prefill"),
    "splitserve-decode": ("smol-a", "decode"),
    "smol-b-splitserve-prefill": ("smol-b", "prefill"),
    "smol-b-splitserve-decode": ("smol-b", "decode"),
}
MOUNTED = "/etc/splitserve/mesh.yaml"

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not found")


def arg(container: dict, name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in container["args"] if a.startswith(f"--{name}=")]
    return value


def test_renders_and_validates_against_the_kubernetes_schemas() -> None:
    errors = {}
    for doc in render(OVERLAY):
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors[f"{doc['kind']}/{doc['metadata']['name']}"] = str(exc)
    assert errors == {}


def test_every_container_matches_the_cli() -> None:
    containers = splitserve_containers(OVERLAY)
    assert len(containers) == 12  # scheduler, planner; gateway and four pools with their pull
    problems = {}
    for name, container in containers:
        env = container_env(OVERLAY, container)
        argv = [expand(a, env) for a in container["args"]]
        ours = {k: v for k, v in env.items() if not any(f"$({k})" in a for a in container["args"])}
        problems[name] = invocation_problems(argv, ours)
    assert problems == {name: [] for name in problems}


def test_each_models_pools_scale_and_disrupt_alone() -> None:
    labels = pod_labels(OVERLAY)
    for pool, (model, role) in POOLS.items():
        (container,) = find(OVERLAY, "Deployment", pool)["spec"]["template"]["spec"]["containers"]
        assert arg(container, "model-name") == model and arg(container, "role") == role
        hpa = find(OVERLAY, "HorizontalPodAutoscaler", pool)
        assert hpa["spec"]["scaleTargetRef"]["name"] == pool
        selectors = [
            find(OVERLAY, "Deployment", pool)["spec"]["selector"],
            find(OVERLAY, "PodDisruptionBudget", pool)["spec"]["selector"],
            {"matchLabels": find(OVERLAY, "Service", pool)["spec"]["selector"]},
        ]
        for selector in selectors:
            chosen = {name for name, pod in labels.items() if selects(selector, pod)}
            assert chosen == {pool}, (pool, selector)


def test_the_gateway_reads_the_router_config_that_names_every_pool(tmp_path: Path) -> None:
    gateway = find(OVERLAY, "Deployment", "splitserve-gateway")["spec"]["template"]["spec"]
    (container,) = gateway["containers"]
    assert arg(container, "mesh-config") == MOUNTED
    (mount,) = [m for m in container["volumeMounts"] if MOUNTED.startswith(m["mountPath"])]
    (volume,) = [v for v in gateway["volumes"] if v["name"] == mount["name"]]
    text = config_maps(OVERLAY)[volume["configMap"]["name"]][Path(MOUNTED).name]
    assert text == (ROOT / "compose/k8s/overlays/multi-model/mesh.yaml").read_text()
    (tmp_path / "mesh.yaml").write_text(text)
    config = load_mesh_config(tmp_path / "mesh.yaml")
    assert {m.name for m in config.mesh_models} == {model for model, _ in POOLS.values()}
    assert arg(container, "served-model-name") == config.mesh_models[0].name
    assert yaml.safe_load(text)["routes"]


def test_one_planner_plans_the_first_models_pools() -> None:
    planners = [
        d
        for d in render(OVERLAY)
        if d["kind"] == "Deployment" and "planner" in d["metadata"]["name"]
    ]
    assert [d["metadata"]["name"] for d in planners] == ["splitserve-planner"]
    (container,) = planners[0]["spec"]["template"]["spec"]["containers"]
    assert container_env(OVERLAY, container)["SPLITSERVE_PLANNER_MODEL"] == "smol-a"
