"""One request's route without I/O (services/scheduler/route_plan.py): the candidates as
routing ranks them, why there is none, and the path per decode candidate — what the
scheduler's `Placer` and the simulator both run."""

from __future__ import annotations

from services.scheduler.config import SchedulerConfig
from services.scheduler.measures import Link, WorkerCosts
from services.scheduler.path_cost import Path, Rule
from services.scheduler.route_plan import plan_route
from services.scheduler.routing import WorkerView
from shared.engine.block_hash import hash_full_blocks

CONFIG = SchedulerConfig(model_id="m")
PROMPT = list(range(100, 164))  # 4 blocks of 16


def view(worker_id: str, role: str, free_blocks: int = 100, **more: object) -> WorkerView:
    cached = more.pop("cached", set())
    return WorkerView(worker_id, role, False, free_blocks, 0, cached, **more)  # type: ignore[arg-type]


def test_no_decode_worker_says_which_lack_it_is() -> None:
    plan = plan_route([view("p", "prefill")], PROMPT, "m", "", CONFIG)
    assert not plan.decodes and plan.no_room == "no worker for role decode"
    full = plan_route([view("d", "decode", free_blocks=2)], PROMPT, "m", "", CONFIG)
    assert full.no_room == "no decode worker with enough free KV blocks"
    named = plan_route([], PROMPT, "m", "tiny", CONFIG)
    assert named.no_room == "no worker of model tiny for role decode"


def test_candidates_are_ranked_and_hashed_with_the_model_id() -> None:
    hashes = hash_full_blocks(PROMPT, 16, "m")
    views = [
        view("d1", "decode"),
        view("d2", "decode", cached=set(hashes[:2])),
        view("p1", "prefill"),
        view("p2", "prefill", cached=set(hashes)),
    ]
    plan = plan_route(views, PROMPT, "m", "", CONFIG)
    assert plan.hashes == hashes and plan.num_tokens == 64
    assert [c.worker_id for c in plan.decodes] == ["d2", "d1"]
    assert list(plan.prefills) == ["p2", "p1"] and plan.prefills["p2"].overlap == 4


def test_the_path_is_chosen_per_decode_candidate() -> None:
    views = [view("d", "decode"), view("p", "prefill")]
    plan = plan_route(views, PROMPT, "m", "", CONFIG)
    cold = plan.choose(plan.decodes[0], CONFIG, reserve_rtt=0.0)
    assert (cold.path, cold.rule) == (Path.SPLIT, Rule.COLD)  # 64 uncached > 16
    assert [p for p, _ in cold.prefills] == ["p"]
    link = {"d": Link(per_byte=1e-9, latency=0.001)}
    busy_prefill = WorkerCosts(1000.0, queued_tokens=100_000, block_bytes=1, links=link)
    idle_decode = WorkerCosts(prefill_rate=1000.0, block_bytes=1)
    measured = [
        view("d", "decode", costs=idle_decode),
        view("p", "prefill", costs=busy_prefill),
    ]
    cost = SchedulerConfig(model_id="m", path_choice="cost")
    plan = plan_route(measured, PROMPT, "m", "", cost)
    choice = plan.choose(plan.decodes[0], cost, reserve_rtt=0.001)
    assert choice.path is Path.LOCAL  # the prefill worker's queue makes the split dearer
    assert choice.rule is Rule.COST and choice.predicted_ttft == 64 / 1000.0
