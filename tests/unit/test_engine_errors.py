"""The engine's error API and step bookkeeping on a tiny random Llama: which typed error each
public method raises, `check_request` from other threads, the idle-step signal and stats."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.errors import EngineError, InvalidRequest, OutOfBlocks, UnknownRequest
from shared.engine.sampling_params import SamplingParams
from shared.engine.structured_output import GrammarCompilers
from tests.conftest import write_tiny_model
from tests.engine_harness import run_to_completion

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [(7 * i) % 250 + 3 for i in range(37)]  # 3 blocks of 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a tokenizer whose token i is the single character chr(i)."""
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-chars"))
    vocab = {chr(i) if i > 32 else f"<{i}>": i for i in range(256)}
    Tokenizer(models.WordLevel(vocab, unk_token="<0>")).save(str(path / "tokenizer.json"))
    return path


def make_engine(model_dir: Path, **overrides) -> LLMEngine:
    settings = {"num_kv_blocks": 16, "max_num_batched_tokens": 64, "max_num_seqs": 4}
    return LLMEngine(EngineConfig(model_dir=model_dir, **(settings | overrides)))


def regex(spec: str, **overrides) -> SamplingParams:
    settings = {"temperature": 1.0, "max_tokens": 8, "seed": 3} | overrides
    return SamplingParams(guided_kind="regex", guided_spec=spec, **settings)


def test_invalid_request_carries_field_and_reason() -> None:
    exc = InvalidRequest("max_tokens", "too many")
    assert isinstance(exc, EngineError) and not isinstance(exc, ValueError)
    assert (exc.field, exc.reason, str(exc)) == ("max_tokens", "too many", "too many")
    assert issubclass(UnknownRequest, EngineError) and issubclass(OutOfBlocks, EngineError)
    assert not issubclass(UnknownRequest, KeyError) and not issubclass(OutOfBlocks, MemoryError)


def test_each_public_method_raises_the_engine_errors(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    engine.add_request("a", PROMPT, GREEDY, hold_kv=True)
    with pytest.raises(InvalidRequest, match="'a' is already in the engine") as duplicate:
        engine.reserve("a", PROMPT, GREEDY)
    assert duplicate.value.field == "request_id"
    with pytest.raises(InvalidRequest, match="already in the engine"):
        engine.add_request("a", PROMPT, GREEDY)
    with pytest.raises(UnknownRequest, match="'a' is WAITING, not HELD"):
        engine.export_kv("a")  # not prefilled yet
    run_to_completion(engine)
    blocks = engine.export_kv("a")  # every layer in one call
    assert blocks.layers == range(engine.model_config.num_layers)
    assert tuple(blocks.data.shape[:2]) == (engine.model_config.num_layers, 3)
    with pytest.raises(InvalidRequest) as bad_block:
        engine.export_kv("a", first_block=4)
    assert bad_block.value.field == "first_block"
    for call in (
        lambda: engine.export_kv("nobody"),
        lambda: engine.release("nobody"),
        lambda: engine.import_kv("a", blocks),  # HELD, not RESERVED
        lambda: engine.start_decode("a", 5),
    ):
        with pytest.raises(UnknownRequest):
            call()
    engine.abort_request("nobody")  # aborting what is gone is no error
    engine.release("a")
    assert not engine.requests and engine.stats().free_blocks == 16

    engine.reserve("r", PROMPT, GREEDY)
    with pytest.raises(InvalidRequest, match=r"blocks \[2, 5\) out of range") as out_of_range:
        engine.import_kv("r", type(blocks)(**{**_fields(blocks), "first_block": 2}))
    assert out_of_range.value.field == "kv"
    with pytest.raises(InvalidRequest, match=r"token ids must be in \[0, 256\)") as bad_token:
        engine.start_decode("r", 256)
    assert bad_token.value.field == "first_token_id"
    with pytest.raises(OutOfBlocks):
        engine.reserve("s", [4] * 220, GREEDY)  # 14 blocks; "r" left 13 free
    assert engine.stats().num_reserved == 1 and "s" not in engine.requests


def _fields(blocks) -> dict:
    return {name: getattr(blocks, name) for name in blocks.__slots__}


def test_check_request_changes_nothing_and_matches_add_request(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    engine.add_request("busy", PROMPT, GREEDY)
    engine.step()
    before = (engine.stats(), dict(engine.requests), engine.block_manager.ref_counts[:])
    engine.check_request(PROMPT, GREEDY)
    engine.check_request(PROMPT, regex("[a-c]{3}"), output_token_ids=[ord("a")])
    for bad, field in (
        (([], GREEDY), "prompt_token_ids"),
        ((PROMPT, GREEDY, [300]), "output_token_ids"),
        ((PROMPT, SamplingParams(max_tokens=500)), "max_tokens"),
        ((PROMPT, regex("[a-c")), "guided_spec"),
        ((PROMPT, regex("[a-c]{3}"), [ord("z")]), "output_token_ids"),
    ):
        with pytest.raises(InvalidRequest) as refused:
            engine.check_request(*bad)
        assert refused.value.field == field
        with pytest.raises(InvalidRequest) as also:
            engine.add_request("new", bad[0], bad[1], output_token_ids=(bad[2:] or [()])[0])
        assert also.value.field == field
    assert (engine.stats(), dict(engine.requests), engine.block_manager.ref_counts) == before


def test_check_request_from_other_threads_while_the_engine_steps(model_dir: Path) -> None:
    engine = make_engine(model_dir, num_kv_blocks=64)
    expected = run_to_completion(_with_requests(make_engine(model_dir, num_kv_blocks=64)))
    _with_requests(engine)
    specs = [f"[a-e]{{{n}}}x" for n in range(1, 7)]
    errors: list[BaseException] = []
    start = threading.Barrier(5)

    def check(offset: int) -> None:
        start.wait()
        try:
            for spec in specs[offset:] + specs[:offset]:
                engine.check_request(PROMPT, regex(spec))
                with pytest.raises(InvalidRequest):
                    engine.check_request(PROMPT, regex(spec + "("))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=check, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    start.wait()
    outputs = run_to_completion(engine)
    for thread in threads:
        thread.join()
    assert not errors
    assert outputs == expected


def _with_requests(engine: LLMEngine) -> LLMEngine:
    for i in range(3):
        engine.add_request(f"r{i}", PROMPT[i:], GREEDY)
    engine.add_request("guided", [5, 6, 7], regex("[a-c]{2}x"))
    return engine


def test_grammar_compilers_compile_each_spec_once_under_contention(model_dir: Path) -> None:
    grammars = GrammarCompilers(model_dir, 256, (2,))
    start = threading.Barrier(8)
    results: list[object] = []

    def compile_one() -> None:
        start.wait()
        results.append(grammars.compile("regex", "[a-z]{1,40}@[a-z]{1,40}"))

    threads = [threading.Thread(target=compile_one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8 and all(r is results[0] for r in results)


def test_start_decode_refuses_a_first_token_the_grammar_forbids(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    engine.reserve("g", [5, 6, 7], regex("[a-c]{3}"))
    with pytest.raises(InvalidRequest, match="does not fit the request's grammar") as refused:
        engine.start_decode("g", ord("z"))
    assert refused.value.field == "first_token_id"
    first = engine.start_decode("g", ord("b"))
    assert first.new_token_ids == [ord("b")]
    rest = run_to_completion(engine)["g"]
    text = "".join(chr(t) for t in [ord("b"), *rest[:2]])
    assert len(text) == 3 and set(text) <= set("abc")


def test_an_idle_step_schedules_nothing_and_changes_nothing(model_dir: Path) -> None:
    """A reservation holds most of the cache: the running request outgrows the rest, is
    preempted, and cannot come back until the reservation goes. Those steps report 0 tokens
    and leave everything as it was; releasing the blocks lets the request finish unchanged."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = run_to_completion(_add(make_engine(model_dir, num_kv_blocks=6), params))["a"]
    engine = make_engine(model_dir, num_kv_blocks=6, max_num_batched_tokens=16)
    engine.reserve("held", [9] * 60, GREEDY)  # 4 of the 6 blocks
    _add(engine, params)  # 20 tokens: 2 blocks now, a 3rd at token 33
    tokens: list[int] = []
    while engine.last_step_num_tokens or not tokens:
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    stats = engine.stats()
    assert stats.num_preemptions == 1 and stats.num_waiting == 1 and stats.num_running == 0
    assert stats.num_reserved == 1 and engine.has_unfinished_requests()
    events = engine.take_kv_events()
    assert engine.step() == [] and engine.last_step_num_tokens == 0
    assert engine.stats() == stats and engine.take_kv_events() == type(events)()
    engine.abort_request("held")
    assert engine.stats().num_reserved == 0
    assert tokens + run_to_completion(engine)["a"] == expected
    assert engine.last_step_num_tokens > 0 and engine.stats().free_blocks == 6


def _add(engine: LLMEngine, params: SamplingParams) -> LLMEngine:
    engine.add_request("a", PROMPT[:20], params)
    return engine


def test_stats_count_queues_and_prefix_hits(model_dir: Path) -> None:
    engine = make_engine(model_dir, num_kv_blocks=32)
    engine.add_request("p", PROMPT, GREEDY, hold_kv=True)
    run_to_completion(engine)
    engine.add_request("w", PROMPT, GREEDY)
    engine.reserve("r", PROMPT[:20], GREEDY)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_held, stats.num_reserved) == (
        0,
        1,
        1,
        1,
    )
    assert stats.total_blocks == 32 and stats.block_size == 16
    assert stats.free_blocks == 32 - 3 - 1  # r's first block is p's, shared
    assert stats.usage == pytest.approx(4 / 32)
    assert stats.prefix_queries == len(PROMPT) + 20 and stats.prefix_hits == 16  # r hits p
    assert engine.take_kv_events().stored == list(engine.block_manager.cached)
    engine.step()
    assert engine.stats().prefix_hits == 16 + 32 and engine.stats().num_running == 1
