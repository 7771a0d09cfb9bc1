"""Incremental detokenization with the real tokenizer: equals one decode of everything, and
never shows half a character (emoji and CJK split over several byte-level tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from services.gateway.detokenizer import IncrementalDetokenizer
from tests.e2e.conftest import real_model_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.e2e
TEXTS = [
    "Hello, world! How are you today?",
    "Emoji: 😀🚀 and 👩‍👩‍👧 family",
    "中文字符测试，日本語のテキスト",
    "  leading spaces\nnew lines\ttabs   ",
]


@pytest.fixture(scope="module")
def tokenizer(real_model_dir: Path) -> Tokenizer:  # noqa: F811
    return Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_pieces_join_to_the_full_decode(tokenizer: Tokenizer, text: str, step: int) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_multibyte_character_waits_for_its_last_byte(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("😀", add_special_tokens=False).ids
    assert len(ids) > 1, "the emoji should take several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "😀"


def test_special_tokens_are_skipped(tokenizer: Tokenizer) -> None:
    eos = tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode("Done.", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids) + detok.add([eos]) + detok.flush() == "Done."


def test_flush_shows_an_incomplete_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a😀", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer)
    shown = detok.add(ids[:-1])
    assert shown + detok.flush() == tokenizer.decode(ids[:-1])
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")
