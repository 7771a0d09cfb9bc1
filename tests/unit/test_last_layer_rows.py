"""The last layer carries only the rows whose logits are wanted past its attention (its KV is
written for every row): its o_proj and MLP run on those rows alone, and the logits are bit for
bit those of a forward that carries every row."""

from __future__ import annotations

import pytest
import torch

from shared.engine import native
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.model_runner import Span
from tests.hf_tiny_models import write_hf_model

pytestmark = pytest.mark.skipif(native.load() is None, reason="C++ kernels not built")

PROMPTS = [[(7 * i + j) % 250 + 3 for i in range(n)] for j, n in enumerate((20, 7, 30))]


def spans(num_logits: list[int]) -> list[Span]:
    """The three prompts from position 0, each in blocks of its own."""
    tables = [[0, 1], [2], [3, 4]]  # block_size 16
    return [
        Span(prompt, 0, table, wanted)
        for prompt, table, wanted in zip(PROMPTS, tables, num_logits, strict=True)
    ]


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_the_last_layer_goes_on_with_the_wanted_rows_alone(tmp_path, family):
    engine = LLMEngine(
        EngineConfig(
            model_dir=write_hf_model(tmp_path, family),
            dtype="float32",
            batch_invariant=True,  # a row's bits do not depend on the rows beside it
            num_kv_blocks=16,
        )
    )
    runner, model = engine.runner, engine.runner.model
    mlp_rows: list[int] = []
    dense_mlp = model.dense_mlp
    model.dense_mlp = lambda x, layer: (mlp_rows.append(x.shape[0]), dense_mlp(x, layer))[1]

    wanted = runner.forward(spans([1, 0, 3]))  # the first's last row, the third's last three
    layers, rows = model.config.num_layers, sum(map(len, PROMPTS))
    assert mlp_rows == [rows] * (layers - 1) + [4]

    mlp_rows.clear()
    every = runner.forward(spans([len(p) for p in PROMPTS]))
    assert mlp_rows == [rows] * layers
    first_end, third_end = len(PROMPTS[0]), rows
    picked = [first_end - 1, third_end - 3, third_end - 2, third_end - 1]
    assert torch.equal(wanted, every[picked])

    mlp_rows.clear()
    assert runner.forward(spans([0, 0, 0])).shape[0] == 0  # chunks that complete nothing
    assert mlp_rows == [rows] * (layers - 1) + [0]
