"""`n` choices per request: one mesh request per choice, their events merged by index.

Each choice is its own request on the mesh (id `<request id>-<index>` when n > 1); a seeded
request gives choice i the seed `seed + i` (an unseeded one draws a seed per choice), so
choices differ and each is reproducible.

The prompt's KV blocks are shared as vLLM's parallel sampling shares them, through the
prefix cache: choice 0 is submitted alone, and the other choices once its first token has
arrived. Its prompt's full blocks are then in its prefill worker's cache, prefix-aware routing
sends the siblings there (or, once the blocks have reached the decode worker, to decode
alone) and each sibling computes only its uncached tail. Choice 0 failing before its first
token fails the request (once migration gives up) and no sibling is ever submitted; a
sibling the scheduler refuses is retried for up to the stall timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from services.gateway.gateway_request import GatewayRequest, OutputText, RequestSpec
from services.gateway.model_client import ModelClient
from services.gateway.refusals import Failure, GenerationFailed, Refused
from services.gateway.token_events import Delta, Finish, token_events
from shared.engine.sampling_params import SamplingParams

_SEED_RANGE = 2**63


@dataclass(frozen=True, slots=True)
class Choices:
    """What every choice of one request is submitted with."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...]
    n: int
    output: OutputText = OutputText()  # noqa: RUF009  (frozen)
    has_fallback: bool = False  # the router has another target to try after this model
    tenant: str = ""  # the caller's (limits.tenant_of)
    priority: int = 0

    def request_id_of(self, index: int) -> str:
        return self.request_id if self.n == 1 else f"{self.request_id}-{index}"

    def sampling_of(self, index: int) -> SamplingParams:
        if self.sampling.seed is None or index == 0:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=(self.sampling.seed + index) % _SEED_RANGE)

    def spec_of(self, index: int) -> RequestSpec:
        return RequestSpec(
            self.request_id_of(index),
            self.prompt_ids,
            self.sampling_of(index),
            self.stop,
            self.output,
            self.has_fallback,
            self.tenant,
            self.priority,
        )

    async def submit(
        self, client: ModelClient, index: int, retry_for: float = 0.0
    ) -> GatewayRequest:
        """Choice `index`; Refused after `retry_for` seconds of retries (for choice 0, before
        any reply is started: the client's 429 or 503, or the next target's turn)."""
        return await client.submit(self.spec_of(index), retry_for)


async def merged_events(
    client: ModelClient, choices: Choices, first: GatewayRequest
) -> AsyncIterator[tuple[int, Delta | Finish]]:
    """(choice index, event) from every choice as they come; ends after the last Finish.
    The siblings are submitted once `first` has its first token. A failure in one choice
    ends them all (every submitted choice is cancelled as this generator closes)."""
    if choices.n == 1:
        async with aclosing(token_events(client, first)) as events:
            async for event in events:
                yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Delta | Finish | BaseException]] = asyncio.Queue()
    jobs = [first]

    async def pump(index: int, job: GatewayRequest) -> None:
        try:
            async with aclosing(token_events(client, job)) as events:
                async for event in events:
                    await queue.put((index, event))
        except Exception as exc:
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(0, first))]

    async def submit_siblings() -> None:
        index = 0
        try:
            # Choice 0's events end by its stall timeout or deadline at the latest: then either
            # this is set, or they failed and closing this generator cancels the wait.
            await first.first_token.wait()
            for index in range(1, choices.n):
                job = await choices.submit(client, index, client.config.stall_timeout)
                jobs.append(job)
                tasks.append(asyncio.create_task(pump(index, job)))
        except Refused as exc:
            refused = GenerationFailed(f"choice {index} was refused: {exc}", Failure.REFUSED, exc)
            await queue.put((index, refused))
        except Exception as exc:
            await queue.put((index, exc))

    launcher = asyncio.create_task(submit_siblings())
    try:
        left = choices.n
        while left:
            index, event = await queue.get()
            if isinstance(event, BaseException):
                raise event
            left -= isinstance(event, Finish)
            yield index, event
    finally:
        launcher.cancel()
        await asyncio.gather(launcher, return_exceptions=True)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for job in jobs:  # those whose pump never ran (cancelled before it started)
            await client.abandon(job)
