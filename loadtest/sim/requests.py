"""One simulated request (`SimRequest`, from arrival to its last token) and its part on one
worker (`SimSeq`).

A request passes through, in order: waiting (in the scheduler's line, when no worker has
room) → placed (local: one worker prefills and decodes it; split: a prefill worker computes
the prompt and sends its first token, the KV moves, the decode worker decodes) → done, or
failed (no room before the scheduler's queue timeout). Its record is what the load harness
would have seen: send, first token, last token, tokens out.

The one subtle rule: a split request has two `SimSeq`s, one per worker, each holding its own
blocks; the prefill one ends when its KV has moved, the decode one when the reply is whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from loadtest.request import RequestRecord
from services.scheduler.routing import blocks_for


@dataclass(slots=True)
class SimRequest:
    request_id: str
    label: str
    tokens: list[int]  # the prompt
    hashes: list[int]  # its full blocks' chained hashes
    output_len: int
    send: float  # arrival, seconds of simulated time
    first_token: float = -1.0  # when the first token left (-1: not yet)
    last_token: float = -1.0
    output_tokens: int = 0
    error: str = ""
    path: str = ""  # "local" | "split", once placed

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)

    @property
    def done(self) -> bool:
        return bool(self.error) or self.output_tokens >= self.output_len

    def record(self) -> RequestRecord:
        chunks = [t for t in (self.first_token, self.last_token) if t >= 0]
        if len(chunks) == 2 and self.output_tokens < 2:
            chunks = chunks[:1]
        return RequestRecord(
            self.label,
            self.send,
            chunk_times=chunks,
            prompt_tokens=self.prompt_len,
            output_tokens=self.output_tokens,
            usage_reported=True,
            error=self.error,
            end=self.last_token if self.last_token >= 0 else self.send,
        )


class SeqKind(IntEnum):
    LOCAL = 0  # prefills, then decodes, on one worker
    PREFILL = 1  # split, prefill side: the prompt and the first token, then its KV moves
    DECODE = 2  # split, decode side: reserved, then decodes once its KV is in


@dataclass(slots=True)
class SimSeq:
    request: SimRequest
    kind: SeqKind
    blocks: int  # held on its worker
    computed: int = 0  # prompt tokens computed (cached ones count)
    decode_to: str = ""  # PREFILL: the decode worker its KV goes to
    missing_blocks: int = 0  # PREFILL: blocks the decode worker lacks (what moves)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.request.prompt_len

    @property
    def context(self) -> int:
        """Tokens a decode row reads: the prompt and the tokens out so far."""
        return self.request.prompt_len + self.request.output_tokens


def blocks_of(request: SimRequest, block_size: int, with_reply: bool) -> int:
    tokens = request.prompt_len + (request.output_len if with_reply else 0)
    return blocks_for(tokens, block_size)
