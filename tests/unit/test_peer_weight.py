"""The scheduler's prefix score weighs a block by where it is (issue 59): in the worker's
pool 1, in its second tier its measured load saving, in another worker's pool — with
--kv-peer-reads — its measured read saving. Placements are made from a registry fed
recorded heartbeats and KV events, as the scheduler's own is."""

from __future__ import annotations

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.measures import UNMEASURED_PEER_WEIGHT, peer_weight
from services.scheduler.peer_prefix import peer_prefix
from services.scheduler.registry import Registry
from services.scheduler.route_plan import plan_route
from shared.engine.block_hash import hash_full_blocks
from shared.prefix_messages import PeerHolder, PeerPrefix, PeerReadCounters
from shared.protocol import Heartbeat, KVEvents

PROMPT = list(range(100, 165))  # 4 full blocks of 16, then the token always computed
HASHES = hash_full_blocks(PROMPT, 16, "m")
RATE = 1000.0  # prompt tokens a second: a block recomputes in 16 ms
FAST = PeerReadCounters(blocks=10, seconds=0.004)  # 0.4 ms a block: worth 0.975
SLOW = PeerReadCounters(blocks=10, seconds=0.2)  # 20 ms a block: dearer than recomputing
ON = SchedulerConfig(model_id="m", load_penalty=1.0, kv_peer_reads=True)
OFF = SchedulerConfig(model_id="m", load_penalty=1.0, kv_peer_reads=False)


def beat(worker_id: str, running: int = 0, reads: PeerReadCounters | None = None) -> Heartbeat:
    return Heartbeat(
        worker_id, "both", "m", running, 0, 100, 100, 16,
        kv_transports=["nixl", "nats"], prefill_rate=RATE,
        kv_peer_reads=reads or PeerReadCounters(), epoch=ord(worker_id[0]),
    )  # fmt: skip


def registry(reads: PeerReadCounters, held: dict[str, int]) -> Registry:
    """Workers a (3 requests running), b and c (idle), whose reads cost `reads`; worker w's
    pool holds the prompt's first `held[w]` blocks, as its KV events said."""
    reg = Registry()
    reg.on_heartbeat(beat("a", running=3, reads=reads), now=0.0)
    reg.on_heartbeat(beat("b", reads=reads), now=0.0)
    reg.on_heartbeat(beat("c", reads=reads), now=0.0)
    for worker_id, count in held.items():
        reg.on_kv_events(KVEvents(worker_id, 1, stored=HASHES[:count]))
    return reg


def scores(reg: Registry, config: SchedulerConfig) -> list[tuple[str, int, int, float]]:
    plan = plan_route(reg.views(), PROMPT, "m", "", config)
    return [(c.worker_id, c.overlap, c.peer_blocks, round(c.score, 3)) for c in plan.decodes]


def test_blocks_another_worker_holds_count_by_the_measured_read_saving():
    reg = registry(FAST, {"a": 4})
    # a: 4 pool blocks - 3 load = 1; b and c: 4 blocks to read x 0.975 = 3.9, the rest a tie
    assert scores(reg, ON) == [("b", 0, 4, 3.9), ("c", 0, 4, 3.9), ("a", 4, 0, 1.0)]
    # without peer reads the busy holder still wins: nothing else holds the prefix
    assert scores(reg, OFF)[0] == ("a", 4, 0, 1.0)


def test_reads_dearer_than_recomputing_count_nothing():
    assert scores(registry(SLOW, {"a": 4}), ON)[0] == ("a", 4, 0, 1.0)


def test_only_the_blocks_past_a_workers_own_run_count_as_read():
    reg = registry(FAST, {"a": 4, "b": 1})
    ranked = {c[0]: c for c in scores(reg, ON)}
    assert ranked["b"] == ("b", 1, 3, round(1 + 3 * 0.975, 3))
    assert ranked["c"] == ("c", 0, 4, 3.9)


def test_the_hint_names_every_holder_longest_run_first():
    reg = registry(FAST, {"a": 4, "c": 2})
    hint = peer_prefix(reg.views(), HASHES, "b", 0, len(PROMPT), 16)
    assert hint == PeerPrefix("a", ord("a"), 0, 4, [PeerHolder("c", ord("c"), 2)])
    assert [(h.holder, h.num_blocks) for h in hint.holders()] == [("a", 4), ("c", 2)]
    # from a worker that holds 2 blocks, only a holds more
    assert peer_prefix(reg.views(), HASHES, "c", 2, len(PROMPT), 16) == PeerPrefix(
        "a", ord("a"), 2, 2
    )


def test_the_weight_comes_from_the_workers_own_reads():
    assert peer_weight(beat("a")) == UNMEASURED_PEER_WEIGHT  # no read yet
    assert peer_weight(beat("a", reads=FAST)) == pytest.approx(1.0 - 0.0004 / 0.016)
    assert peer_weight(beat("a", reads=SLOW)) == 0.0
