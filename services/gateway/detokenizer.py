"""Incremental detokenization: text appears as soon as it is complete, never a broken character.

As vLLM does it: decode a short window of ids twice, with and without the newest ones, and
emit the difference. The window starts at the previous read position, so tokenizers that
drop a leading space on the first token (SentencePiece) still give the same text as one
decode of everything. A multi-byte character split over tokens decodes to U+FFFD until
its last byte arrives, so text ending in U+FFFD is held back. `keep` names special tokens
shown even when the others are skipped (Mistral's `[TOOL_CALLS]`, which its tool-call
parser reads).
"""

from __future__ import annotations

from tokenizers import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        keep: frozenset[int] = frozenset(),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.keep = keep if skip_special_tokens else frozenset()
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
        window = self.token_ids[self.prefix_offset :]
        prefix = self.token_ids[self.prefix_offset : self.read_offset]
        return self._decode(prefix), self._decode(window)

    def _decode(self, ids: list[int]) -> str:
        skip = self.skip_special_tokens
        if not self.keep.intersection(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=skip)
        text, run = "", []
        for token_id in [*ids, -1]:  # -1: ends the last run
            if token_id in self.keep or token_id < 0:
                text += self.tokenizer.decode(run, skip_special_tokens=skip) if run else ""
                text += self.tokenizer.id_to_token(token_id) if token_id >= 0 else ""
                run = []
            else:
                run.append(token_id)
        return text
