"""The engine on a tiny random Llama: parity with transformers, batching invariance,
chunked prefill, preemption, seeded resumption, aborts and the KV hand-off hooks."""

from __future__ import annotations

import pytest
import torch

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.errors import InvalidRequest, OutOfBlocks
from shared.engine.sampling_params import SamplingParams
from shared.engine.sequence import FinishReason
from tests.conftest import write_tiny_model
from tests.engine_harness import LogitsRecorder, hf_greedy, hf_logits, run_to_completion

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = {
    "one": [5],
    "short": [3, 4, 5, 6, 7],
    "mid": [(7 * i) % 250 + 3 for i in range(37)],
    "long": [(11 * i) % 250 + 3 for i in range(70)],
}


def make_engine(model_dir, **overrides) -> LLMEngine:
    settings = {"num_kv_blocks": 64, "max_num_batched_tokens": 64, "max_num_seqs": 8}
    settings["dtype"] = "float32"  # exact against transformers' fp32
    return LLMEngine(EngineConfig(model_dir=model_dir, **(settings | overrides)))


def run_all(engine: LLMEngine, prompts: dict[str, list[int]], params=GREEDY):
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, params)
    return run_to_completion(engine)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"attention_bias": True, "tie_word_embeddings": False, "num_key_value_heads": 4}],
    ids=["llama-gqa-tied", "qwen2-style-bias-untied"],
)
def test_logits_and_greedy_tokens_match_transformers(tmp_path, overrides):
    model_dir = write_tiny_model(tmp_path / "m", seed=1, **overrides)
    engine = make_engine(model_dir, max_num_batched_tokens=16)  # forces chunked prefill
    recorder = LogitsRecorder(engine)
    outputs = run_all(engine, PROMPTS)
    for name, prompt in PROMPTS.items():
        assert outputs[name] == hf_greedy(model_dir, prompt, GREEDY.max_tokens), name
        full = prompt + outputs[name]
        reference = hf_logits(model_dir, full)
        for position in range(len(prompt), len(full)):
            ours = recorder.rows[(tuple(prompt), position)]
            assert torch.allclose(ours, reference[position - 1], atol=1e-4), (name, position)


def test_tokens_do_not_depend_on_batch_or_chunking(tiny_model_dir):
    alone = {
        name: run_all(make_engine(tiny_model_dir), {name: prompt})[name]
        for name, prompt in PROMPTS.items()
    }
    for budget in (8, 64):
        together = run_all(make_engine(tiny_model_dir, max_num_batched_tokens=budget), PROMPTS)
        assert together == alone


def test_preemption_by_recompute_gives_the_same_tokens(tiny_model_dir):
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)
    roomy = run_all(make_engine(tiny_model_dir), PROMPTS, params)
    tight = make_engine(tiny_model_dir, num_kv_blocks=14, enable_prefix_caching=False)
    assert run_all(tight, PROMPTS, params) == roomy
    stats = tight.stats()
    assert stats.num_preemptions > 0, "the cache was meant to be too small for all four at once"
    assert stats.free_blocks == stats.total_blocks == 14 and stats.usage == 0.0


def test_seeded_request_resumed_from_its_first_tokens_continues_identically(tiny_model_dir):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    prompt = PROMPTS["mid"]
    full = run_all(make_engine(tiny_model_dir), {"a": prompt}, params)["a"]
    engine = make_engine(tiny_model_dir)
    engine.add_request("a", prompt, params, output_token_ids=full[:7])
    engine.add_request("noise", PROMPTS["long"], SamplingParams(temperature=1.0, max_tokens=30))
    assert run_to_completion(engine)["a"] == full[7:]


def test_stop_conditions_and_finish_reasons(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    free_run = run_all(engine, {"a": PROMPTS["short"]})["a"]
    stop_at = free_run[3]
    engine.add_request(
        "stop",
        PROMPTS["short"],
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop_at,)),
    )
    engine.add_request("length", PROMPTS["short"], SamplingParams(temperature=0.0, max_tokens=2))
    reasons = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
    assert reasons == {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


def test_abort_frees_blocks_at_once(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    for name, prompt in PROMPTS.items():
        engine.add_request(name, prompt, GREEDY)
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < 64
    for name in PROMPTS:
        engine.abort_request(name)
    assert engine.block_manager.num_free_blocks == 64
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("prompt", "params", "field", "message"),
    [
        ([], GREEDY, "prompt_token_ids", "at least one token"),
        ([1, 999], GREEDY, "prompt_token_ids", r"token ids must be in \[0, 256\)"),
        (list(range(3, 250)) * 5, GREEDY, "prompt_token_ids", "1235 tokens; the model's context"),
        ([3, 4], SamplingParams(max_tokens=2000), "max_tokens", "more KV blocks than the cache"),
    ],
)
def test_bad_requests_are_refused_with_a_clear_error(
    tiny_model_dir, prompt, params, field, message
):
    engine = make_engine(tiny_model_dir, num_kv_blocks=32)  # 512 tokens < the 1024 context
    for call in (engine.check_request, lambda *args: engine.add_request("bad", *args)):
        with pytest.raises(InvalidRequest, match=message) as refused:
            call(prompt, params)
        assert refused.value.field == field and str(refused.value) == refused.value.reason
    with pytest.raises(InvalidRequest, match=message):
        engine.reserve("bad", prompt, params)
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.num_free_blocks == 32


def test_kv_handoff_from_prefill_engine_to_decode_engine(tiny_model_dir):
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=10, ignore_eos=True)
    prompts = {"first": PROMPTS["long"], "second": PROMPTS["long"][:48] + [9, 9, 9]}
    expected = run_all(make_engine(tiny_model_dir), prompts, params)
    prefill, decode = make_engine(tiny_model_dir), make_engine(tiny_model_dir)
    cached_blocks = {}
    for name, prompt in prompts.items():
        prefill.add_request(name, prompt, params, hold_kv=True)
        first = run_to_completion(prefill)[name]
        assert len(first) == 1
        reservation = decode.reserve(name, prompt, params)
        cached_blocks[name] = reservation.num_cached_blocks
        half = prefill.model_config.num_layers // 2
        for layers in (range(0, half), range(half, prefill.model_config.num_layers)):
            blocks = prefill.export_kv(name, layers, first_block=reservation.num_cached_blocks)
            decode.import_kv(name, blocks)
        prefill.release(name)
        decode.start_decode(name, first[0])
        assert first + run_to_completion(decode)[name] == expected[name]
    assert cached_blocks == {"first": 0, "second": 3}  # 48 shared tokens = 3 blocks of 16
    assert prefill.block_manager.num_free_blocks == decode.block_manager.num_free_blocks == 64


def test_import_checks_what_it_writes(tiny_model_dir):
    prefill, decode = make_engine(tiny_model_dir), make_engine(tiny_model_dir)
    prefill.add_request("r", PROMPTS["long"], GREEDY, hold_kv=True)
    run_to_completion(prefill)
    decode.reserve("r", PROMPTS["mid"] + PROMPTS["short"] * 7, GREEDY)  # another prompt
    with pytest.raises(InvalidRequest, match="hash") as refused:
        decode.import_kv("r", prefill.export_kv("r"))
    assert refused.value.field == "kv"
    decode.abort_request("r")
    decode.reserve("r", PROMPTS["long"], GREEDY)
    blocks = prefill.export_kv("r")
    blocks.data = blocks.data.to(torch.float16)
    with pytest.raises(InvalidRequest, match="do not fit") as refused:
        decode.import_kv("r", blocks)
    assert refused.value.field == "kv"


def test_reserve_refuses_when_blocks_run_out(tiny_model_dir):
    decode = make_engine(tiny_model_dir, num_kv_blocks=6)
    decode.reserve("a", PROMPTS["long"], GREEDY)  # 70 tokens: 5 blocks
    with pytest.raises(OutOfBlocks):
        decode.reserve("b", PROMPTS["mid"], GREEDY)
    decode.abort_request("a")
    assert decode.block_manager.num_free_blocks == 6


def test_a_step_reports_what_it_started_and_held(tiny_model_dir):
    """`run_step` tells the engine's own transitions: a request is started by the step that
    runs its first chunk (a long prompt's later chunks do not start it again) and held,
    with its blocks, by the step that samples its first token."""
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=48)
    engine.add_request("long", PROMPTS["long"], GREEDY, hold_kv=True)  # 70 tokens: 2 chunks
    first = engine.run_step()
    assert first.started == ["long"] and not first.outputs and not first.held
    second = engine.run_step()
    assert second.started == [] and [o.request_id for o in second.outputs] == ["long"]
    held = second.held["long"]
    assert len(held.block_ids) == 5 and held.block_hashes[-1] is None  # 70 = 4 * 16 + 6
    assert None not in held.block_hashes[:4]
    assert engine.kv.export("long", first_block=4).block_hashes == [None]
    engine.release("long")
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == 64


def test_a_first_token_that_ends_a_decode_is_reported_by_the_next_step(tiny_model_dir):
    prefill, decode = make_engine(tiny_model_dir), make_engine(tiny_model_dir)
    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prefill.add_request("r", PROMPTS["mid"], GREEDY, hold_kv=True)
    first = run_to_completion(prefill)["r"]
    decode.reserve("r", PROMPTS["mid"], one_token)
    decode.import_kv("r", prefill.export_kv("r"))
    assert decode.start_decode("r", first[0]).finish_reason == FinishReason.LENGTH
    assert decode.has_unfinished_requests()
    (ended,) = decode.run_step().outputs
    assert (ended.request_id, ended.new_token_ids) == ("r", [])
    assert ended.finish_reason == FinishReason.LENGTH and not decode.has_unfinished_requests()
