"""compose/multi-model.yml on top of docker-compose.yml: two models in one mesh. Merged as
docker compose merges them (mappings merge, `extends` copies the base service), the result
matches the Compose Specification, every command and environment matches the CLI, each
model has its own prefill and decode pool, scaled by its own variables, and the gateway
reads the router's config that names exactly those models."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from services.mesh_config import load_mesh_config
from tests.unit.test_deploy_cli import invocation_problems
from tests.unit.test_deploy_compose import (
    COMPOSE,
    compose_errors,
    env_strings,
    load_compose,
    worker_services,
)

MODELS_FILE = COMPOSE / "multi-model.yml"
POOLS = {  # service -> (model, role, its replicas variable)
    "prefill": ("smol-a", "prefill", "PREFILL_REPLICAS"),
    "decode": ("smol-a", "decode", "DECODE_REPLICAS"),
    "prefill-b": ("smol-b", "prefill", "PREFILL_B_REPLICAS"),
    "decode-b": ("smol-b", "decode", "DECODE_B_REPLICAS"),
}


def merge(base: Any, extra: Any) -> Any:
    """Compose's merge of one service into another: mappings key by key, lists appended,
    anything else replaced."""
    if isinstance(base, dict) and isinstance(extra, dict):
        return {k: merge(base[k], v) if k in base else v for k, v in extra.items()} | {
            k: v for k, v in base.items() if k not in extra
        }
    if isinstance(base, list) and isinstance(extra, list):
        return base + [item for item in extra if item not in base]
    return extra


def merged(env: dict[str, str] | None = None) -> dict[str, Any]:
    base, extra = load_compose(env), load_compose(env, MODELS_FILE)
    services = copy.deepcopy(base["services"])
    for name, service in extra["services"].items():
        extends = service.pop("extends", None)
        if extends is not None:
            assert extends["file"] == "docker-compose.yml"
            services[name] = merge(copy.deepcopy(base["services"][extends["service"]]), service)
        else:
            services[name] = merge(services[name], service)
    return base | {"services": services}


def test_the_merged_file_matches_the_compose_spec() -> None:
    assert compose_errors(merged()) == []
    assert compose_errors(merged({"PREFILL_B_REPLICAS": "2", "DECODE_B_REPLICAS": "3"})) == []


def test_every_command_and_environment_matches_the_cli() -> None:
    services = {n: s for n, s in merged()["services"].items() if n in (*POOLS, "gateway")}
    problems = {
        name: invocation_problems(service["command"], env_strings(service))
        for name, service in services.items()
    }
    assert problems == {name: [] for name in services}


def test_each_model_has_its_own_pools_scaled_alone() -> None:
    counts = {variable: str(i + 2) for i, (_, _, variable) in enumerate(POOLS.values())}
    workers = worker_services(merged(counts))
    for name, (model, role, variable) in POOLS.items():
        service = workers[name]
        assert f"--role={role}" in service["command"], name
        assert env_strings(service)["SPLITSERVE_MODEL_NAME"] == model, name
        assert service["deploy"]["replicas"] == int(counts[variable]), name
        assert service["depends_on"]["pull"]["condition"] == "service_completed_successfully"


def test_the_gateway_reads_a_router_config_naming_those_models() -> None:
    gateway = merged()["services"]["gateway"]
    path = env_strings(gateway)["SPLITSERVE_MESH_CONFIG"]
    (source,) = [v.split(":")[0] for v in gateway["volumes"] if v.split(":")[1] == path]
    config = load_mesh_config((COMPOSE / source).resolve())
    assert {m.name for m in config.mesh_models} == {model for model, _, _ in POOLS.values()}
    assert env_strings(gateway)["SPLITSERVE_SERVED_MODEL_NAME"] == config.mesh_models[0].name
    assert Path(source).name == "multi-model.mesh.yaml"
