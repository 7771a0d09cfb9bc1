"""The path by the objectives (`--path-choice slo`): which path keeps the new request and
the decode worker's running streams within the TTFT and TPOT objectives. path_cost.py
predicts each path's TTFT and the stall a local prefill inflicts; this module judges them.

- local keeps the objectives when its predicted TTFT is within the TTFT objective and the
  running streams' predicted TPOT is within the TPOT one: decode step + (the stall seconds
  the worker's streams took lately + this prefill's) / the tokens a stream emits.
- split keeps them when its predicted TTFT is within the TTFT objective (the decode worker's
  streams are not held: the prompt is computed elsewhere).
The verdict: a path that keeps them beats one that does not; when both or neither do, the
cost rule decides (`stall_weight`), except that when neither does and the decode worker runs
streams, split: the new request is late either way, the running streams need not be.

The one subtle rule: a stall is spread over a stream's whole output, and the scheduler does
not see the running streams' lengths, so the request being placed stands for them (its
`max_tokens`, at least MIN_STREAM_TOKENS: the requests of one deployment are alike); the
stall seconds the worker reports (decayed over a stream's life, step_costs.py) stand for what
its running streams have taken already.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_STREAM_TOKENS = 16  # a stall is never spread thinner than over this many tokens


@dataclass(frozen=True, slots=True)
class Objectives:
    ttft_s: float = 0.0  # 0: no objectives (the cost rule alone)
    tpot_s: float = 0.0
    stream_tokens: int = 0  # tokens a stream emits (the request being placed stands for all)

    def __bool__(self) -> bool:
        return self.ttft_s > 0 and self.tpot_s > 0


def streams_tpot(decode_step_s: float, stall_s: float, prefill_s: float, tokens: int) -> float:
    """A running stream's predicted TPOT when a prefill of `prefill_s` is added to the
    `stall_s` its worker's streams took lately."""
    return decode_step_s + (stall_s + prefill_s) / max(MIN_STREAM_TOKENS, tokens - 1)


def prefer_local(
    objectives: Objectives,
    local_ttft: float,
    split_ttft: float,
    streams: int,
    streams_tpot_s: float,
    cheaper_local: bool,
) -> bool:
    """The verdict above; `cheaper_local` is the cost rule's."""
    local_keeps = local_ttft <= objectives.ttft_s and streams_tpot_s <= objectives.tpot_s
    split_keeps = split_ttft <= objectives.ttft_s
    if local_keeps != split_keeps:
        return local_keeps
    if not local_keeps and streams:
        return False
    return cheaper_local
