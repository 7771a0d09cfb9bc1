"""Helpers for driving an `LLMEngine` in tests: run to completion, capture logits, compare
with transformers' own forward pass."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampler import Sampler
from shared.engine.sampling_params import SamplingParams


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Step until idle; the output tokens of every request that produced any."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError(f"engine still busy after {max_steps} steps")


class LogitsRecorder:
    """Wraps the engine's sampler and keeps every logits row it sees, keyed by
    (prompt token ids, position of the token sampled from it)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.rows: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}
        self._sampler: Sampler = engine.runner.sampler
        engine.runner.sampler = self  # type: ignore[assignment]

    def __call__(self, logits, rows):
        for i, row in enumerate(rows):
            self.rows[(tuple(row.prompt_token_ids), row.position)] = logits[i].clone()
        return self._sampler(logits, rows)


def greedy_logits(model_dir: Path, prompt: list[int], max_tokens: int, **config) -> torch.Tensor:
    """[max_tokens, vocab]: the logits rows of `prompt` decoded greedily alone, in order."""
    engine = LLMEngine(EngineConfig(model_dir=model_dir, num_kv_blocks=32, **config))
    recorder = LogitsRecorder(engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("r", prompt, params)
    run_to_completion(engine)
    return torch.stack([recorder.rows[key] for key in sorted(recorder.rows)])


def assert_same_bits_beside_others(model_dir: Path, prompt: list[int]) -> None:
    """`prompt`'s greedy logits rows (4 tokens) are the same bits alone as beside three other
    prompts: the batch invariance of the model's matmuls."""

    def rows(prompts: list[list[int]]) -> dict:
        engine = LLMEngine(EngineConfig(model_dir=model_dir, num_kv_blocks=64))
        assert engine.config.batch_invariant
        recorder = LogitsRecorder(engine)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for i, each in enumerate(prompts):
            engine.add_request(f"r{i}", each, params)
        run_to_completion(engine)
        return {key: row for key, row in recorder.rows.items() if key[0] == tuple(prompt)}

    alone = rows([prompt])
    beside = rows([list(range(40, 51)), prompt, list(range(60, 100)), [7, 8, 9]])
    assert alone.keys() == beside.keys() and len(alone) == 4
    assert all(torch.equal(alone[key], beside[key]) for key in alone)


def hf_logits(
    model_dir: Path, token_ids: list[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[len(token_ids), vocab] next-token logits from transformers (in float32) of the model
    in `dtype`, one forward pass."""
    model = _hf_model(model_dir, dtype)
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()


_HF_MODELS: dict[tuple[Path, torch.dtype], object] = {}


def _hf_model(model_dir: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if (model_dir, dtype) not in _HF_MODELS:
        _HF_MODELS[model_dir, dtype] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation="eager"
        ).eval()
    return _HF_MODELS[model_dir, dtype]


def hf_greedy(
    model_dir: Path, prompt: list[int], max_new_tokens: int, dtype: torch.dtype = torch.float32
) -> list[int]:
    model = _hf_model(model_dir, dtype)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
