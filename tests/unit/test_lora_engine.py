"""LoRA adapters in the native engine (shared/engine/lora/): logits against transformers +
peft, merged and unmerged; a batch mixing the base model and three adapters gives every row
the bits it has alone; adapters never share KV blocks; slots and the host cache evict LRU.

Tolerance: the engine runs fp32 with the adapter's scaling folded into B, where peft scales
after B; the two round differently, so logits agree to 1e-4 absolute (as the base model's
parity test), while an adapter moves them by ~1 (checked, so the comparison means something).
"""

from __future__ import annotations

import pytest
import torch

from shared.engine import native
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.lora.linear import LoraLinear
from shared.engine.model.linear_weights import PackedGateUp
from shared.engine.sampling_params import SamplingParams
from tests.conftest import write_tiny_model
from tests.engine_harness import LogitsRecorder, hf_logits, run_to_completion
from tests.lora_adapters import peft_greedy, peft_logits, peft_model, write_adapter

pytestmark = pytest.mark.skipif(native.load() is None, reason="C++ kernels not built")
ATOL = 1e-4
PROMPT = [(5 * i) % 250 + 3 for i in range(21)]


def greedy(adapter: str = "", max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, adapter=adapter)


def make_engine(model_dir, adapters: dict, **overrides) -> LLMEngine:
    settings = {"num_kv_blocks": 64, "max_num_batched_tokens": 64, "max_num_seqs": 8}
    settings |= {"dtype": "float32", "batch_invariant": True}
    modules = tuple(f"{name}={path}" for name, path in adapters.items())
    return LLMEngine(
        EngineConfig(model_dir=model_dir, lora_modules=modules, **settings | overrides)
    )


OPTIONS = {  # adapter name -> how tests/lora_adapters.py makes it
    "all": {"seed": 11},
    "qv-rank3": {"seed": 12, "r": 3, "target_modules": ["q_proj", "v_proj"]},
    "rslora-mlp": {
        "seed": 13, "r": 8, "alpha": 4.0, "use_rslora": True,
        "target_modules": ["gate_proj", "up_proj", "down_proj", "o_proj"],
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model_dir = write_tiny_model(root / "model", seed=1)
    adapters = {
        name: write_adapter(model_dir, root / name, **options) for name, options in OPTIONS.items()
    }
    return model_dir, adapters


@pytest.mark.parametrize("name", list(OPTIONS))
def test_logits_match_transformers_and_peft_merged_and_unmerged(setup, name):
    model_dir, adapters = setup
    engine = make_engine(model_dir, adapters, max_num_batched_tokens=16)  # chunked prefill
    recorder = LogitsRecorder(engine)
    engine.add_request("r", PROMPT, greedy(name))
    tokens = run_to_completion(engine)["r"]
    reference = peft_model(model_dir, **OPTIONS[name])
    assert tokens == peft_greedy(reference, PROMPT, 6)
    full = PROMPT + tokens
    unmerged = peft_logits(reference, full)
    merged = peft_logits(reference.merge_and_unload(), full)
    base = hf_logits(model_dir, full)
    for position in range(len(PROMPT), len(full)):
        ours = recorder.rows[(tuple(PROMPT), position)]
        assert torch.allclose(ours, unmerged[position - 1], atol=ATOL), position
        assert torch.allclose(ours, merged[position - 1], atol=ATOL), position
        assert (ours - base[position - 1]).abs().max() > 100 * ATOL  # the adapter matters


def test_a_mixed_batch_gives_every_row_its_bits_alone(setup):
    """Base + three adapters in one batch (prefill chunks and decodes together): each row's
    logits bit for bit those it has when its request runs alone."""
    model_dir, adapters = setup
    prompts = {name: [(k * (i + 3)) % 250 + 3 for i in range(9 + 4 * k)]
               for k, name in enumerate(["", *adapters])}  # fmt: skip
    alone = make_engine(model_dir, adapters)
    alone_rows = LogitsRecorder(alone)
    alone_tokens = {}
    for name, prompt in prompts.items():
        alone.add_request(name or "base", prompt, greedy(name, 8))
        alone_tokens |= run_to_completion(alone)
    mixed = make_engine(model_dir, adapters, max_num_batched_tokens=24)  # chunks meet decodes
    mixed_rows = LogitsRecorder(mixed)
    for name, prompt in prompts.items():
        mixed.add_request(name or "base", prompt, greedy(name, 8))
    assert run_to_completion(mixed) == alone_tokens
    assert mixed_rows.rows.keys() == alone_rows.rows.keys()
    for key, row in alone_rows.rows.items():
        assert torch.equal(mixed_rows.rows[key], row), key


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_base_row_of_a_lora_engine_has_the_plain_engines_bits(setup, dtype):
    """A LoRA engine packs gate_up as the plain engine does (SiLU·up inside the matmul): the
    base model's rows, alone (steps without adapter rows) and beside adapter rows (steps that
    take gate and up apart for the adapters' products), are the plain engine's bits."""
    model_dir, adapters = setup
    plain = make_engine(model_dir, {}, dtype=dtype)
    assert plain.adapters is None
    expected = LogitsRecorder(plain)
    plain.add_request("base", PROMPT, greedy("", 8))
    tokens = run_to_completion(plain)
    for beside in ([], list(adapters)):
        engine = make_engine(model_dir, adapters, dtype=dtype, max_num_batched_tokens=24)
        layer = engine.runner.model.weights.layers[0]
        assert isinstance(layer.gate_up, LoraLinear) and isinstance(
            layer.gate_up.base, PackedGateUp
        )
        recorder = LogitsRecorder(engine)
        engine.add_request("base", PROMPT, greedy("", 8))
        for k, name in enumerate(beside):
            engine.add_request(name, [(7 * i + k) % 250 + 3 for i in range(11)], greedy(name, 8))
        assert run_to_completion(engine)["base"] == tokens["base"]
        for key, row in expected.rows.items():
            assert torch.equal(recorder.rows[key], row), (beside, key)


def test_two_adapters_never_share_kv_blocks(setup):
    model_dir, adapters = setup
    engine = make_engine(model_dir, adapters)
    hits = []
    for i, name in enumerate(["all", "qv-rank3", "", "all"]):
        before = engine.stats().prefix_hits
        engine.add_request(f"r{i}", PROMPT, greedy(name, 2))
        run_to_completion(engine)
        hits.append(engine.stats().prefix_hits - before)
    assert hits[:3] == [0, 0, 0]  # the same prompt under another adapter or the base: no hit
    assert hits[3] == 16  # the same adapter again: its full blocks


def test_a_decode_engine_refuses_blocks_computed_under_another_adapter(setup):
    model_dir, adapters = setup
    prefill, decode = make_engine(model_dir, adapters), make_engine(model_dir, adapters)
    prefill.add_request("r", PROMPT, greedy("all"), hold_kv=True)
    held = prefill.run_step().held["r"]
    assert held.block_ids
    decode.reserve("r", PROMPT, greedy("qv-rank3"))
    from shared.engine.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="hash does not match"):
        decode.import_kv("r", prefill.export_kv("r"))


def test_slots_and_host_cache_evict_least_recently_used(setup):
    """Two slots, two host entries, three adapters at once: no step uses more than two, every
    request gets its tokens alone, and slots are filled again (and adapters re-read) as the
    step's adapters change."""
    model_dir, adapters = setup
    expected = {}
    for name in adapters:
        engine = make_engine(model_dir, adapters)
        engine.add_request(name, PROMPT, greedy(name))
        expected |= run_to_completion(engine)
    engine = make_engine(model_dir, adapters, max_loras=2, max_cpu_loras=2)
    bank = engine.adapters
    assert bank is not None and bank.stats.reads == 3
    for name in adapters:
        engine.add_request(name, PROMPT, greedy(name))
    assert run_to_completion(engine) == expected
    assert len(bank.in_slots) == 2
    assert bank.stats.swap_ins >= 3 and bank.stats.reads >= 4  # the first read was evicted
