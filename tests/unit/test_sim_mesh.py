"""The simulated mesh: the scheduler's own registry and routing place requests on modelled
workers (split and local paths, the line when no worker has room), a scripted planner's
decisions take effect, and a run is a function of its seed, bit for bit."""

from __future__ import annotations

import pytest

from loadtest.sim.config import SimBenchConfig, parse_workers
from loadtest.sim.cost_model import CostModel, StepCoefficients
from loadtest.sim.events import EventLoop
from loadtest.sim.mesh import MeshSettings, SimMesh, WorkerSpec
from loadtest.sim.planner_hook import apply, mesh_signals, plan_forever
from loadtest.sim.requests import SimRequest
from loadtest.sim.run import run_point, simulate
from loadtest.sim.worker import MODEL
from loadtest.slo.attainment import Slo
from loadtest.slo.config import SloBenchConfig
from loadtest.slo.workloads import WorkloadSpec, workload_requests
from services.planner.decision import Action, Decision, Reason
from services.planner.signals import MeshSignals
from services.scheduler.config import SchedulerConfig
from shared.engine.block_hash import hash_full_blocks

FIXED, PER_TOKEN, RTT = 0.01, 0.001, 0.002


def round_cost(kv_blocks: int = 1000) -> CostModel:
    steps = {1: StepCoefficients(FIXED, PER_TOKEN, 0.0, 0.0, 0.0)}
    return CostModel("round", "hand-made", "none", steps, 1000, kv_blocks, 1e6, 0.001, RTT, 5.0)


def settings(**scheduler: object) -> MeshSettings:
    return MeshSettings(SchedulerConfig(model_id=MODEL, **scheduler))  # type: ignore[arg-type]


def mesh_of(roles: list[str], cost: CostModel | None = None, **scheduler: object) -> SimMesh:
    specs = [WorkerSpec(role) for role in roles]
    return SimMesh(EventLoop(0), cost or round_cost(), specs, settings(**scheduler))


def send(mesh: SimMesh, name: str, tokens: list[int], output_len: int, at: float) -> SimRequest:
    request = SimRequest(name, "t", tokens, hash_full_blocks(tokens, 16, MODEL), output_len, at)
    mesh.loop.at(at, lambda: mesh.submit(request))
    return request


def test_a_long_prompt_is_split_and_its_kv_moves_before_decode() -> None:
    mesh = mesh_of(["prefill", "decode"])
    request = send(mesh, "r", list(range(256)), 3, at=0.5)
    mesh.loop.run(until=10.0, done=lambda: request.done)
    assert request.path == "split" and not request.error
    # Reserve + PrefillTask round trips, then one prompt step on the prefill worker
    assert request.first_token - request.send == pytest.approx(2 * RTT + FIXED + 256 * PER_TOKEN)
    moved = 0.001 + 16 * 1000 / 1e6  # 16 blocks over the link
    assert request.last_token == pytest.approx(request.first_token + moved + 2 * FIXED)
    prefill, decode = mesh.workers["w000"], mesh.workers["w001"]
    assert prefill.peers["w001"].blocks == 16 and decode.pool.held == prefill.pool.held == 0


def test_a_short_prompt_stays_on_its_decode_worker() -> None:
    mesh = mesh_of(["prefill", "decode"])
    request = send(mesh, "r", list(range(10)), 2, at=0.5)
    mesh.loop.run(until=10.0, done=lambda: request.done)
    assert request.path == "local"
    assert request.first_token - request.send == pytest.approx(RTT + FIXED + 10 * PER_TOKEN)


def test_requests_wait_for_room_in_arrival_order() -> None:
    mesh = mesh_of(["both"], cost=round_cost(kv_blocks=20))  # room for one request at a time
    first = send(mesh, "a", list(range(200)), 50, at=0.5)
    second = send(mesh, "b", list(range(1000, 1200)), 50, at=0.6)
    mesh.loop.run(until=60.0, done=lambda: first.done and second.done)
    assert not (first.error or second.error)
    assert second.first_token > first.last_token  # placed once the first freed its blocks


def test_the_registry_hears_workers_only_through_heartbeats() -> None:
    mesh = mesh_of(["prefill", "decode"])
    assert len(mesh.registry) == 0
    mesh.loop.run(until=0.0)
    assert len(mesh.registry) == 2


class Scripted:
    """Decides `script[i]` at its i-th call (nothing after), keeping what it was shown."""

    def __init__(self, script: list[list[Decision]]) -> None:
        self.script = script
        self.seen: list[MeshSignals] = []

    def decide(self, signals: MeshSignals) -> list[Decision]:
        self.seen.append(signals)
        return self.script.pop(0) if self.script else []


def test_a_scripted_planner_changes_a_role_adds_and_drains_workers() -> None:
    mesh = mesh_of(["prefill", "decode", "decode"])
    busy = send(mesh, "r", list(range(256)), 400, at=0.5)  # split: decodes on w001 or w002
    decider = Scripted(
        [
            [
                Decision(Action.SET_ROLE, Reason.TTFT_OVER_SLO, "decode", "w000"),
                Decision(Action.ADD, Reason.TPOT_OVER_SLO, "prefill"),
            ],
            [Decision(Action.DRAIN, Reason.DECODE_IDLE, "decode", "w002")],
        ]
    )
    plan_forever(mesh, decider, interval_s=1.0, window_s=1.0)
    mesh.loop.run(until=12.0)
    assert [w.role for w in mesh.workers.values()] == ["decode", "decode", "decode", "prefill"]
    assert "w003" in mesh.registry  # started after the cost model's start_s
    assert "w002" in mesh.gone and "w002" not in mesh.registry
    assert len(mesh.decisions) == 3 and not busy.error
    first = decider.seen[0]
    assert [w.worker_id for w in first.workers] == ["w000", "w001", "w002"]
    assert first.ttft_samples == 1 and first.ttft_p99 == pytest.approx(busy.first_token - 0.5)


def test_a_role_change_waits_for_what_the_dropped_side_holds() -> None:
    mesh = mesh_of(["prefill", "decode"])
    request = send(mesh, "r", list(range(1024)), 2, at=0.5)
    mesh.loop.run(until=0.6)  # the prompt is being computed on w000
    assert apply(mesh, Decision(Action.SET_ROLE, Reason.PREFILL_IDLE, "decode", "w000"))
    prefill = mesh.workers["w000"]
    assert prefill.next_role == "decode" and prefill.role == "prefill"
    signal = mesh_signals(mesh, 1.0).workers[0]
    assert (signal.role, signal.next_role) == ("prefill", "decode")
    mesh.loop.run(until=20.0, done=lambda: request.done)
    assert request.path == "split" and not request.error
    assert prefill.role == "decode" and not prefill.next_role


def test_a_decision_on_a_worker_that_is_not_there_is_skipped() -> None:
    mesh = mesh_of(["both"])
    assert not apply(mesh, Decision(Action.DRAIN, Reason.DECODE_IDLE, "both", "w999"))
    assert mesh.decisions and len(mesh.workers) == 1


def _bench(configs: str, workload: str, rate: float) -> SimBenchConfig:
    bench = SloBenchConfig(
        configs=parse_workers(configs),
        slo=Slo(2.0, 0.05),
        workloads=(workload,),
        rates=(rate,),
        num_prompts=24,
        long_len=512,
    )
    return SimBenchConfig(bench, round_cost(), settings(), vocab_size=500)


@pytest.mark.parametrize("workload", ["chat", "agent", "mixed", "mooncake"])
def test_a_run_is_the_same_bit_for_bit_for_a_seed(workload: str, tmp_path) -> None:
    cfg = _bench("prefill:2,decode:2", workload, 3.0)
    row = cfg.bench.configs[0]
    first = run_point(cfg, row, workload, 0, tmp_path).point
    again = run_point(cfg, row, workload, 0, tmp_path).point
    assert first == again  # every figure and every request's latencies
    assert first.completed == first.requests == 24


def test_simulate_replays_the_same_requests_the_same_way() -> None:
    cfg = _bench("prefill:1,decode:1", "chat", 2.0)
    requests = workload_requests("chat", WorkloadSpec(12, 500), 2.0, 5)
    offsets = [0.5 * i for i in range(len(requests))]
    specs = [WorkerSpec("prefill"), WorkerSpec("decode")]
    one = simulate(cfg, specs, requests, offsets, seed=1)
    same = simulate(cfg, specs, requests, offsets, seed=1)
    assert one.run.records == same.run.records and one.mesh.loop.handled == same.mesh.loop.handled
    assert all(r.ok for r in one.run.records)
