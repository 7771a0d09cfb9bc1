"""A reloaded mesh config's routes ramp (services/gateway/router.py's Ramp, reload.py's
swap): a route whose targets changed sends a growing share to its new targets, a removed
model stays reachable through the old route only, and an unchanged route does not ramp."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from services.gateway.reload import swap
from services.gateway.routed import Routing
from services.gateway.router import Ramp, Router
from services.mesh_config import load_mesh_config
from services.mesh_routes import Route, Target

OLD = """\
models:
  - {name: old, model_dir: m, aggregated: 1}
  - {name: other, model_dir: m, aggregated: 1}
routes:
  - name: chat
    targets: [{model: old, weight: 1}]
  - name: steady
    targets: [{model: other, weight: 1}]
"""
NEW = """\
models:
  - {name: new, model_dir: m, aggregated: 1}
  - {name: other, model_dir: m, aggregated: 1}
routes:
  - name: steady                      # moved in the file: no change
    targets: [{model: other, weight: 1}]
  - name: chat
    targets: [{model: new, weight: 1}]
"""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def swapped(tmp_path: Path, clock: Clock) -> Routing:
    (tmp_path / "old.yaml").write_text(OLD)
    (tmp_path / "new.yaml").write_text(NEW)
    router = Router(load_mesh_config(tmp_path / "old.yaml"), random.Random(7), clock=clock)
    routing = Routing(router, {}, {})
    swap(routing, load_mesh_config(tmp_path / "new.yaml"), 10.0, clock.now)
    return routing


def shares(router: Router, route: str, n: int = 2000) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _ in range(n):
        model = router.decide(route, lambda: 0).target
        counts[model] = counts.get(model, 0) + 1
    return counts


def test_the_share_grows_from_zero_to_one_over_the_ramp():
    ramp = Ramp(load_route(), 50.0, 10.0)
    assert [ramp.share(t) for t in (40.0, 50.0, 52.5, 60.0, 99.0)] == [0.0, 0.0, 0.25, 1.0, 1.0]
    assert Ramp(load_route(), 50.0, 0.0).share(50.0) == 1.0  # no ramp: at once


def load_route() -> Route:
    return Route("chat", 1, targets=(Target("old", 1.0, 2),))


@pytest.mark.parametrize("at, new_share", [(0.0, 0.0), (2.5, 0.25), (7.5, 0.75), (10.0, 1.0)])
def test_a_changed_route_moves_its_traffic_by_the_ramps_share(tmp_path, at, new_share):
    clock = Clock()
    routing = swapped(tmp_path, clock)
    clock.now += at
    counts = shares(routing.router, "chat")
    got = counts.get("new", 0) / 2000
    assert abs(got - new_share) < 0.05, counts  # binomial: sd <= 0.011
    assert set(counts) <= {"old", "new"}


def test_the_removed_model_is_retiring_not_callable_and_the_steady_route_does_not_ramp(tmp_path):
    clock = Clock()
    routing = swapped(tmp_path, clock)
    router = routing.router
    assert list(router.ramps) == ["chat"] and router.ramping() == ["chat"]
    assert [m.name for m in router.retiring] == ["old"]
    assert router.model("old").name == "old"  # its client is still found
    assert not router.knows("old") and router.knows("new")
    assert shares(router, "steady", 50) == {"other": 50}
    clock.now += 10.0
    assert router.ramping() == []


def test_a_second_reload_ramps_from_the_route_then_current(tmp_path):
    clock = Clock()
    routing = swapped(tmp_path, clock)
    clock.now += 20.0
    swap(routing, load_mesh_config(tmp_path / "new.yaml"), 10.0, clock.now)
    assert routing.router.ramps == {} and routing.router.retiring == ()
    assert shares(routing.router, "chat", 50) == {"new": 50}
