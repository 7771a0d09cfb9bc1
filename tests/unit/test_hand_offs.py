"""Failed KV hand-offs (services/scheduler/hand_offs.py, issue 60 case 5): a request whose
split attempt never got past the prefill's first token prefills where it decodes from then
on, and its pair is split over by no request for a while, while both its processes live;
the route plan keeps off what `Avoid` names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from services.scheduler.config import SchedulerConfig
from services.scheduler.hand_offs import Avoid, HandOffs, base_id
from services.scheduler.path_cost import Path, Rule
from services.scheduler.registry import Registry
from services.scheduler.route_plan import plan_route
from services.scheduler.routing import WorkerView
from shared.engine.sampling_params import SamplingParams
from shared.protocol import Heartbeat, SubmitRequest

PROMPT = list(range(100, 164))  # 4 blocks of 16: the cold rule splits it


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def beat(registry: Registry, worker_id: str, role: str, epoch: int) -> None:
    heartbeat = Heartbeat(worker_id, role, "m", 0, 0, 100, 200, 16)
    heartbeat.epoch = epoch
    registry.replaced(heartbeat)  # a newer process: the old one goes
    registry.on_heartbeat(heartbeat, 0.0)


def attempt(number: int, delivered: int, request_id: str = "r1") -> SubmitRequest:
    wire_id = f"{request_id}~{number}" if number else request_id
    request = SubmitRequest(wire_id, "gw", PROMPT, SamplingParams(), 2000.0, number)
    request.delivered_token_ids = list(range(delivered))
    return request


def book() -> tuple[HandOffs, Registry, Clock, CollectorRegistry]:
    registry, clock, metrics = Registry(), Clock(), CollectorRegistry()
    for worker_id, role in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode")):
        beat(registry, worker_id, role, epoch=1)
    counter = Counter("fallbacks", "test", ["reason"], registry=metrics)
    return HandOffs(registry, clock, counter), registry, clock, metrics


def test_the_base_id_drops_only_the_attempt_suffix() -> None:
    assert base_id(attempt(0, 0, "a~b")) == "a~b"
    assert base_id(attempt(2, 5, "a~1")) == "a~1"


def test_a_migrated_attempt_that_gained_at_most_the_first_token_keeps_off_the_link() -> None:
    hand_offs, _, _, _ = book()
    hand_offs.placed(attempt(0, 0), "p1", "d1")
    assert hand_offs.avoid(attempt(0, 0, "r2")) == Avoid()  # nothing failed yet
    first = hand_offs.avoid(attempt(1, 1))  # the prefill's first token, then nothing
    assert first.local and first.pairs == {("p1", "d1")}
    assert first.prefills("d1") == {"p1"} and first.prefills("d2") == frozenset()
    later = hand_offs.avoid(attempt(2, 1))  # and every later attempt of it
    assert later.local
    other = hand_offs.avoid(attempt(0, 0, "r2"))  # another request: only the pair
    assert not other.local and other.pairs == {("p1", "d1")}


def test_a_migration_after_the_decode_worker_streamed_is_no_failed_hand_off() -> None:
    hand_offs, _, _, _ = book()
    hand_offs.placed(attempt(0, 0), "p1", "d1")
    assert hand_offs.avoid(attempt(1, 7)) == Avoid()  # decode had streamed 6 more
    hand_offs.placed(attempt(1, 7), "p2", "d1")
    assert hand_offs.avoid(attempt(2, 8)) == Avoid(True, frozenset({("p2", "d1")}))


def test_a_pair_is_avoided_for_the_cool_off_and_only_while_its_processes_live() -> None:
    hand_offs, registry, clock, _ = book()
    hand_offs.placed(attempt(0, 0), "p1", "d1")
    hand_offs.avoid(attempt(1, 0))  # failed before even the first token
    assert hand_offs.avoid(attempt(0, 0, "r2")).pairs == {("p1", "d1")}
    beat(registry, "p1", "prefill", epoch=2)  # p1 restarted: a fresh end of the link
    assert hand_offs.avoid(attempt(0, 0, "r2")).pairs == frozenset()

    hand_offs.placed(attempt(0, 0, "r3"), "p1", "d1")
    hand_offs.avoid(attempt(1, 1, "r3"))
    assert hand_offs.avoid(attempt(0, 0, "r4")).pairs == {("p1", "d1")}
    clock.now += hand_offs.cooloff + 1
    assert hand_offs.avoid(attempt(0, 0, "r4")).pairs == frozenset()
    hand_offs.forget_older(3000.0)  # past every request's deadline (2000)
    assert not hand_offs.avoid(attempt(2, 1, "r3")).local


def test_the_route_plan_keeps_off_what_avoid_names_and_says_why() -> None:
    config = SchedulerConfig(model_id="m")
    views = [
        WorkerView("d1", "decode", False, 100, 0, set()),
        WorkerView("p1", "prefill", False, 100, 0, set()),
        WorkerView("p2", "prefill", False, 100, 0, set()),
    ]
    plan = plan_route(views, PROMPT, "m", "", config)
    decode = plan.decodes[0]
    usual = plan.choose(decode, config, 0.0)
    assert (usual.path, [p for p, _ in usual.prefills]) == (Path.SPLIT, ["p1", "p2"])
    one = plan.choose(decode, config, 0.0, Avoid(pairs=frozenset({("p1", "d1")})))
    assert (one.path, one.rule, [p for p, _ in one.prefills]) == (Path.SPLIT, Rule.COLD, ["p2"])
    both = plan.choose(decode, config, 0.0, Avoid(pairs=frozenset({("p1", "d1"), ("p2", "d1")})))
    assert (both.path, both.rule) == (Path.LOCAL, Rule.FAILED_PAIR)
    own = plan.choose(decode, config, 0.0, Avoid(local=True))
    assert (own.path, own.rule) == (Path.LOCAL, Rule.FAILED_HAND_OFF)
    short = plan_route(views, PROMPT[:10], "m", "", config)  # local anyway: no fallback
    kept = short.choose(short.decodes[0], config, 0.0, Avoid(local=True))
    assert (kept.path, kept.rule) == (Path.LOCAL, Rule.COLD)


def test_only_placements_kept_off_a_link_are_counted() -> None:
    hand_offs, _, _, metrics = book()
    for rule in (Rule.COLD, Rule.FAILED_HAND_OFF, Rule.FAILED_PAIR, Rule.FAILED_PAIR):
        hand_offs.count(rule)
    counts = [
        metrics.get_sample_value("fallbacks_total", {"reason": r}) for r in ("request", "pair")
    ]
    assert counts == [1, 2]


def carried(number: int, delivered: int, pair: tuple[str, str], before: int) -> SubmitRequest:
    """Attempt `number`, naming its previous attempt's split (as the gateway sends it)."""
    request = attempt(number, delivered)
    request.last_prefill, request.last_decode = pair
    request.last_delivered = before
    return request


def test_another_replica_judges_the_hand_off_from_what_the_attempt_names() -> None:
    """Replicas share the submits (a queue group), not their books: the replica that placed
    attempt 0 split is not the one attempt 1 reaches. That one judges the hand-off from the
    split the attempt names, keeps the request off every link from then on, and the pair
    for the cool-off; a replica that placed attempt 1 itself keeps its own record."""
    placer, _, _, _ = book()
    placer.placed(attempt(0, 0), "p1", "d1")
    other, _, _, _ = book()
    assert other.avoid(attempt(1, 1)) == Avoid()  # before: it knew of no split
    judged = other.avoid(carried(1, 1, ("p1", "d1"), 0))
    assert judged == Avoid(True, frozenset({("p1", "d1")}))
    assert other.avoid(attempt(0, 0, "r2")).pairs == {("p1", "d1")}

    fine, _, _, _ = book()
    assert fine.avoid(carried(1, 9, ("p1", "d1"), 0)) == Avoid()  # decode had streamed
    fine.placed(carried(1, 9, ("p1", "d1"), 0), "p2", "d1")
    own = fine.avoid(carried(2, 10, ("p2", "d1"), 9))
    assert own == Avoid(True, frozenset({("p2", "d1")}))
