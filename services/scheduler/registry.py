"""Soft state about the workers, rebuilt from what they publish (a restarted scheduler
refills within one heartbeat interval).

- Heartbeats register a worker and refresh it, and say when it may have new room (the
  scheduler's waiting line tries again then). One silent for `heartbeat_timeout` (3 missed
  1 s beats) is only *suspect* (`silent`): never placed on, and probed (liveness.py); it is
  lost (`lose`, with the requests placed on it) only when the probe fails and no heartbeat
  came meanwhile, or comes back (`answered`) when it answers. `expire` (the simulator's)
  removes the silent at once.
- Each heartbeat names its worker process's epoch (shared/epoch.py): a newer epoch under a
  registered id is a restart, and the old process is lost (`replaced`) with the requests
  placed on it; a heartbeat of an older epoch than the registered one is ignored.
- KV events keep a set of cached block hashes per worker, and one of those in its second KV
  tier. They apply in seq order; anything but the next seq no. (a gap: events were lost, or
  a lower one: the worker restarted) clears both sets first, so they can under-report but
  never invent blocks.
- Each worker serves one model (its heartbeat's `model`, the served name): a request that
  names a model is placed only on that model's workers, and its blocks hash with that name,
  so prefix hashes never match across models.
- Placements are remembered per worker (request id → deadline) until a Cancel or the
  deadline, and counted as load (and their prompt tokens as queued work) until the worker's
  next heartbeat reports them.
- Measured costs (rates, step times, each pair's link: measures.py) are the latest
  heartbeat's; a view carries them for the path choice (path_cost.py).
- A placed prompt's full blocks count as cached at once on the worker that computes them
  (`expect_cached`), before its KV event says so: a request with the same prefix right
  behind it (the sibling choices of an `n` > 1 request) goes where the blocks will be.
- A worker changing its role (its heartbeat's `next_role`) is in the views as `changing`
  (never placed on); its heartbeats name its new role once the change is over. A sleeping
  one (its heartbeat's `sleep_level`) is in no view until its heartbeats say it woke up.
- LoRA: a view carries the adapters a worker serves and those in its slots, the latter
  with the adapters of requests placed on it since its heartbeat (`place_adapter`), so
  a burst of one adapter keeps to the worker that loaded it (routing.py).
- One engine and one block size per model: a worker whose heartbeat names another engine
  (native, vllm) or block size than the registered workers of its model (or than the
  scheduler's own `--block-size`, when given) is refused (never placed on; logged once),
  since the two cannot hand KV to each other nor share block hashes. Without a
  `--block-size` of its own the scheduler hashes a model's blocks with its workers' size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from services.scheduler.measures import Link, links_of, peer_weight, tier_weight, worker_costs
from services.scheduler.routing import WorkerView, blocks_for
from shared.protocol import Heartbeat, KVEvents, WorkerStatus

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerState:
    heartbeat: Heartbeat
    last_seen: float
    cached: set[int] = field(default_factory=set)
    in_tier: set[int] = field(default_factory=set)  # block hashes in its second KV tier
    kv_seq: int = -1  # last KV event seq no. applied; -1 before the first
    assigned: dict[str, float] = field(default_factory=dict)  # request id → deadline
    placed_since_heartbeat: int = 0
    blocks_since_heartbeat: int = 0
    tokens_since_heartbeat: int = 0  # prompt tokens placed on it to compute
    links: dict[str, Link] = field(default_factory=dict)  # decode id → measured link
    adapters_placed: set[str] = field(default_factory=set)  # LoRA, since its last heartbeat
    suspect: bool = False  # silent past the timeout, being probed: never placed on

    @property
    def epoch(self) -> int:
        return self.heartbeat.epoch


class Registry:
    def __init__(self, heartbeat_timeout: float = 3.0, block_size: int = 0) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.fixed_block_size = block_size  # the scheduler's --block-size; 0: its workers'
        self._workers: dict[str, WorkerState] = {}
        self.refused: dict[str, str] = {}  # worker id → why it is not registered

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def on_heartbeat(self, heartbeat: Heartbeat, now: float) -> bool:
        """Register or refresh a worker; True when it may have room it had not before (it
        joined, stopped draining, ended a role change, or reports more free blocks or fewer
        requests)."""
        state = self._workers.get(heartbeat.worker_id)
        if state is not None and heartbeat.epoch and heartbeat.epoch < state.epoch:
            return False  # a process older than the registered one: replaced already
        if state is None:
            if why := self._refusal(heartbeat):
                if heartbeat.worker_id not in self.refused:
                    log.error("worker %s refused: %s", heartbeat.worker_id, why)
                    self.refused[heartbeat.worker_id] = why
                return False
            self._workers[heartbeat.worker_id] = WorkerState(
                heartbeat, now, links=links_of(heartbeat)
            )
            return not heartbeat.draining
        old = state.heartbeat
        more_room = not heartbeat.draining and (
            old.draining
            or (bool(old.next_role) and not heartbeat.next_role)
            or (bool(old.sleep_level) and not heartbeat.sleep_level)
            or heartbeat.free_blocks > old.free_blocks
            or heartbeat.num_running + heartbeat.num_waiting < old.num_running + old.num_waiting
        )
        state.heartbeat = heartbeat
        state.last_seen = now
        state.suspect = False
        state.placed_since_heartbeat = 0
        state.blocks_since_heartbeat = 0
        state.tokens_since_heartbeat = 0
        state.adapters_placed.clear()
        state.links = links_of(heartbeat)
        return more_room

    def epoch(self, worker_id: str) -> int:
        """The registered process's epoch of `worker_id` (0: none registered)."""
        state = self._workers.get(worker_id)
        return state.epoch if state is not None else 0

    def replaced(self, heartbeat: Heartbeat) -> WorkerState | None:
        """Remove and return the registered process of `heartbeat.worker_id` when the
        heartbeat comes from a newer one (a restart under the same id); else None."""
        state = self._workers.get(heartbeat.worker_id)
        if state is None or not state.epoch or heartbeat.epoch <= state.epoch:
            return None
        return self._workers.pop(heartbeat.worker_id)

    def _refusal(self, heartbeat: Heartbeat) -> str:
        """Why a new worker cannot join its model's workers ("" when it can)."""
        same = self._same_model(heartbeat)
        engines = {s.heartbeat.engine for s in same}
        if engines and heartbeat.engine not in engines:
            return f"engine {heartbeat.engine}: {heartbeat.model} runs on {engines}"
        sizes = {s.heartbeat.block_size for s in same} | ({self.fixed_block_size} - {0})
        if sizes and heartbeat.block_size not in sizes:
            return f"blocks of {heartbeat.block_size} tokens: {heartbeat.model} hashes {sizes}"
        return ""

    def block_size(self, model: str, default: int) -> int:
        """The block size a request's blocks hash with: the scheduler's own when it was
        given one, else its model's workers' (any worker's for ""), else `default`."""
        if self.fixed_block_size:
            return self.fixed_block_size
        sizes = (
            s.heartbeat.block_size
            for s in self._workers.values()
            if model in ("", s.heartbeat.model)
        )
        return next(sizes, default)

    def _same_model(self, heartbeat: Heartbeat) -> list[WorkerState]:
        return [s for s in self._workers.values() if s.heartbeat.model == heartbeat.model]

    def on_kv_events(self, events: KVEvents) -> None:
        """Apply one KV event message; ignored for a worker not (yet) heard from."""
        state = self._workers.get(events.worker_id)
        if state is None:
            return
        if events.seq_no != state.kv_seq + 1:
            state.cached.clear()
            state.in_tier.clear()
        state.kv_seq = events.seq_no
        state.cached.difference_update(events.removed)
        state.cached.update(events.stored)
        state.in_tier.difference_update(events.tier_removed)
        state.in_tier.update(events.tier_stored)

    def touch_all(self, now: float) -> None:
        """After the scheduler's own NATS outage, its silence is not the workers' fault."""
        for state in self._workers.values():
            state.last_seen = max(state.last_seen, now)
            state.suspect = False  # a probe in flight meanwhile decides nothing

    def expire(self, now: float) -> list[WorkerState]:
        """Remove and return the workers silent for longer than `heartbeat_timeout`."""
        lost = [s for s in self._workers.values() if now - s.last_seen > self.heartbeat_timeout]
        for state in lost:
            del self._workers[state.heartbeat.worker_id]
        return lost

    def silent(self, now: float) -> list[WorkerState]:
        """The workers silent for longer than `heartbeat_timeout` and not suspect yet: each
        is suspect from now on (to be probed)."""
        silent = [
            s
            for s in self._workers.values()
            if not s.suspect and now - s.last_seen > self.heartbeat_timeout
        ]
        for state in silent:
            state.suspect = True
        return silent

    def answered(self, worker_id: str, epoch: int, now: float) -> None:
        """The process `epoch` of `worker_id` answered a probe: alive, no longer suspect."""
        state = self._workers.get(worker_id)
        if state is not None and state.epoch == epoch:
            state.last_seen = max(state.last_seen, now)
            state.suspect = False

    def recheck(self, worker_id: str) -> None:
        """No verdict on a suspect (the scheduler's own connection failed): the next sweep
        probes it again if it is still silent."""
        state = self._workers.get(worker_id)
        if state is not None:
            state.suspect = False

    def lose(self, worker_id: str, epoch: int) -> WorkerState | None:
        """Remove and return process `epoch` of `worker_id` if it is still registered and
        still silent (no heartbeat came while it was probed); else None."""
        state = self._workers.get(worker_id)
        if state is None or state.epoch != epoch or not state.suspect:
            return None
        return self._workers.pop(worker_id)

    def assign(
        self,
        worker_id: str,
        request_id: str,
        deadline: float,
        num_tokens: int = 0,
        prompt_tokens: int = 0,
    ) -> None:
        """`num_tokens` take its blocks; it computes `prompt_tokens` of them."""
        state = self._workers.get(worker_id)
        if state is None:
            return
        state.assigned[request_id] = deadline
        state.placed_since_heartbeat += 1
        state.blocks_since_heartbeat += blocks_for(num_tokens, state.heartbeat.block_size or 1)
        state.tokens_since_heartbeat += prompt_tokens

    def expect_cached(self, worker_id: str, block_hashes: list[int]) -> None:
        """`worker_id` is computing (or receiving) these blocks; the next gap in its KV
        events clears the guess with everything else if it never comes true."""
        state = self._workers.get(worker_id)
        if state is not None:
            state.cached.update(block_hashes)

    def place_adapter(self, worker_id: str, adapter: str) -> bool:
        """A request of LoRA `adapter` was placed on the worker: it has the adapter in a slot
        from now on (until its next heartbeat says). Whether it had before (affinity)."""
        state = self._workers.get(worker_id)
        if state is None:
            return False
        loaded = adapter in state.heartbeat.adapters_loaded or adapter in state.adapters_placed
        state.adapters_placed.add(adapter)
        return loaded

    def forget(self, request_id: str) -> None:
        for state in self._workers.values():
            state.assigned.pop(request_id, None)

    def forget_past_deadline(self, now: float) -> None:
        for state in self._workers.values():
            for request_id in [r for r, deadline in state.assigned.items() if deadline < now]:
                del state.assigned[request_id]

    def model_id(self, model: str, default: str) -> str:
        """The model id a request's blocks hash with: its own model's name (the workers of a
        served model hash with it), or for a request of any model (""), the first worker's."""
        if model:
            return model
        return next((s.heartbeat.model for s in self._workers.values()), default)

    def serves(self, model: str) -> bool:
        """Some worker of `model` ("": of any model) is registered and not draining."""
        return any(
            not s.heartbeat.draining and model in ("", s.heartbeat.model)
            for s in self._workers.values()
        )

    def views(self, model: str = "") -> list[WorkerView]:
        """The workers of `model` ("": every worker) that are awake: a sleeping one is no
        candidate (a request waits in line until one wakes up)."""
        return [
            WorkerView(
                worker_id=worker_id,
                role=s.heartbeat.role,
                draining=s.heartbeat.draining,
                free_blocks=max(0, s.heartbeat.free_blocks - s.blocks_since_heartbeat),
                load=s.heartbeat.num_running + s.heartbeat.num_waiting + s.placed_since_heartbeat,
                cached=s.cached,
                costs=worker_costs(
                    s.heartbeat, s.links, s.placed_since_heartbeat, s.tokens_since_heartbeat
                ),
                changing=bool(s.heartbeat.next_role),
                adapters=frozenset(s.heartbeat.adapters),
                adapters_loaded=frozenset(s.heartbeat.adapters_loaded) | s.adapters_placed,
                in_tier=s.in_tier,
                tier_weight=tier_weight(s.heartbeat),
                peer_weight=peer_weight(s.heartbeat),
                epoch=s.heartbeat.epoch,
                transports=tuple(s.heartbeat.kv_transports),
            )
            for worker_id, s in self._workers.items()
            if model in ("", s.heartbeat.model) and not s.suspect and not s.heartbeat.sleep_level
        ]

    def status(self) -> list[WorkerStatus]:
        return [
            WorkerStatus(s.heartbeat, s.last_seen, sorted(s.assigned))
            for _, s in sorted(self._workers.items())
        ]
