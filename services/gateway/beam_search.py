"""Beam search (`use_beam_search`, `n` beams, `length_penalty`) as vLLM runs it: over the API.

Each step asks the mesh, for every live beam, one greedy token with the 2 * width best
logprobs of the next position (`prompt + beam` as the prompt, max_tokens 1), all beams at
once; the beams share their common prefix through the prefix cache, as `n` choices do.
Every candidate extends its beam's cumulative logprob; one ending in an end-of-sequence
token is complete (unless ignore_eos), the best `width` of the others live on. After
max_tokens steps (or when no beam lives) the live beams join the complete ones and the
best `width` by score are the choices, best first. Score: cumulative logprob /
(generated tokens, the end-of-sequence token not counted) ** length_penalty. Ties go to
the candidate met first (beam order, then token rank). Limits: no streaming, no stop
strings, structured output or tools; `width` * 2 <= 20 (the logprobs limit);
a step costs one mesh request per beam.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass

from services.gateway.errors import ApiError
from services.gateway.gateway_request import RequestSpec
from services.gateway.model_client import ModelClient
from services.gateway.refusals import GenerationFailed
from services.gateway.token_events import Finish, token_events
from shared.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Beam:
    token_ids: tuple[int, ...]  # generated, the end-of-sequence token included when it ended
    logprob: float  # cumulative
    ended: bool  # by an end-of-sequence token

    def score(self, length_penalty: float) -> float:
        length = max(1, len(self.token_ids) - self.ended)
        return self.logprob / length**length_penalty


async def beam_search(
    client: ModelClient, spec: RequestSpec, width: int, length_penalty: float
) -> list[Beam]:
    """The `width` best beams, best first. `spec.sampling` gives max_tokens, ignore_eos and
    the stop token ids; the rest of the step requests' parameters are fixed (greedy)."""
    sampling = spec.sampling
    step = SamplingParams(
        temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True, seed=0
    )
    ending = set(sampling.stop_token_ids) | set(client.text.eos_token_ids)
    live = [Beam((), 0.0, False)]
    done: list[Beam] = []
    for position in range(sampling.max_tokens):
        tops = await asyncio.gather(
            *(
                _candidates(client, _step_spec(spec, f"-b{position}-{i}", b, step))
                for i, b in enumerate(live)
            )
        )
        grown = []
        for beam, top in zip(live, tops, strict=True):
            for token_id, logprob in top:
                ends = token_id in ending and not sampling.ignore_eos
                new = Beam((*beam.token_ids, token_id), beam.logprob + logprob, ends)
                (done if ends else grown).append(new)
        live = sorted(grown, key=lambda b: b.logprob, reverse=True)[:width]
        if not live:
            break
    ranked = sorted(done + live, key=lambda b: b.score(length_penalty), reverse=True)
    return ranked[:width]


def _step_spec(spec: RequestSpec, suffix: str, beam: Beam, step: SamplingParams) -> RequestSpec:
    """The request for the position after `beam`: its tokens join the prompt."""
    prompt_ids = spec.prompt_ids + list(beam.token_ids)
    return RequestSpec(
        spec.request_id + suffix,
        prompt_ids,
        step,
        has_fallback=spec.has_fallback,
        tenant=spec.tenant,
        priority=spec.priority,
    )


async def _candidates(client: ModelClient, spec: RequestSpec) -> list[tuple[int, float]]:
    """The best (token id, logprob) pairs of the position after `spec.prompt_ids`."""
    job = await client.submit(spec)
    top: list[tuple[int, float]] = []
    try:
        async with aclosing(token_events(client, job)) as events:
            async for event in events:
                if not isinstance(event, Finish) and event.logprobs:
                    top = list(event.logprobs[0].top)
    except GenerationFailed as exc:
        message = f"beam search step failed: {exc}"
        raise GenerationFailed(message, exc.failure, exc.refused) from None
    finally:
        await client.abandon(job)
    if not top:
        raise ApiError(500, "beam search step returned no logprobs", code="generation_failed")
    return top
