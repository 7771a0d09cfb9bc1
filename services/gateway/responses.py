"""OpenAI response bodies: chat.completion(.chunk) and text_completion, logprobs included.

With tools, a chat choice's text goes through its ToolCallStream: content and `tool_calls`
(deltas when streamed), and finish_reason `tool_calls` when the model stopped after calling.
With `continuous_usage_stats` every streamed chunk carries the usage so far. Prompt
logprobs (`prompt_scores.py`) come with the first chunk: vLLM's `prompt_logprobs` on the
choice (completions) or the body (chat), echo's scored prompt in a completion's logprobs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from services.gateway.openai_schema import Kind
from services.gateway.prompt_scores import PromptScoring, echoed_rows, vllm_prompt_logprobs
from services.gateway.prompting import ModelText
from services.gateway.token_events import Delta, Finish, Usage
from services.gateway.tool_stream import ToolCallStream
from shared.protocol import PromptTokenLogprob, TokenLogprob


@dataclass(slots=True)
class ResponseBuilder:
    """Shapes one choice's events; `text_offset` tracks completions' logprob offsets."""

    kind: Kind
    request_id: str
    model: str
    text: ModelText
    index: int = 0  # the choice's index (n > 1)
    prefix: str = ""  # text before the output: the prompt, for completions with echo
    tools: ToolCallStream | None = None  # chat with tools: parses the output
    num_prompt_tokens: int | None = None  # set: every chunk carries the usage so far
    scoring: PromptScoring | None = None  # the request asked for prompt logprobs
    created: int = field(default_factory=lambda: int(time.time()))
    text_offset: int = 0
    completion_tokens: int = 0  # streamed so far

    def chunk(self, delta: Delta | None, finish: Finish | None, first: bool) -> dict[str, Any]:
        """One streamed chunk; `first` adds the assistant role (chat)."""
        choice: dict[str, Any] = {"index": self.index}
        prompt = delta.prompt_logprobs if delta else []
        delta, finish = self._output(delta), self._finish(finish)
        text = (self.prefix if first else "") + (delta.text if delta else "")
        if self.kind == "chat":
            calls: list[dict[str, Any]] = []
            if self.tools is not None:
                text, calls = self.tools.feed(text, final=finish is not None)
            choice["delta"] = {"role": "assistant", "content": text} if first else {}
            if text:
                choice["delta"]["content"] = text
            if calls:
                choice["delta"]["tool_calls"] = calls
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(delta.logprobs if delta else [], prompt)
        called = self.tools is not None and self.tools.called
        choice["finish_reason"] = _finish_reason(finish, called) if finish else None
        body = self._with_prompt_logprobs(self._envelope([choice], chunk=True), prompt)
        if self.num_prompt_tokens is not None:
            self.completion_tokens += len(delta.token_ids) if delta else 0
            if finish is not None:  # it counts tokens that added no text (end of turn)
                self.completion_tokens = finish.usage.completion_tokens
            body["usage"] = Usage(self.num_prompt_tokens, self.completion_tokens).as_dict()
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._envelope([], chunk=True) | {"usage": usage.as_dict()}

    def full(self, deltas: list[Delta], finish: Finish) -> dict[str, Any]:
        """The non-streamed body."""
        prompt = [lp for d in deltas for lp in d.prompt_logprobs]
        deltas = [] if self.scoring and self.scoring.score_only else deltas
        finish = self.finished(finish)
        text = self.prefix + "".join(d.text for d in deltas)
        logprobs = [lp for d in deltas for lp in d.logprobs]
        choice: dict[str, Any] = {"index": self.index}
        calls = []
        if self.kind == "chat":
            if self.tools is not None:
                text, calls = self.tools.calls(text)
            choice["message"] = {"role": "assistant", "content": text or None if calls else text}
            if calls:
                choice["message"]["tool_calls"] = [c.as_dict() for c in calls]
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(logprobs, prompt)
        choice["finish_reason"] = _finish_reason(finish, bool(calls))
        body = self._envelope([choice], chunk=False) | {"usage": finish.usage.as_dict()}
        return self._with_prompt_logprobs(body, prompt)

    def finished(self, finish: Finish) -> Finish:
        """The finish as the client sees it: with max_tokens 0, no output was asked."""
        if not (self.scoring and self.scoring.score_only):
            return finish
        return Finish("length", Usage(finish.usage.prompt_tokens, 0))

    def _finish(self, finish: Finish | None) -> Finish | None:
        return None if finish is None else self.finished(finish)

    def _output(self, delta: Delta | None) -> Delta | None:
        return None if self.scoring and self.scoring.score_only else delta

    def _logprobs(
        self, entries: list[TokenLogprob], prompt: list[PromptTokenLogprob]
    ) -> dict[str, Any] | None:
        echoed = prompt if self.scoring and self.scoring.echoed else []
        return self.logprobs(entries, echoed) if entries or echoed else None

    def _with_prompt_logprobs(
        self, body: dict[str, Any], prompt: list[PromptTokenLogprob]
    ) -> dict[str, Any]:
        """vLLM's prompt_logprobs: on the choice for completions, on the body for chat."""
        if not (prompt and self.scoring and self.scoring.listed):
            return body
        listed = vllm_prompt_logprobs(self.text, prompt)
        if self.kind == "chat":
            return body | {"prompt_logprobs": listed}
        body["choices"][0]["prompt_logprobs"] = listed
        return body

    def logprobs(
        self, entries: list[TokenLogprob], prompt: list[PromptTokenLogprob] | None = None
    ) -> dict[str, Any]:
        token = self.text.token_text
        if self.kind == "chat":
            return {
                "content": [
                    _chat_logprob(token(e.token_id), e.logprob)
                    | {"top_logprobs": [_chat_logprob(token(t), lp) for t, lp in e.top]}
                    for e in entries
                ]
            }
        rows = (
            echoed_rows(self.text, self.scoring.first_token_id, prompt)
            if prompt and self.scoring
            else []
        )
        rows += [(token(e.token_id), e.logprob, {token(t): lp for t, lp in e.top}) for e in entries]
        offsets = []
        for t, _, _ in rows:
            offsets.append(self.text_offset)
            self.text_offset += len(t)
        return {
            "tokens": [t for t, _, _ in rows],
            "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [top for _, _, top in rows],
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


def _finish_reason(finish: Finish, called: bool) -> str:
    return "tool_calls" if called and finish.reason == "stop" else finish.reason


def _chat_logprob(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def total_usage(finishes: list[Finish]) -> Usage:
    """One request's usage over its choices: the prompt once, every choice's output."""
    return Usage(finishes[0].usage.prompt_tokens, sum(f.usage.completion_tokens for f in finishes))
