"""The path chosen per request (services/scheduler/path_cost.py), on heartbeats as workers
send them, folded by the registry: a loaded decode worker splits, a prefix cached on the
decode worker stays local, a slow link stays local, a cold mesh follows the fixed rule.

The figures are of the order this 2-core machine measures for the default model: a prompt
computed at ~2600 tokens/s (1024 tokens in ~0.4 s), decode steps of ~15-60 ms, KV blocks of
~0.6 MB moved at ~2 GB/s with a few ms of fixed cost.
"""

from __future__ import annotations

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.measures import WorkerCosts
from services.scheduler.path_cost import (
    Choice,
    CostParams,
    Offer,
    Path,
    Rule,
    Typical,
    choose,
    transfer_s,
)
from services.scheduler.path_slo import Objectives
from services.scheduler.registry import Registry
from shared.errors import ConfigError
from shared.protocol import Heartbeat, KVPeer

BS = 16
RATE = 2600.0  # prompt tokens per second
BLOCK_BYTES = 614_400  # one block, every layer
FAST = KVPeer("d1", "nixl", 640, 10, mean_bytes=64 * BLOCK_BYTES, mean_seconds=0.023, latency=0.003)
PROMPT = 1024


def decode_beat(
    running: int = 0,
    rate: float = RATE,
    step_s: float = 0.015,
    stall_s: float = 0.0,
    stream_tokens: int = 0,
) -> Heartbeat:
    return Heartbeat(
        "d1", "decode", "m", running, 0, 900, 1000, BS,
        prefill_rate=rate, decode_step_s=step_s, decode_batch=float(running),
        block_bytes=BLOCK_BYTES, stall_s=stall_s, stream_tokens=stream_tokens,
    )  # fmt: skip


def prefill_beat(
    worker_id: str = "p1", rate: float = RATE, peer: KVPeer | None = FAST, queued: int = 0
) -> Heartbeat:
    return Heartbeat(
        worker_id, "prefill", "m", 0, 0, 900, 1000, BS,
        prefill_rate=rate, queued_prompt_tokens=queued, block_bytes=BLOCK_BYTES,
        kv_peers=[peer] if peer else [],
    )  # fmt: skip


def decide(
    beats: list[Heartbeat],
    num_tokens: int = PROMPT,
    overlaps: dict[str, int] | None = None,
    **params: object,
) -> Choice:
    """As the placer does: views from the registry, the decode worker d1, prefill workers in
    the order given."""
    registry = Registry()
    for beat in beats:
        registry.on_heartbeat(beat, now=0.0)
    views = {v.worker_id: v for v in registry.views()}
    overlaps = overlaps or {}

    def offer(worker_id: str) -> Offer:
        return Offer(worker_id, overlaps.get(worker_id, 0), views[worker_id].costs)

    prefills = [offer(b.worker_id) for b in beats if b.role == "prefill"]
    settings = dict(block_size=BS, local_prefill_tokens=16, stall_weight=0.1, reserve_rtt=0.002)
    cost = CostParams(**(settings | params))  # type: ignore[arg-type]
    typical = Typical.of([v.costs for v in views.values()])
    return choose(num_tokens, offer("d1"), prefills, typical, cost)


def test_a_decode_worker_full_of_streams_splits():
    choice = decide([decode_beat(running=40, step_s=0.06), prefill_beat()])
    assert (choice.path, choice.rule) == (Path.SPLIT, Rule.COST)
    assert [worker for worker, _ in choice.prefills] == ["p1"]


def test_an_idle_decode_worker_with_a_fast_link_has_no_stall_to_avoid():
    # Nothing runs on d1: the local prefill costs its TTFT only, and that is below the split's
    # (which adds the reservation round trip and the transfer).
    choice = decide([decode_beat(running=0), prefill_beat()])
    assert (choice.path, choice.rule) == (Path.LOCAL, Rule.COST)


def test_a_prefix_cached_on_the_decode_worker_stays_local():
    # 60 of 64 blocks are on d1: 64 tokens to compute there, 1024 on p1.
    beats = [decode_beat(running=8), prefill_beat()]
    assert decide(beats).path is Path.SPLIT
    choice = decide(beats, overlaps={"d1": 60})
    assert (choice.path, choice.rule) == (Path.LOCAL, Rule.COST)


def test_a_slow_link_stays_local():
    beats = [decode_beat(running=8), prefill_beat()]
    assert decide(beats).path is Path.SPLIT
    slow = KVPeer("d1", "nats", 640, 10, mean_bytes=64 * BLOCK_BYTES, mean_seconds=4.0)
    choice = decide([decode_beat(running=8), prefill_beat(peer=slow)])
    assert (choice.path, choice.rule) == (Path.LOCAL, Rule.COST)


def test_a_cold_mesh_follows_the_fixed_rule():
    cold = [decode_beat(rate=0.0, step_s=0.0), prefill_beat(rate=0.0, peer=None)]
    long, short = decide(cold, num_tokens=17), decide(cold, num_tokens=16)
    assert (long.path, long.rule, long.predicted_ttft) == (Path.SPLIT, Rule.COLD, 0.0)
    assert (short.path, short.rule, short.predicted_ttft) == (Path.LOCAL, Rule.COLD, 0.0)
    # rates measured, but no pair has moved KV yet: still the fixed rule
    no_link = [decode_beat(running=40), prefill_beat(peer=None)]
    assert decide(no_link).rule is Rule.COLD


def test_the_fixed_policy_ignores_measurements():
    beats = [decode_beat(running=0), prefill_beat()]
    assert decide(beats).path is Path.LOCAL
    choice = decide(beats, fixed=True)
    assert (choice.path, choice.rule) == (Path.SPLIT, Rule.COLD)


def test_no_prefill_worker_is_local():
    choice = decide([decode_beat(running=40)])
    assert (choice.path, choice.rule) == (Path.LOCAL, Rule.NO_PREFILL)
    assert choice.predicted_ttft == pytest.approx(PROMPT / RATE + 0.015)


def test_an_unmeasured_decode_worker_borrows_the_mesh_rate():
    # d1 has never prefilled (every prompt went split): it borrows p1's rate.
    choice = decide([decode_beat(running=0, rate=0.0), prefill_beat()])
    assert choice.rule is Rule.COST
    assert choice.path is Path.LOCAL


def test_split_offers_are_tried_cheapest_first_with_their_predictions():
    beats = [
        decode_beat(running=40),
        prefill_beat("p1", queued=5000),
        prefill_beat("p2", peer=KVPeer("d1", "nixl", 640, 10, 64 * BLOCK_BYTES, 0.023, 0.003)),
    ]
    choice = decide(beats)
    assert choice.path is Path.SPLIT
    assert [worker for worker, _ in choice.prefills] == ["p2", "p1"]
    rtt = 0.002
    assert dict(choice.prefills) == pytest.approx(
        {"p2": rtt + PROMPT / RATE, "p1": rtt + (5000 + PROMPT) / RATE}
    )
    assert choice.predicted_ttft == choice.prefills[0][1]


def test_the_transfer_moves_only_the_blocks_decode_lacks():
    registry = Registry()
    registry.on_heartbeat(prefill_beat(), now=0.0)
    link = registry.views()[0].costs.links["d1"]
    decode = Offer("d1", 60, WorkerCosts())
    assert transfer_s(PROMPT, decode, link, BLOCK_BYTES, BS) == pytest.approx(
        link.latency + 4 * BLOCK_BYTES * link.per_byte
    )


def test_scheduler_path_flags_are_checked():
    with pytest.raises(ConfigError, match="path_choice"):
        SchedulerConfig(path_choice="sometimes")
    with pytest.raises(ConfigError, match="stall_weight"):
        SchedulerConfig(stall_weight=-1.0)


# --path-choice slo (path_slo.py). Figures: a 1024-token prompt is ~0.39 s at RATE, so its
# local prefill adds 0.39 / 63 = 6.2 ms to the TPOT of a running 64-token stream.
SLO = Objectives(ttft_s=1.0, tpot_s=0.040, stream_tokens=64)


def test_slo_prefills_locally_when_the_split_would_miss_the_ttft():
    # p1 is 2000 tokens behind (~1.2 s): only the local path keeps the 1 s TTFT.
    beats = [decode_beat(running=30, step_s=0.030), prefill_beat(queued=2000)]
    assert decide(beats).path is Path.SPLIT  # the cost rule weighs the stall more
    assert decide(beats, objectives=SLO).path is Path.LOCAL


def test_slo_splits_when_the_stall_would_break_the_streams_tpot():
    # Neither path keeps both objectives, and the streams running need not be late too.
    # Streams that took 1.5 s of stalls lately: 30 + (1500 + 390) / 63 ms > 40 ...
    stalled = [decode_beat(running=4, step_s=0.030, stall_s=1.5), prefill_beat(queued=5000)]
    assert decide(stalled, objectives=SLO).path is Path.SPLIT
    # ... or a running stream of 16 tokens: 30 + 390 / 16 ms > 40
    short = [decode_beat(running=4, step_s=0.030, stream_tokens=16), prefill_beat(queued=5000)]
    assert decide(short, objectives=SLO).path is Path.SPLIT


def test_slo_paths_that_both_keep_the_objectives_are_left_to_the_cost_rule():
    # 40 streams absorb the stall (30 + 6.2 ms <= 40) and p1 keeps the TTFT: the cost rule
    # splits; with nothing running it stays local, objectives or not.
    busy = [decode_beat(running=40, step_s=0.030), prefill_beat()]
    assert decide(busy, objectives=SLO).path is decide(busy).path is Path.SPLIT
    idle = [decode_beat(running=0), prefill_beat()]
    assert decide(idle, objectives=SLO).path is decide(idle).path is Path.LOCAL


def test_the_default_path_choice_keeps_the_objectives_when_given_else_the_fixed_rule():
    assert SchedulerConfig().path_choice == "fixed"
    given = SchedulerConfig(path_slo="ttft=4s,tpot=50ms")
    assert (given.path_choice, given.objectives) == ("slo", (4.0, 0.05))
    with pytest.raises(ConfigError, match="--path-slo"):
        SchedulerConfig(path_slo="ttft=4s")


def test_slo_path_choice_needs_its_objectives():
    with pytest.raises(ConfigError, match="--path-slo"):
        SchedulerConfig(path_choice="slo")
    with pytest.raises(ConfigError, match="--path-slo"):
        SchedulerConfig(path_choice="slo", path_slo="ttft=1s")
    config = SchedulerConfig(path_choice="slo", path_slo="ttft=2,tpot=50ms")
    assert config.objectives == pytest.approx((2.0, 0.05))
    assert SchedulerConfig().objectives == (0.0, 0.0)
