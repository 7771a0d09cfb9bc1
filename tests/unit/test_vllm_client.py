"""VllmEngineClient's own rules, without starting vLLM: what a prefill keeps for the decode
engine, the decode engine's repeated first token, logprobs as ours."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (make install ENGINE=vllm)")

from vllm.logprobs import Logprob

from services.worker.config import WorkerConfig
from services.worker.vllm_client import VllmEngineClient
from services.worker.vllm_outputs import logprobs, request_output
from services.worker.vllm_sampling import to_vllm
from shared.engine.engine_config import EngineConfig
from shared.engine.errors import UnknownRequest
from shared.engine.sampling_params import SamplingParams
from shared.engine.sequence import FinishReason
from shared.protocol import SubmitRequest

PARAMS = {"remote_block_ids": [[4, 5, 6]], "remote_engine_id": "e", "remote_request_id": "r-1"}


def client() -> VllmEngineClient:
    engine = EngineConfig(model_dir=Path("/m"), block_size=32)
    return VllmEngineClient(
        WorkerConfig(
            worker_id="p", role="prefill", model_name="m", engine_kind="vllm", engine=engine
        )
    )


def request(max_tokens: int = 20, prompt_len: int = 70) -> SubmitRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return SubmitRequest("r", "g", list(range(100, 100 + prompt_len)), sampling, deadline=1e12)


def vllm_output(token: int, finish: str, params: dict | None = None) -> SimpleNamespace:
    completion = SimpleNamespace(token_ids=[token], finish_reason=finish, logprobs=None)
    return SimpleNamespace(
        outputs=[completion], finished=True, kv_transfer_params=params, num_cached_tokens=0
    )


def run_prefill(engine: VllmEngineClient, req: SubmitRequest, token: int, finish: str):
    out = vllm_output(token, finish, PARAMS)
    output = request_output(req, out, to_vllm("r", req.sampling, 0, max_tokens=1).logprobs)
    return output, engine._hold(req, out, output)


def test_a_prefill_capped_by_us_holds_its_blocks_for_the_decode_engine():
    engine = client()
    output, held = run_prefill(engine, request(), 7, "length")
    assert output.finish_reason is None and output.new_token_ids == [7]
    block_ids, hashes = held.block_ids, held.block_hashes
    assert block_ids == [4, 5, 6]
    assert len(hashes) == 3 and hashes[2] is None and None not in hashes[:2]  # 70 = 32+32+6
    assert b'"remote_request_id": "r-1"' in engine.kv.params("r")
    engine.kv.release("r")
    with pytest.raises(UnknownRequest):
        engine.kv.params("r")


@pytest.mark.parametrize(
    ("max_tokens", "finish", "ours"),
    [(20, "stop", FinishReason.STOP), (1, "length", FinishReason.LENGTH)],
)
def test_a_request_that_ends_at_its_first_token_holds_nothing(max_tokens, finish, ours):
    engine = client()
    output, held = run_prefill(engine, request(max_tokens), 2, finish)
    assert output.finish_reason == ours and held is None
    with pytest.raises(UnknownRequest):
        engine.kv.params("r")


def test_the_decode_engines_first_token_is_dropped_and_a_mismatch_counted():
    engine = client()
    output = SimpleNamespace(request_id="r", new_token_ids=[7, 8, 9], new_logprobs=[])
    engine._drop_first(output, 7)
    assert output.new_token_ids == [8, 9] and engine.first_token_mismatches == 0
    output.new_token_ids = [5, 6]
    engine._drop_first(output, 7)
    assert output.new_token_ids == [6] and engine.first_token_mismatches == 1


def test_logprobs_are_the_chosen_tokens_and_the_top_k_best_first():
    candidates = {
        3: Logprob(-2.0, rank=3),
        1: Logprob(-0.5, rank=1),
        2: Logprob(-1.0, rank=2),
    }
    (lp,) = logprobs([3], [candidates], 2)
    assert (lp.token_id, lp.logprob, lp.top) == (3, -2.0, [(1, -0.5), (2, -1.0)])
    assert logprobs([3], [candidates], None) == []
