"""`suffix` on /v1/completions: fill-in-the-middle prompts from tokenizers built here (a
byte-level BPE like the tiny test tokenizer, with or without FIM special tokens added)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from services.gateway.errors import ApiError
from services.gateway.fim import FimTokens
from services.gateway.openai_schema import parse_request
from services.gateway.prompting import ModelText

QWEN = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
STARCODER = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]
PROMPT, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"


def byte_tokenizer(special: list[str]) -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>", *special])
    return tokenizer


def model_text(tmp_path: Path, special: list[str]) -> ModelText:
    byte_tokenizer(special).save(str(tmp_path / "tokenizer.json"))
    return ModelText.load(tmp_path)


@pytest.mark.parametrize("names", [QWEN, STARCODER])
def test_suffix_builds_the_psm_prompt(tmp_path: Path, names: list[str]) -> None:
    text = model_text(tmp_path, ["<fim_pad>", *names])
    pre, suf, mid = (text.tokenizer.token_to_id(name) for name in names)
    assert text.fim == FimTokens(pre, suf, mid)
    encode = text.tokenizer.encode
    ids = text.completion_prompt_ids(PROMPT, SUFFIX)
    assert ids == [pre, *encode(PROMPT).ids, suf, *encode(SUFFIX).ids, mid]
    # What a model card's FIM string gives once tokenized: the same ids.
    assert ids == encode(f"{names[0]}{PROMPT}{names[1]}{SUFFIX}{names[2]}").ids
    assert text.tokenizer.decode(ids, skip_special_tokens=True) == PROMPT + SUFFIX
    prompt_ids = encode(PROMPT).ids  # a prompt given as token ids is framed alike
    assert text.completion_prompt_ids(prompt_ids, SUFFIX) == ids
    assert text.completion_prompt_ids(PROMPT, "") == prompt_ids  # empty suffix: plain prompt


def test_qwen_tokens_win_when_both_sets_are_there(tmp_path: Path) -> None:
    text = model_text(tmp_path, STARCODER + QWEN)
    assert text.fim is not None
    assert text.fim.prefix == text.tokenizer.token_to_id("<|fim_prefix|>")


@pytest.mark.parametrize("special", [[], ["<fim_prefix>", "<fim_suffix>"], ["<|fim_middle|>"]])
def test_suffix_without_fim_tokens_is_a_400_naming_it(tmp_path: Path, special: list[str]) -> None:
    text = model_text(tmp_path, special)
    assert text.fim is None
    with pytest.raises(ApiError) as info:
        text.completion_prompt_ids(PROMPT, SUFFIX)
    assert (info.value.status, info.value.param) == (400, "suffix")
    assert "no fill-in-the-middle tokens" in info.value.message
    assert "<|fim_prefix|>" in info.value.message and "<fim_middle>" in info.value.message
    assert text.completion_prompt_ids(PROMPT) == text.tokenizer.encode(PROMPT).ids


def test_suffix_is_parsed_for_completions_only() -> None:
    body = {"model": "m", "prompt": PROMPT}
    assert parse_request("completion", body | {"suffix": SUFFIX}).suffix == SUFFIX
    assert parse_request("completion", body | {"suffix": None}).suffix == ""
    with pytest.raises(ApiError) as info:
        parse_request("completion", body | {"suffix": 3})
    assert info.value.param == "suffix"
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "suffix": "x"}
    with pytest.raises(ApiError) as info:
        parse_request("chat", chat)
    assert info.value.param == "suffix"
