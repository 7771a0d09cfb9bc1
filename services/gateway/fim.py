"""Fill-in-the-middle prompts: `suffix` on /v1/completions.

A model trained for FIM knows three special tokens. The prompt is laid out in PSM order
(prefix, suffix, middle), as Qwen2.5-Coder and StarCoder were trained:
`<prefix token> prompt <suffix token> suffix <middle token>`, and the model writes the middle
(up to its end-of-text token). The token names are looked up in the tokenizer, Qwen's
`<|fim_prefix|>` style first, then StarCoder's `<fim_prefix>`; a tokenizer with neither
set complete has no FIM. Prompt and suffix are tokenized apart without the tokenizer's
own special tokens (no BOS inside the frame), as llama.cpp's infill does.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

FIM_TOKEN_NAMES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
)


@dataclass(frozen=True, slots=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int

    @classmethod
    def find(cls, tokenizer: Tokenizer) -> FimTokens | None:
        """The first complete set of FIM tokens in `tokenizer`, or None."""
        for names in FIM_TOKEN_NAMES:
            prefix, suffix, middle = (tokenizer.token_to_id(name) for name in names)
            if prefix is not None and suffix is not None and middle is not None:
                return cls(prefix, suffix, middle)
        return None

    def prompt(self, prefix_ids: list[int], suffix_ids: list[int]) -> list[int]:
        """The PSM prompt: the model's output goes between prefix and suffix."""
        return [self.prefix, *prefix_ids, self.suffix, *suffix_ids, self.middle]


def fim_token_names() -> str:
    """The token sets looked for, for error messages."""
    return " or ".join(", ".join(names) for names in FIM_TOKEN_NAMES)
