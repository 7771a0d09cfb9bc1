"""Where one request may go, decided without I/O: the ranked decode candidates, the ranked
prefill candidates, and for each decode candidate the path by cost (path_cost.py).

The scheduler's `Placer` asks the workers in this order over NATS; the simulator
(loadtest/sim) asks its modelled workers in the same order, so both run this code.

The one subtle rule: the path is chosen per decode candidate, when that candidate's turn
comes (`RoutePlan.choose`), not for all of them up front: the Reserve round trip measured
while earlier candidates were asked feeds the later choices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from services.scheduler.config import SchedulerConfig
from services.scheduler.hand_offs import NOTHING, Avoid
from services.scheduler.measures import WorkerCosts
from services.scheduler.path_cost import Choice, CostParams, Offer, Path, Rule, Typical, choose
from services.scheduler.path_slo import Objectives
from services.scheduler.peer_prefix import peer_runs, usable_blocks
from services.scheduler.routing import (
    DECODE_ROLES,
    Candidate,
    WorkerView,
    rank_decode,
    rank_prefill,
)
from shared.engine.block_hash import cache_key, hash_full_blocks
from shared.engine.engine_config import NATIVE_BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """One request's candidates, best first, as routing ranked them."""

    num_tokens: int  # prompt + delivered: all that needs KV
    block_size: int  # tokens per block of its model's workers: what its hashes cover
    hashes: list[int]  # its full blocks' chained hashes
    decodes: list[Candidate]
    prefills: dict[str, Candidate]  # by worker id, in ranked order
    costs: dict[str, WorkerCosts]  # every view's measured costs, by worker id
    no_room: str  # why there is no decode candidate ("" when there is one)
    output_tokens: int = 0  # the request's max_tokens (path_slo.py: a stream's length)

    def choose(
        self,
        decode: Candidate,
        config: SchedulerConfig,
        reserve_rtt: float,
        avoid: Avoid = NOTHING,
    ) -> Choice:
        """The path on `decode` (path_cost.choose over the prefill candidates), kept off the
        KV links `avoid` names (hand_offs.py): with none left to split over, local."""
        ttft_slo, tpot_slo = config.objectives
        params = CostParams(
            self.block_size,
            config.local_prefill_tokens,
            config.stall_weight,
            reserve_rtt,
            fixed=config.path_choice == "fixed",
            objectives=Objectives(ttft_slo, tpot_slo, self.output_tokens),
        )
        offers = [
            Offer(c.worker_id, c.overlap, self.costs[c.worker_id]) for c in self.prefills.values()
        ]
        here = Offer(decode.worker_id, decode.overlap, self.costs[decode.worker_id])
        typical = Typical.of(list(self.costs.values()))
        choice = choose(self.num_tokens, here, offers, typical, params)
        avoided = avoid.prefills(decode.worker_id)
        if choice.path is Path.LOCAL or not (avoid.local or avoided):
            return choice
        kept = [o for o in offers if not avoid.local and o.worker_id not in avoided]
        if kept:  # the split, over the pairs that did not fail
            return choose(self.num_tokens, here, kept, typical, params)
        rule = Rule.FAILED_HAND_OFF if avoid.local else Rule.FAILED_PAIR
        return dataclasses.replace(choose(self.num_tokens, here, [], typical, params), rule=rule)


def plan_route(
    views: Sequence[WorkerView],
    tokens: list[int],
    model_id: str,
    model: str,
    config: SchedulerConfig,
    adapter: str = "",
    output_tokens: int = 0,
    block_size: int = 0,
) -> RoutePlan:
    """Rank `views` (the workers of the request's `model`) for a request of `tokens` whose
    blocks hash with `model_id` (and its LoRA `adapter`: shared/engine/block_hash.py) in
    blocks of `block_size` tokens (0: the scheduler's `--block-size`, or the native
    engine's when that is 0 too), that emits at most `output_tokens`."""
    block_size = block_size or config.block_size or NATIVE_BLOCK_SIZE
    hashes = hash_full_blocks(tokens, block_size, cache_key(model_id, adapter))
    lora = adapter, config.lora_affinity
    penalty = config.load_penalty
    usable = usable_blocks(hashes, len(tokens), block_size)
    peers = peer_runs(views, usable) if config.kv_peer_reads else {}  # weighed: routing.py
    decodes = rank_decode(views, hashes, len(tokens), block_size, penalty, *lora, peers)
    no_room = ""
    if not decodes:
        has_decode = any(
            v.role in DECODE_ROLES and not v.draining and v.takes(adapter) for v in views
        )
        of_model = f" of model {model}" if model else ""
        of_model += f" with adapter {adapter}" if adapter else ""
        no_room = (
            "no decode worker with enough free KV blocks"
            if has_decode
            else f"no worker{of_model} for role decode"
        )
    prefills = {c.worker_id: c for c in rank_prefill(views, hashes, penalty, *lora, peers)}
    costs = {view.worker_id: view.costs for view in views}
    return RoutePlan(
        len(tokens), block_size, hashes, decodes, prefills, costs, no_room, output_tokens
    )
