"""The model's text side: tokenizer, chat template, special tokens, fill-in-the-middle tokens
(no torch, no transformers)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from services.gateway.errors import invalid
from services.gateway.fim import FimTokens, fim_token_names
from services.gateway.messages import ChatOptions, Message
from services.gateway.openai_schema import Prompt
from services.gateway.tool_parsers import MISTRAL_MARKER
from services.gateway.tool_prompt import parser_for, template_inputs
from services.gateway.tools import ToolRequest
from shared.models.chat_template import (
    ChatTemplateError,
    load_chat_template,
    load_special_tokens,
    render_chat,
)
from shared.models.generation_config import SamplingDefaults, load_sampling_defaults


@dataclass(frozen=True, slots=True)
class ModelText:
    tokenizer: Tokenizer
    chat_template: str | None  # None: the model has none, chat requests are refused
    special_tokens: dict[str, str]
    fim: FimTokens | None  # None: the tokenizer has no fill-in-the-middle tokens
    sampling_defaults: SamplingDefaults  # the model's generation_config.json
    eos_token_ids: tuple[int, ...] = ()  # as the engine reads them; () without config.json

    @classmethod
    def load(cls, model_dir: Path) -> ModelText:
        try:
            template: str | None = load_chat_template(model_dir)
        except ChatTemplateError:
            template = None
        special = load_special_tokens(model_dir) if template else {}
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        return cls(
            tokenizer,
            template,
            special,
            FimTokens.find(tokenizer),
            load_sampling_defaults(model_dir),
            _eos_ids(model_dir),
        )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def chat_prompt_ids(
        self,
        messages: list[Message],
        tools: ToolRequest | None = None,
        options: ChatOptions = ChatOptions(),  # noqa: B008  (frozen)
    ) -> list[int]:
        """Rendered as HF does, tokenized without adding special tokens (the template has them)."""
        return self.tokenizer.encode(
            self.chat_prompt(messages, tools, options), add_special_tokens=False
        ).ids

    def chat_prompt(
        self,
        messages: list[Message],
        tools: ToolRequest | None = None,
        options: ChatOptions = ChatOptions(),  # noqa: B008  (frozen)
    ) -> str:
        """The chat template's text; with continue_final_message it ends where the last
        message's content does, as vLLM does it."""
        if self.chat_template is None:
            raise invalid("this model has no chat template: use /v1/completions", "messages")
        shown, definitions = template_inputs(self.chat_template, messages, tools)
        variables = self.special_tokens | options.template_kwargs
        try:
            text = render_chat(
                self.chat_template, shown, options.add_generation_prompt, definitions, **variables
            )
        except ChatTemplateError as exc:
            raise invalid(f"the chat template refused the messages: {exc}", "messages") from None
        if options.continue_final_message:
            last = shown[-1]["content"]
            end = text.rfind(last) if last else -1
            if end < 0:
                raise invalid(
                    "continue_final_message: the last message's content is empty or not in "
                    "the rendered prompt",
                    "continue_final_message",
                )
            text = text[: end + len(last)]
        return text

    def tool_parser(self, configured: str) -> str:
        """The tool-call parser for this model's replies (`tool_prompt.parser_for`)."""
        return parser_for(self.chat_template or "", configured)

    def tool_markers(self, configured: str) -> tuple[int, ...]:
        """The special tokens the parser reads, which the text must show: Mistral's."""
        marker = self.tokenizer.token_to_id(MISTRAL_MARKER)
        wanted = self.tool_parser(configured) == "mistral" and marker is not None
        return (marker,) if wanted else ()

    def completion_prompt_ids(self, prompt: Prompt, suffix: str = "") -> list[int]:
        """The prompt's ids; with a suffix, the fill-in-the-middle prompt (`fim.py`)."""
        if not isinstance(prompt, str) and max(prompt) >= self.vocab_size:
            raise invalid(
                f"prompt token ids must be below the vocab size {self.vocab_size}", "prompt"
            )
        if not suffix:
            return self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else prompt
        if self.fim is None:
            raise invalid(
                "suffix needs fill-in-the-middle, and this model's tokenizer has no "
                f"fill-in-the-middle tokens ({fim_token_names()})",
                "suffix",
            )
        encode = self.tokenizer.encode
        prefix_ids = (
            encode(prompt, add_special_tokens=False).ids if isinstance(prompt, str) else prompt
        )
        return self.fim.prompt(prefix_ids, encode(suffix, add_special_tokens=False).ids)

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _eos_ids(model_dir: Path) -> tuple[int, ...]:
    """generation_config.json's eos_token_id, else config.json's (as HF and the engine)."""
    value = None
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id", value)
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)
