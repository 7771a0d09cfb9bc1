"""The simulator's parts on their own: the event loop, the cost model and its fit, the KV
pool, and one modelled worker stepping like the engine (chunked prefill under a token
budget, decode rows, prefix-cache hits), on a hand-made cost model with round figures."""

from __future__ import annotations

import random

import pytest

from loadtest.sim import cost_model
from loadtest.sim.cost_model import CostModel, StepCoefficients, attended_positions
from loadtest.sim.events import EventLoop
from loadtest.sim.fit import DecodeTiming, PrefillTiming, fit_steps
from loadtest.sim.kv import KVPool
from loadtest.sim.requests import SeqKind, SimRequest, SimSeq
from loadtest.sim.worker import MODEL, EngineLimits, SimWorker
from shared.engine.block_hash import hash_full_blocks
from shared.protocol import KVEvents

FIXED, PER_TOKEN = 0.01, 0.001


def round_cost(**changes: object) -> CostModel:
    """fixed 10 ms a step + 1 ms a prompt token; decode rows and attention free."""
    fields: dict[str, object] = {
        "name": "round",
        "source": "hand-made",
        "model": "none",
        "steps": {1: StepCoefficients(FIXED, PER_TOKEN, 0.0, 0.0, 0.0)},
        "block_bytes": 1000,
        "kv_blocks": 1000,
        "transfer_bytes_per_s": 1e6,
        "transfer_latency_s": 0.001,
        "control_latency_s": 0.002,
        "start_s": 5.0,
    }
    return CostModel(**(fields | changes))  # type: ignore[arg-type]


# -- event loop -------------------------------------------------------------------------------
def test_events_run_in_time_order_and_ties_in_scheduling_order() -> None:
    loop = EventLoop(seed=1)
    seen: list[tuple[float, str]] = []
    for name, when in (("c", 2.0), ("a", 1.0), ("b", 1.0), ("d", 5.0)):
        loop.at(when, lambda n=name: seen.append((loop.now, n)))
    loop.at(1.0, lambda: loop.after(0.5, lambda: seen.append((loop.now, "a+"))))
    loop.run(until=3.0)
    assert seen == [(1.0, "a"), (1.0, "b"), (1.5, "a+"), (2.0, "c")]
    loop.run(until=10.0)
    assert seen[-1] == (5.0, "d")


def test_event_loop_stops_when_done_says_so() -> None:
    loop = EventLoop(seed=0)
    count = []
    for i in range(10):
        loop.at(float(i), lambda: count.append(1))
    loop.run(until=100.0, done=lambda: len(count) == 3)
    assert len(count) == 3 and loop.now == 2.0


def test_same_seed_same_draws() -> None:
    assert [EventLoop(7).rng.random() for _ in range(2)] == [
        random.Random(7).random(),
        random.Random(7).random(),
    ]


# -- cost model -------------------------------------------------------------------------------
def test_prompt_chunks_cost_more_deeper_into_the_prompt() -> None:
    cost = cost_model.load("cpu-here")
    chunks = [cost.step_s(1, [(256, start)], []) for start in (0, 256, 512, 768)]
    assert chunks == sorted(chunks) and chunks[0] < chunks[-1]
    assert cost.step_s(2, [(256, 0)], []) < chunks[0]  # two cores are faster


def test_decode_step_grows_with_rows_and_context() -> None:
    cost = CostModel(
        "t", "s", "m", {1: StepCoefficients(0.01, 0.0, 0.0, 0.002, 1e-6)}, 1, 1, 1.0, 0, 0, 0
    )
    assert cost.step_s(1, [], [1000]) == pytest.approx(0.01 + 0.002 + 0.001)
    assert cost.step_s(1, [], [1000] * 4) == pytest.approx(0.01 + 0.008 + 0.004)


def test_a_size_not_listed_scales_the_nearest_smaller_one() -> None:
    cost = round_cost()
    four = cost.coefficients(4)
    assert four.fixed_s == FIXED and four.prefill_token_s == pytest.approx(PER_TOKEN / 4)


def test_attended_positions_counts_each_token_and_those_before_it() -> None:
    assert attended_positions(3, 0) == 1 + 2 + 3
    assert attended_positions(2, 10) == 11 + 12


def test_the_gpu_model_says_it_is_not_measured() -> None:
    gpu = cost_model.load("gpu-h100-published")
    assert "published figures, not measured" in gpu.source
    assert "published figures, not measured" in str(gpu.as_json())


def test_fit_recovers_the_coefficients_it_was_made_from() -> None:
    true = StepCoefficients(0.008, 0.0015, 2e-6, 0.0007, 1.5e-6)
    model = CostModel("t", "s", "m", {1: true}, 1, 1, 1.0, 0, 0, 0)
    decodes = [
        DecodeTiming(r, c, model.step_s(1, [], [c] * r)) for r in (1, 4, 16) for c in (128, 1024)
    ]
    chunks = [((256, s),) for s in (0, 512, 1024)] + [((128, 0), (256, 128))]
    prefills = [PrefillTiming(c, sum(model.step_s(1, [chunk], []) for chunk in c)) for c in chunks]
    fitted = fit_steps(prefills, decodes)
    for name in StepCoefficients.__slots__:
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=1e-6)


def test_fit_never_gives_a_negative_coefficient() -> None:
    decodes = [DecodeTiming(1, 100, 0.02), DecodeTiming(8, 100, 0.01)]  # more rows, faster
    fitted = fit_steps([], decodes)
    assert min(fitted.fixed_s, fitted.decode_row_s, fitted.decode_attn_s) >= 0


# -- KV pool ----------------------------------------------------------------------------------
def test_prefix_cache_lives_in_free_blocks_and_evicts_the_least_recent() -> None:
    pool = KVPool(4)
    pool.store([1, 2, 3])
    assert pool.overlap([1, 2, 9]) == 2  # 1 and 2 are now the newest uses
    pool.hold(2)  # room for two cached blocks: 3 goes first
    assert pool.drain_events() == ([1, 2, 3], [3])
    assert pool.overlap([1, 2]) == 2 and pool.free == 2
    assert not pool.can_hold(3)


# -- one worker -------------------------------------------------------------------------------
class Recorder:
    """A worker's sink that keeps what it hears."""

    def __init__(self) -> None:
        self.done: list[SimRequest] = []
        self.events: list[KVEvents] = []

    def prefilled(self, seq: SimSeq, worker: SimWorker) -> None:
        raise AssertionError("a local request is never handed on")

    def finished(self, request: SimRequest) -> None:
        self.done.append(request)

    def kv_events(self, events: KVEvents) -> None:
        self.events.append(events)

    def idle(self, worker: SimWorker) -> None:
        raise AssertionError("nothing drains here")


def make_request(name: str, tokens: list[int], output_len: int, send: float = 0.0) -> SimRequest:
    hashes = hash_full_blocks(tokens, 16, MODEL)
    return SimRequest(name, "t", tokens, hashes, output_len, send)


def test_a_worker_chunks_prompts_under_its_budget_then_decodes() -> None:
    loop, sink = EventLoop(0), Recorder()
    worker = SimWorker("w", "both", 1, loop, round_cost(), EngineLimits(16, 256, 64), sink)
    long, short = make_request("a", list(range(300)), 3), make_request("b", [7] * 100, 2)
    worker.add(long, SeqKind.LOCAL)
    worker.add(short, SeqKind.LOCAL)
    loop.run(until=10.0)
    first_step = FIXED + 256 * PER_TOKEN  # a's first 256 tokens; b waits for budget
    second_step = FIXED + (44 + 100) * PER_TOKEN  # the rest of a, then b whole
    assert long.first_token == pytest.approx(first_step + second_step)
    assert short.first_token == pytest.approx(first_step + second_step)
    # decode rows cost the fixed step alone here: a needs two more tokens, b one
    assert short.last_token == pytest.approx(first_step + second_step + FIXED)
    assert long.last_token == pytest.approx(first_step + second_step + 2 * FIXED)
    assert [r.request_id for r in sink.done] == ["b", "a"]
    assert worker.pool.held == 0 and sink.events[0].seq_no == 0


def test_a_cached_prefix_is_not_computed_again() -> None:
    loop, sink = EventLoop(0), Recorder()
    worker = SimWorker("w", "both", 1, loop, round_cost(), EngineLimits(16, 256, 64), sink)
    prefix = list(range(512))
    first = make_request("a", prefix + [1] * 64, 1)
    worker.add(first, SeqKind.LOCAL)
    loop.run(until=10.0)
    began = loop.now
    second = make_request("b", prefix + [2] * 64, 1, send=began)
    worker.add(second, SeqKind.LOCAL)
    loop.run(until=20.0)
    assert second.first_token - began == pytest.approx(FIXED + 64 * PER_TOKEN)
    assert first.first_token > 2 * (FIXED + 256 * PER_TOKEN)
