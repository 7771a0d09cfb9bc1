"""compose/k8s/overlays/planner: the worker pools scaled to the planner's desired replicas
by KEDA. Rendered by `kubectl kustomize`: the Kubernetes manifests validate against the
schemas (KEDA's ScaledObjects are checked here by hand: they are an add-on's), each worker
Deployment has one ScaledObject whose Prometheus query reads the planner's gauge for the
role that Deployment's workers run, the base HPAs are gone (KEDA makes its own), and the
planner asks for no more than the ScaledObjects allow."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest

from services.planner.config import PlannerConfig
from services.planner.metrics import PlannerMetrics
from tests.unit.test_deploy_cli import invocation_problems
from tests.unit.test_deploy_k8s import (
    KUBECTL,
    KUBERNETES_VERSION,
    container_env,
    expand,
    find,
    render,
    splitserve_containers,
)

OVERLAY = "planner"
POOLS = ("prefill", "decode")
QUERY = re.compile(r'^max\(splitserve_planner_desired_replicas\{role="(\w+)"\}\)$')

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not found")


def test_the_kubernetes_manifests_validate():
    errors = {}
    for doc in render(OVERLAY):
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors[f"{doc['kind']}/{doc['metadata']['name']}"] = str(exc)
    assert errors == {}


def test_every_container_matches_the_cli():
    problems = {}
    for name, container in splitserve_containers(OVERLAY):
        env = container_env(OVERLAY, container)
        argv = [expand(a, env) for a in container["args"]]
        ours = {k: v for k, v in env.items() if not any(f"$({k})" in a for a in container["args"])}
        problems[name] = invocation_problems(argv, ours)
    assert problems == {name: [] for name in problems}


def test_each_pool_follows_the_planners_count_for_its_role():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in render(OVERLAY)}
    assert not {k for k in kinds if k[0] == "HorizontalPodAutoscaler"}  # KEDA makes its own
    scaled = [d for d in render(OVERLAY) if d["kind"] == "ScaledObject"]
    planner = container_env(OVERLAY, splitserve_planner())
    policy = PlannerConfig(max_per_role=int(planner["SPLITSERVE_PLANNER_MAX_PER_ROLE"]))
    assert planner["SPLITSERVE_PLANNER_MODE"] == "replicas"  # ADD and DRAIN move the counts
    assert sorted(d["spec"]["scaleTargetRef"]["name"] for d in scaled) == [
        f"splitserve-{pool}" for pool in sorted(POOLS)
    ]
    for doc in scaled:
        spec = doc["spec"]
        deployment = find(OVERLAY, "Deployment", spec["scaleTargetRef"]["name"])
        (worker,) = deployment["spec"]["template"]["spec"]["containers"]
        (trigger,) = spec["triggers"]
        assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
        assert trigger["metadata"]["threshold"] == "1"  # one pod per unit: replicas = count
        match = QUERY.match(trigger["metadata"]["query"])
        assert match, trigger["metadata"]["query"]
        assert f"--role={match.group(1)}" in worker["args"]
        assert spec["minReplicaCount"] >= policy.min_per_role
        assert spec["maxReplicaCount"] == policy.max_per_role
        assert spec["fallback"]["replicas"] >= 1


def test_the_query_reads_the_gauge_the_planner_serves():
    metrics = PlannerMetrics("")
    metrics.desired.labels("", "prefill").set(2)
    value = metrics.registry.get_sample_value
    assert value("splitserve_planner_desired_replicas", {"model": "", "role": "prefill"}) == 2


def splitserve_planner() -> dict:
    (container,) = find(OVERLAY, "Deployment", "splitserve-planner")["spec"]["template"]["spec"][
        "containers"
    ]
    return container
