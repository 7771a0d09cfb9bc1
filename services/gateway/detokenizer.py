"""Incremental detokenization: text appears as soon as it is complete, never a broken character.

As vLLM does it: decode a short window of ids twice, with and without the newest ones, and
emit the difference. The window starts at the previous read position, so tokenizers that
drop a leading space on the first token (SentencePiece) still give the same text as one
decode of everything. A multi-byte character split over tokens decodes to U+FFFD until
its last byte arrives, so text ending in U+FFFD is held back.
"""

from __future__ import annotations

from tokenizers import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # the window of ids decoded each time starts here
        self.read_offset = 0  # ids before this are already shown as text

    def add(self, token_ids: list[int]) -> str:
        """The new text that `token_ids` complete (possibly "")."""
        self.token_ids.extend(token_ids)
        prefix_text, full_text = self._window()
        if len(full_text) <= len(prefix_text) or full_text.endswith(_INCOMPLETE):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character shows as U+FFFD)."""
        prefix_text, full_text = self._window()
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]

    def _window(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        window = self.token_ids[self.prefix_offset :]
        prefix = self.token_ids[self.prefix_offset : self.read_offset]
        skip = self.skip_special_tokens
        return decode(prefix, skip_special_tokens=skip), decode(window, skip_special_tokens=skip)
