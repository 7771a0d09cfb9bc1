"""The gateway's POST /admin/reload without `up` (services/gateway/reload.py): behind the API
key; a good file routes at once (a new model listed, the removed one gone, the changed
route ramping); a bad file answers 400 with its error and changes nothing."""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.supervisor import UP_PID_ENV
from shared.nats_server import NatsServer
from tests.e2e.conftest import real_model_dir  # noqa: F401  (fixture)
from tests.integration.gateway_harness import KEY, Harness, gateway_config, http, run_gateway


def mesh_yaml(model_dir: Path, model: str) -> str:
    return f"""\
models:
  - {{name: {model}, model_dir: {model_dir}, aggregated: 1}}
routes:
  - name: chat
    targets: [{{model: {model}, weight: 1}}]
"""


@pytest.fixture
def mesh_file(tmp_path: Path, real_model_dir: Path) -> Path:  # noqa: F811
    path = tmp_path / "mesh.yaml"
    path.write_text(mesh_yaml(real_model_dir, "smol-a"))
    return path


@pytest.fixture
def gw(nats_server: NatsServer, real_model_dir: Path, mesh_file: Path) -> Iterator[Harness]:  # noqa: F811
    config = dataclasses.replace(
        gateway_config(nats_server, real_model_dir, "gw-reload"), mesh_config=mesh_file
    )
    yield from run_gateway(nats_server, config, real_model_dir)


def reload(gw: Harness, key: str = KEY) -> tuple[int, dict]:
    request = urllib.request.Request(f"{gw.url}/admin/reload", data=b"", method="POST")
    request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def listed(gw: Harness) -> dict[str, str]:
    status, body = http(gw, "/v1/models")
    assert status == 200, body
    return {card["id"]: card["splitserve_kind"] for card in body["data"]}


def test_a_reload_routes_by_the_new_file_and_a_bad_one_changes_nothing(
    gw,
    mesh_file,
    real_model_dir,  # noqa: F811
    monkeypatch,
):
    monkeypatch.delenv(UP_PID_ENV, raising=False)  # the gateway alone, not under `up`
    assert reload(gw, key="wrong")[0] == 401
    mesh_file.write_text(mesh_yaml(real_model_dir, "smol-b"))
    status, body = reload(gw)
    assert status == 200, body
    assert body == {"reload": "done", "added": ["smol-b"], "removed": ["smol-a"],
                    "ramping": ["chat"]}  # fmt: skip
    assert listed(gw) == {"smol-b": "model", "chat": "route"}

    mesh_file.write_text(mesh_yaml(real_model_dir, "smol-c").replace("weight: 1", "weight: 0"))
    status, body = reload(gw)
    assert status == 400 and "reload refused, the mesh is unchanged" in body["error"]["message"]
    assert "weight" in body["error"]["message"], body
    assert listed(gw) == {"smol-b": "model", "chat": "route"}
