"""`up --config` read again (services/mesh_reload.py), against a supervisor that starts
nothing: new models' workers start first, the gateway hears SIGHUP only once they serve,
removed models' workers leave only after the ramp; bad files, changed weights and a
reload under way are refused with nothing changed; a new model that never serves, or whose
worker cannot run, abandons the reload."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.launch_plan import LauncherConfig, child_specs
from services.launcher import metrics_ports
from services.mesh_config import load_mesh_config
from services.mesh_reload import RETIRE_MARGIN_S, MeshReload, Stage
from services.supervisor import ChildSpec

OLD = """\
models:
  - {name: old, model_dir: m, aggregated: 1}
  - {name: kept, model_dir: m, prefill: 1, decode: 1}
routes:
  - name: chat
    targets: [{model: old, weight: 1}]
"""
NEW = """\
models:
  - {name: new, model_dir: m, aggregated: 2}
  - {name: kept, model_dir: m, prefill: 1, decode: 1}
routes:
  - name: chat
    targets: [{model: new, weight: 1}]
"""


@dataclass
class FakeChild:
    spec: ChildSpec
    retiring: bool = False
    gave_up: bool = False


@dataclass
class FakeSupervisor:
    children: list[FakeChild]
    hangups: list[str] = field(default_factory=list)

    def add(self, spec: ChildSpec) -> FakeChild:
        self.children.append(child := FakeChild(spec))
        return child

    def retire(self, child: FakeChild) -> None:
        child.retiring = True

    def hangup(self, role: str) -> None:
        self.hangups.append(role)


@dataclass
class Mesh:
    reload: MeshReload
    supervisor: FakeSupervisor
    path: Path
    ready: set[str]

    def workers(self, retiring: bool = False) -> list[str]:
        return sorted(
            c.spec.worker_id
            for c in self.supervisor.children
            if c.spec.role == "worker" and c.retiring == retiring
        )


@pytest.fixture
def mesh(tmp_path: Path) -> Mesh:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    path = tmp_path / "mesh.yaml"
    path.write_text(OLD)
    mesh = load_mesh_config(path)
    config = LauncherConfig(home=tmp_path, mesh_file=path, mesh=mesh, model_dir=tmp_path / "m",
                            swap_ramp=10.0, ready_timeout=60.0)  # fmt: skip
    ports = itertools.count(9000)
    supervisor = FakeSupervisor([FakeChild(s) for s in child_specs(config, "nats://x:1", ports)])
    ready: set[str] = set()
    reload = MeshReload(
        config, supervisor, "nats://x:1", metrics_ports(config), lambda s: s, ready.__contains__
    )
    return Mesh(reload, supervisor, path, ready)


def test_new_workers_start_first_then_the_gateway_then_the_old_ones_leave(mesh):
    before = mesh.workers()
    mesh.path.write_text(NEW)
    mesh.reload.begin(0.0)
    assert mesh.workers() == sorted([*before, "new-both-0", "new-both-1"])
    mesh.reload.step(1.0)
    assert mesh.supervisor.hangups == [] and mesh.reload.swap.stage is Stage.STARTING
    mesh.ready.add("new")
    mesh.reload.step(2.0)
    assert mesh.supervisor.hangups == ["gateway"] and mesh.workers(retiring=True) == []
    mesh.reload.step(2.0 + 10.0 + RETIRE_MARGIN_S - 0.1)
    assert mesh.workers(retiring=True) == []  # the ramp is not over
    mesh.reload.step(2.0 + 10.0 + RETIRE_MARGIN_S)
    assert mesh.workers(retiring=True) == ["old-both-0"]
    assert mesh.reload.swap is None
    assert [m.name for m in mesh.reload.config.mesh.mesh_models] == ["new", "kept"]
    new = next(c for c in mesh.supervisor.children if c.spec.worker_id == "new-both-0")
    argv = new.spec.argv
    assert (
        argv[argv.index("--model-name") + 1] == "new" and argv[argv.index("--role") + 1] == "both"
    )


@pytest.mark.parametrize(
    "text, says",
    [
        ("models: [", "not valid YAML"),
        (NEW.replace("model: new, weight", "model: gone, weight"), "unknown model 'gone'"),
        (NEW.replace("name: kept, model_dir: m", "name: kept, model_dir: other"), "changed"),
        (NEW.replace("name: new, model_dir: m", "name: new, model_dir: nowhere"), "no weights"),
    ],
)
def test_a_refused_reload_changes_nothing(mesh, caplog, text, says):
    before = mesh.workers()
    mesh.path.write_text(text)
    mesh.reload.begin(0.0)
    assert mesh.reload.swap is None and mesh.workers() == before
    assert "reload refused" in caplog.text and says in caplog.text


def test_a_reload_under_way_refuses_another(mesh, caplog):
    mesh.path.write_text(NEW)
    mesh.reload.begin(0.0)
    started = mesh.workers()
    mesh.reload.begin(0.5)
    assert "a reload is under way" in caplog.text and mesh.workers() == started


@pytest.mark.parametrize("cause", ["timeout", "cannot run"])
def test_a_new_model_that_does_not_serve_abandons_the_reload(mesh, caplog, cause):
    before = mesh.workers()
    mesh.path.write_text(NEW)
    mesh.reload.begin(0.0)
    if cause == "cannot run":
        mesh.supervisor.children[-1].gave_up = True
        mesh.reload.step(1.0)
    else:
        mesh.reload.step(60.0)
    assert "reload abandoned" in caplog.text and mesh.reload.swap is None
    assert mesh.workers() == before and mesh.workers(retiring=True) == ["new-both-0", "new-both-1"]
    assert mesh.supervisor.hangups == []
