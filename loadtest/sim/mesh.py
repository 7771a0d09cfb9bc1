"""A simulated mesh: modelled workers (worker.py) placed on by the scheduler's own code.

The scheduler's side runs services/scheduler as the service does, minus NATS: a `Registry`
fed the workers' heartbeats (every `heartbeat_s`, each worker at its own seeded phase) and
KV events, `plan_route` ranking its views, `RoutePlan.choose` picking the path, then the
candidates asked in placement.py's order: local → the decode worker takes it unless it is
changing or draining; split → Reserve (refused without room) then the prefill candidates in
turn. A request nobody takes waits in a line, oldest first, retried when a heartbeat says a
worker has more room and every `sweep_interval`, until the scheduler's `queue_timeout`.
Each ask costs the cost model's `control_latency_s` before the worker sees the task; a
prefill worker's KV transfers go out one after another.

The one subtle rule: the registry hears of a worker only through heartbeats and KV events,
so placements see the same lagging picture the real scheduler sees.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from loadtest.sim.cost_model import CostModel
from loadtest.sim.events import EventLoop
from loadtest.sim.requests import SeqKind, SimRequest, SimSeq
from loadtest.sim.worker import EngineLimits, SimWorker
from services.planner.decision import Decision
from services.scheduler.config import SchedulerConfig
from services.scheduler.path_cost import Path
from services.scheduler.registry import Registry
from services.scheduler.route_plan import plan_route
from services.scheduler.routing import blocks_for
from shared.protocol import KVEvents


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    role: str
    cores: int = 1


@dataclass(frozen=True, slots=True)
class MeshSettings:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: EngineLimits = field(default_factory=EngineLimits)
    heartbeat_s: float = 1.0  # the workers' heartbeat interval
    request_timeout_s: float = 300.0  # a request not done by then failed (bench slo's)
    new_worker_cores: int = 1  # a worker the planner adds

    def __post_init__(self) -> None:  # a scheduler without --block-size: the workers' size
        if not self.scheduler.block_size:
            scheduler = replace(self.scheduler, block_size=self.limits.block_size)
            object.__setattr__(self, "scheduler", scheduler)


class SimMesh:
    def __init__(
        self, loop: EventLoop, cost: CostModel, specs: list[WorkerSpec], settings: MeshSettings
    ) -> None:
        self.loop, self.cost, self.settings = loop, cost, settings
        self.config = settings.scheduler
        self.registry = Registry(self.config.heartbeat_timeout)
        self.workers: dict[str, SimWorker] = {}
        self.gone: set[str] = set()  # drained: no more heartbeats
        self.line: deque[SimRequest] = deque()
        self.requests: list[SimRequest] = []
        self.ended: list[tuple[float, SimRequest]] = []  # (when, request), in order
        self.decisions: list[tuple[float, Decision]] = []
        self._link_free: dict[str, float] = {}  # prefill worker id → its sender is free
        self.open = 0  # requests submitted and not done
        for spec in specs:
            self.start_worker(spec.role, spec.cores, 0.0)
        loop.after(self.config.sweep_interval, self._sweep)

    # -- workers ----------------------------------------------------------------------------
    def start_worker(self, role: str, cores: int, delay: float) -> str:
        worker_id = f"w{len(self.workers):03d}"
        worker = SimWorker(worker_id, role, cores, self.loop, self.cost, self.settings.limits, self)
        self.workers[worker_id] = worker
        phase = self.loop.rng.uniform(0.0, self.settings.heartbeat_s)
        self.loop.after(delay, lambda: self._beat(worker))
        self.loop.after(delay + phase, lambda: self._beat_forever(worker))
        return worker_id

    def _beat(self, worker: SimWorker) -> None:
        if worker.worker_id in self.gone:
            return
        if self.registry.on_heartbeat(worker.heartbeat(), self.loop.now):
            self._retry()

    def _beat_forever(self, worker: SimWorker) -> None:
        self._beat(worker)
        if worker.worker_id not in self.gone:
            self.loop.after(self.settings.heartbeat_s, lambda: self._beat_forever(worker))

    def _sweep(self) -> None:
        self.registry.expire(self.loop.now)
        self._retry()
        self.loop.after(self.config.sweep_interval, self._sweep)

    # -- requests ---------------------------------------------------------------------------
    def submit(self, request: SimRequest) -> None:
        self.requests.append(request)
        self.open += 1
        if self.line or not self._place(request):
            self.line.append(request)

    def _retry(self) -> None:
        while self.line:
            request = self.line[0]
            if self.loop.now > request.send + self.config.queue_timeout:
                request.error = "http_503"
                self.open -= 1
                self.line.popleft()
                continue
            if not self._place(request):
                return
            self.line.popleft()

    def _place(self, request: SimRequest) -> bool:
        cfg, rtt = self.config, self.cost.control_latency_s
        views = self.registry.views()
        model_id = self.registry.model_id("", cfg.model_id)
        plan = plan_route(
            views, request.tokens, model_id, "", cfg, output_tokens=request.output_len
        )
        for decode in plan.decodes:
            choice = plan.choose(decode, cfg, rtt)
            worker = self.workers[decode.worker_id]
            if choice.path is Path.LOCAL:
                if not worker.takes_decode():
                    continue
                computed = max(1, plan.num_tokens - decode.overlap * cfg.block_size)
                self._assign(request, decode.worker_id, plan.num_tokens, computed)
                self.registry.expect_cached(decode.worker_id, plan.hashes)
                request.path = "local"
                self.loop.after(rtt, lambda w=worker: w.add(request, SeqKind.LOCAL))
                return True
            held = worker.reserve(request) if worker.takes_decode() else None
            if held is None:
                continue
            for prefill_id, _ in choice.prefills:
                prefill = self.workers[prefill_id]
                if not prefill.takes_prefill():
                    continue
                overlap = plan.prefills[prefill_id].overlap
                self._assign(request, decode.worker_id, plan.num_tokens)
                computed = max(1, plan.num_tokens - overlap * cfg.block_size)
                self._assign(request, prefill_id, 0, computed)
                self.registry.expect_cached(prefill_id, plan.hashes)
                request.path = "split"
                missing = blocks_for(plan.num_tokens, cfg.block_size) - held
                task = (request, SeqKind.PREFILL, decode.worker_id, missing)
                self.loop.after(2 * rtt, lambda p=prefill, t=task: p.add(*t))
                return True
            worker.cancel_reservation(request.request_id)
            return False
        return False

    def _assign(self, request: SimRequest, worker_id: str, tokens: int, computed: int = 0) -> None:
        deadline = request.send + self.settings.request_timeout_s
        self.registry.assign(worker_id, request.request_id, deadline, tokens, computed)

    # -- what workers report (loadtest/sim/worker.py: Sink) ---------------------------------
    def prefilled(self, seq: SimSeq, worker: SimWorker) -> None:
        seconds = self.cost.transfer_s(seq.missing_blocks)
        start = max(self.loop.now, self._link_free.get(worker.worker_id, 0.0))
        self._link_free[worker.worker_id] = start + seconds
        self.loop.at(start + seconds, lambda: self._moved(seq, worker, seconds))

    def _moved(self, seq: SimSeq, worker: SimWorker, seconds: float) -> None:
        worker.sent(seq, seconds)
        decode = self.workers[seq.decode_to]
        if seq.request.done:
            decode.cancel_reservation(seq.request.request_id)
            self.finished(seq.request)
        else:
            decode.kv_arrived(seq.request.request_id)

    def finished(self, request: SimRequest) -> None:
        self.registry.forget(request.request_id)
        self.ended.append((self.loop.now, request))
        self.open -= 1

    def kv_events(self, events: KVEvents) -> None:
        self.registry.on_kv_events(events)

    def idle(self, worker: SimWorker) -> None:
        self.gone.add(worker.worker_id)
