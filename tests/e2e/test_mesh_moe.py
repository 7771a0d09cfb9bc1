"""A tiny Qwen3-MoE checkpoint served by `splitserve up --model-dir`, called with the OpenAI
SDK: its greedy chat replies equal the engine's own."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_mesh import Mesh, engine_text, start_mesh
from tests.hf_tiny_models import write_hf_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def moe_model_dir(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random experts, the real tokenizer and chat template: fast, yet text."""
    model_dir = write_hf_model(
        tmp_path_factory.mktemp("moe-model"), "qwen3-moe", seed=5, vocab_size=49152
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_model_dir / name, model_dir / name)
    return model_dir


@pytest.fixture(scope="module")
def moe_mesh(moe_model_dir, tmp_path_factory) -> Iterator[Mesh]:
    yield from start_mesh(moe_model_dir, tmp_path_factory.mktemp("home"), [])


def test_moe_chat_through_the_mesh_equals_the_engine(moe_mesh, moe_model_dir):
    model = moe_mesh.client.models.list().data[0].id
    for message in ("What is the capital of France?", "Name three colours."):
        text, prompt_tokens, completion_tokens = engine_text(moe_model_dir, message, 16)
        reply = moe_mesh.client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": message}],
            max_tokens=16,
            temperature=0,
        )
        assert reply.choices[0].message.content == text
        assert reply.usage.completion_tokens == completion_tokens
        assert reply.usage.prompt_tokens == prompt_tokens
