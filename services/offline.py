"""Offline chat generation with the engine in this process (`splitserve generate`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from shared.models.chat_template import load_chat_template, load_special_tokens, render_chat


def chat_prompt_ids(model_dir: Path, tokenizer: Tokenizer, user_message: str) -> list[int]:
    """Token ids of a one-message chat, rendered with the model's own template."""
    text = render_chat(
        load_chat_template(model_dir),
        [{"role": "user", "content": user_message}],
        add_generation_prompt=True,
        **load_special_tokens(model_dir),
    )
    return tokenizer.encode(text, add_special_tokens=False).ids


def stream_chat(
    model_dir: Path, user_message: str, params: SamplingParams, engine: LLMEngine | None = None
) -> Iterator[str]:
    """Yield the reply's text piece by piece (special tokens such as eos are not shown)."""
    engine = engine or LLMEngine(EngineConfig(model_dir=model_dir, kv_cache_gib=0.25))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    engine.add_request("chat", chat_prompt_ids(model_dir, tokenizer, user_message), params)
    output_ids: list[int] = []
    shown = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            output_ids.extend(out.new_token_ids)
        text = tokenizer.decode(output_ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # a multi-byte character still incomplete
            yield text[len(shown) :]
            shown = text
