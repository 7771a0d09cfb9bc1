"""`splitserve bench quant`'s perplexity: which tokens of which windows it scores, all of each
window's or, as llama-perplexity does, the second half of whole windows only. A stand-in
model whose logits depend on the position alone makes every token's log-probability known."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from loadtest.engine_bench.quant import perplexity

VOCAB = 8


class PositionModel:
    """Logits row of position p: p / 4 for token 0, 0 for the others."""

    def forward(self, ids, positions, meta, kv_layers, logits_at):
        rows = torch.zeros(len(logits_at), VOCAB)
        rows[:, 0] = positions[logits_at].float() / 4
        return rows


def stand_in_engine() -> SimpleNamespace:
    runner = SimpleNamespace(
        model=PositionModel(),
        kv_cache=SimpleNamespace(layers=[]),
        sampler=SimpleNamespace(vocab_size=VOCAB),
    )
    return SimpleNamespace(runner=runner, config=SimpleNamespace(block_size=4))


def expected(tokens: list[int], window: int, first: int, whole_only: bool) -> float:
    """exp(mean NLL) over the tokens after position `first` of each window, by hand."""
    nll, count = 0.0, 0
    for start in range(0, len(tokens), window):
        ids = tokens[start : start + window]
        if len(ids) < 2 or (whole_only and len(ids) < window):
            break
        for p in range(first, len(ids) - 1):
            logit = p / 4
            norm = math.log(math.exp(logit) + VOCAB - 1)
            nll -= (logit if ids[p + 1] == 0 else 0.0) - norm
            count += 1
    return math.exp(nll / count)


def test_every_token_of_every_window_or_the_second_halves_of_whole_windows():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2, (2 * 16 + 5,), generator=gen).tolist()  # 2 windows and a tail
    engine = stand_in_engine()
    every = perplexity(engine, tokens, 16)
    assert math.isclose(every, expected(tokens, 16, 0, whole_only=False), rel_tol=1e-6)
    halves = perplexity(engine, tokens, 16, first=8)
    assert math.isclose(halves, expected(tokens, 16, 8, whole_only=True), rel_tol=1e-6)
    assert not math.isclose(halves, every, rel_tol=1e-3)
