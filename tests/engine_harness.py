"""Helpers for driving an `LLMEngine` in tests: run to completion, capture logits, compare
with transformers' own forward pass."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.engine.engine import LLMEngine
from shared.engine.sampler import Sampler


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
