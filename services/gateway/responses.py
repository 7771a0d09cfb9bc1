"""OpenAI response bodies: chat.completion(.chunk) and text_completion, logprobs included."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from services.gateway.generation import Delta, Finish, Usage
from services.gateway.openai_schema import Kind
from services.gateway.prompting import ModelText
from shared.protocol import TokenLogprob


@dataclass(slots=True)
class ResponseBuilder:
    """Shapes one choice's events; `text_offset` tracks completions' logprob offsets."""

    kind: Kind
    request_id: str
    model: str
    text: ModelText
    index: int = 0  # the choice's index (n > 1)
    prefix: str = ""  # text before the output: the prompt, for completions with echo
    created: int = field(default_factory=lambda: int(time.time()))
    text_offset: int = 0

    def chunk(self, delta: Delta | None, finish: Finish | None, first: bool) -> dict[str, Any]:
        """One streamed chunk; `first` adds the assistant role (chat)."""
        choice: dict[str, Any] = {"index": self.index}
        text = (self.prefix if first else "") + (delta.text if delta else "")
        if self.kind == "chat":
            choice["delta"] = {"role": "assistant", "content": text} if first else {}
            if text:
                choice["delta"]["content"] = text
        else:
            choice["text"] = text
        choice["logprobs"] = self.logprobs(delta.logprobs) if delta and delta.logprobs else None
        choice["finish_reason"] = finish.reason if finish else None
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._envelope([], chunk=True) | {"usage": usage.as_dict()}

    def full(self, deltas: list[Delta], finish: Finish) -> dict[str, Any]:
        """The non-streamed body."""
        text = self.prefix + "".join(d.text for d in deltas)
        logprobs = [lp for d in deltas for lp in d.logprobs]
        choice: dict[str, Any] = {"index": self.index}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self.logprobs(logprobs) if logprobs else None
        choice["finish_reason"] = finish.reason
        return self._envelope([choice], chunk=False) | {"usage": finish.usage.as_dict()}

    def logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        token = self.text.token_text
        if self.kind == "chat":
            return {
                "content": [
                    _chat_logprob(token(e.token_id), e.logprob)
                    | {"top_logprobs": [_chat_logprob(token(t), lp) for t, lp in e.top]}
                    for e in entries
                ]
            }
        tokens = [token(e.token_id) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        return {
            "id": prefix + self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def _chat_logprob(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def total_usage(finishes: list[Finish]) -> Usage:
    """One request's usage over its choices: the prompt once, every choice's output."""
    return Usage(finishes[0].usage.prompt_tokens, sum(f.usage.completion_tokens for f in finishes))
