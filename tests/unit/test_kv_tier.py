"""The second KV tier in the engine: blocks evicted from the pool come back from the tier
bit for bit; a refused entry is recomputed; a tier slower than recomputing is not read;
blocks are written only once evicted blocks are seen to return."""

from __future__ import annotations

import torch

from shared.engine.block_hash import hash_full_blocks
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from shared.engine.stats import StepCosts
from tests.engine_harness import LogitsRecorder, run_to_completion

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [(11 * i) % 250 + 3 for i in range(70)]  # 4 full blocks before its last token
FILLERS = [[(13 * i + k) % 250 + 3 for i in range(150)] for k in (1, 2)]
MORE_FILLERS = [[(13 * i + k) % 250 + 3 for i in range(150)] for k in (3, 4)]  # never return


def make_engine(model_dir, tmp_path, **overrides) -> LLMEngine:
    settings = {"num_kv_blocks": 12, "max_num_batched_tokens": 64, "max_num_seqs": 4}
    settings |= {"dtype": "float32", "kv_offloading_dir": str(tmp_path / "tier")}
    return LLMEngine(EngineConfig(model_dir=model_dir, **(settings | overrides)))


def run(engine: LLMEngine, request_id: str, prompt: list[int]) -> list[int]:
    engine.add_request(request_id, prompt, GREEDY)
    return run_to_completion(engine)[request_id]


def evict_prompt(engine: LLMEngine) -> list[int]:
    """Serve PROMPT, then the fillers that evict its blocks from the pool, twice: the tier
    writes a block once evicted blocks are seen to return (admission.py), here PROMPT's
    second time. PROMPT's block hashes."""
    for round, fillers in enumerate((FILLERS, MORE_FILLERS)):
        run(engine, f"first{round}", PROMPT)
        for index, filler in enumerate(fillers):
            run(engine, f"filler{round}.{index}", filler)
    hashes = hash_full_blocks(PROMPT[:-1], 16, "")
    assert not any(h in engine.block_manager.cached for h in hashes), "the fillers evict it"
    assert engine.tier is not None and engine.tier.writer.flush()
    return hashes


def reference(model_dir, tmp_path) -> tuple[list[int], dict]:
    """PROMPT served twice by an engine whose pool keeps it: the second time's logits."""
    engine = make_engine(model_dir, tmp_path, num_kv_blocks=64)
    run(engine, "first", PROMPT)
    recorder = LogitsRecorder(engine)
    tokens = run(engine, "again", PROMPT)
    assert engine.stats().prefix_hits == 64
    return tokens, recorder.rows


def test_evicted_blocks_reload_bit_for_bit(tiny_model_dir, tmp_path):
    tokens, rows = reference(tiny_model_dir, tmp_path)
    engine = make_engine(tiny_model_dir, tmp_path, kv_offloading_size=0.01)
    hashes = evict_prompt(engine)
    assert engine.tier.held_run(hashes) == len(hashes)
    assert set(hashes) <= set(engine.take_kv_events().tier_stored)  # the scheduler hears it
    recorder = LogitsRecorder(engine)
    assert run(engine, "again", PROMPT) == tokens
    assert rows.keys() == recorder.rows.keys()
    for key, row in rows.items():
        assert torch.equal(recorder.rows[key], row), key
    stats = engine.stats().tier
    assert stats.hits == len(hashes) and stats.refused == 0
    assert stats.bytes_out > 0 and stats.bytes_in > 0 and stats.load_seconds > 0
    engine.close()


def test_without_a_tier_the_evicted_prefix_is_recomputed(tiny_model_dir, tmp_path):
    tokens, _ = reference(tiny_model_dir, tmp_path)
    engine = make_engine(tiny_model_dir, tmp_path)
    assert engine.tier is None
    run(engine, "first", PROMPT)
    for index, filler in enumerate(FILLERS):
        run(engine, f"filler{index}", filler)
    hits_before = engine.stats().prefix_hits
    assert run(engine, "again", PROMPT) == tokens
    assert engine.stats().prefix_hits == hits_before


def test_a_corrupt_entry_is_refused_and_recomputed(tiny_model_dir, tmp_path):
    tokens, _ = reference(tiny_model_dir, tmp_path)
    engine = make_engine(tiny_model_dir, tmp_path, kv_offloading_size=0.01)
    hashes = evict_prompt(engine)
    entry = engine.tier.store.path / f"{hashes[2]:016x}.kv"
    data = bytearray(entry.read_bytes())
    data[-1] ^= 0xFF  # one bit of the payload
    entry.write_bytes(bytes(data))
    assert run(engine, "again", PROMPT) == tokens
    stats = engine.stats().tier
    assert stats.hits == 2 and stats.refused == 1  # the blocks before it still load
    assert not engine.tier.store.holds(hashes[2])
    engine.close()


def test_a_tier_slower_than_recomputing_is_not_read(tiny_model_dir, tmp_path):
    tokens, _ = reference(tiny_model_dir, tmp_path)
    engine = make_engine(tiny_model_dir, tmp_path, kv_offloading_size=0.01)
    hashes = evict_prompt(engine)
    engine.tier.policy.observe_load(seconds=1.0, num_blocks=1)  # a second a block
    engine.observe_costs(StepCosts(prefill_rate=1000.0))  # 16 ms for a block's tokens
    assert run(engine, "again", PROMPT) == tokens
    stats = engine.stats().tier
    assert stats.hits == 0 and stats.skipped == len(hashes)
    engine.close()


def test_close_removes_the_entries(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir, tmp_path, kv_offloading_size=0.01)
    evict_prompt(engine)
    path = engine.tier.store.path
    assert any(path.glob("*.kv"))
    engine.close()
    assert not path.exists()


def test_nothing_is_written_until_evicted_blocks_return(tiny_model_dir, tmp_path, monkeypatch):
    engine = make_engine(tiny_model_dir, tmp_path, kv_offloading_size=0.01)
    gathers: list[list[int]] = []
    read_blocks = engine.runner.kv_cache.read_blocks
    monkeypatch.setattr(
        engine.runner.kv_cache,
        "read_blocks",
        lambda ids, layers: gathers.append(ids) or read_blocks(ids, layers),
    )
    run(engine, "first", PROMPT)
    for index, filler in enumerate(FILLERS):  # no block returns: none is copied or written
        run(engine, f"filler{index}", filler)
    assert engine.tier is not None and engine.tier.writer.flush()
    stats = engine.stats().tier
    assert stats.unwritten == engine.block_manager.evictions > 0
    assert stats.bytes_out == 0 and gathers == [] and not any(engine.tier.store.path.glob("*.kv"))
    run(engine, "again", PROMPT)  # PROMPT returns: recomputed, and written at its eviction
    assert engine.stats().tier.hits == 0
    for index, filler in enumerate(MORE_FILLERS):
        run(engine, f"filler{index}.again", filler)
    assert engine.tier.writer.flush() and gathers
    hashes = hash_full_blocks(PROMPT[:-1], 16, "")
    assert engine.tier.held_run(hashes) == len(hashes)
    engine.close()
