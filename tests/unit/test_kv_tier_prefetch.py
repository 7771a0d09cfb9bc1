"""Tier loads overlapped with the step (shared/engine/kv_tier/prefetch.py): a request whose
prefix is in the second tier waits while its entries are read beside the running steps,
then joins with the same logits bit for bit; past its deadline it recomputes instead."""

from __future__ import annotations

import threading
import time

import torch

from shared.engine.engine import LLMEngine
from shared.engine.kv_tier.prefetch import FetchState, TierPrefetch
from shared.engine.sampling_params import SamplingParams
from tests.engine_harness import LogitsRecorder, run_to_completion
from tests.unit.test_kv_tier import GREEDY, PROMPT, evict_prompt, make_engine, reference

RUNNER = [(17 * i) % 250 + 3 for i in range(20)]  # a stream that keeps the steps busy
LONG_RUN = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def serve_beside_a_stream(engine: LLMEngine) -> tuple[list[int], int]:
    """PROMPT added while another request decodes; its tokens, and the steps it waited."""
    engine.add_request("runner", RUNNER, LONG_RUN)
    engine.step()  # the runner is running: later steps have work to overlap reads with
    engine.add_request("again", PROMPT, GREEDY)
    waited, tokens = -1, []
    while engine.requests["again"].block_table == []:  # not admitted yet
        waited += 1
        tokens += [
            t for out in engine.step() if out.request_id == "again" for t in out.new_token_ids
        ]
    return tokens + run_to_completion(engine).get("again", []), waited


def test_blocks_read_beside_the_step_give_the_same_logits(tiny_model_dir, tmp_path):
    tokens, rows = reference(tiny_model_dir, tmp_path)
    engine = make_engine(tiny_model_dir, tmp_path, kv_offloading_size=0.01)
    hashes = evict_prompt(engine)
    engine.tier.policy.prefill_rate = 1.0  # measured slow: the reads may take their time
    recorder = LogitsRecorder(engine)
    again, waited = serve_beside_a_stream(engine)
    assert again == tokens and waited >= 1  # it waited for its reads, beside the runner
    for key, row in rows.items():
        assert torch.equal(recorder.rows[key], row), key
    stats = engine.stats().tier
    assert stats.hits == stats.prefetched == len(hashes) and stats.late == 0
    engine.close()


def test_reads_past_their_deadline_are_recomputed(tiny_model_dir, tmp_path):
    tokens, _ = reference(tiny_model_dir, tmp_path)
    engine = make_engine(tiny_model_dir, tmp_path, kv_offloading_size=0.01)
    evict_prompt(engine)
    engine.tier.policy.prefill_rate = 1e9  # computing is quick: a read may take ~nothing
    gate = threading.Event()
    engine.tier.prefetch.close()
    engine.tier.prefetch = TierPrefetch(lambda block_hash: gate.wait() and None)  # stuck
    again, _ = serve_beside_a_stream(engine)
    assert again == tokens
    stats = engine.stats().tier
    assert stats.late >= 1 and stats.hits == 0 and stats.prefetched == 0
    gate.set()
    engine.close()


def test_results_are_taken_once_and_bounded() -> None:
    gate = threading.Event()
    prefetch = TierPrefetch(lambda block_hash: gate.wait() and bytes([block_hash]), depth=2)
    prefetch.start([1, 2, 3], deadline=float("inf"))  # the third does not fit
    assert prefetch.waiting([1, 2]) and not prefetch.waiting([3])
    gate.set()
    while prefetch.waiting([1, 2]):
        time.sleep(0.001)
    assert prefetch.take(1) == (FetchState.DONE, b"\x01")
    assert prefetch.take(1) == (FetchState.NONE, None)  # taken once
    assert prefetch.take(3) == (FetchState.NONE, None)  # never asked: read at admission
    prefetch.start([4], deadline=0.0)  # a deadline already passed
    assert prefetch.take(4)[0] in (FetchState.LATE, FetchState.DONE)
    prefetch.close()
