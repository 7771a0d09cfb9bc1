"""`n` choices per request: one mesh request per choice, their events merged by index.

Each choice is its own request on the mesh (id `<request id>-<index>`); a seeded request
gives choice i the seed `seed + i`, so choices differ and each is reproducible. Choices
submitted together share the prompt's KV blocks through the prefix cache only once the
first has computed them (prefix-aware routing sends them to the same workers).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing

from services.gateway.generation import Delta, Finish, Mesh, Submitted
from shared.engine.sampling_params import SamplingParams

_SEED_RANGE = 2**63


async def submit_choices(
    mesh: Mesh,
    request_id: str,
    prompt_ids: list[int],
    sampling: SamplingParams,
    stop: tuple[str, ...],
    n: int,
) -> list[Submitted]:
    """Submit the n choices; if one is refused, cancel those already accepted and re-raise."""
    if n == 1:
        return [await mesh.submit(request_id, prompt_ids, sampling, stop)]
    jobs: list[Submitted] = []
    try:
        for index in range(n):
            params = sampling
            if sampling.seed is not None:
                params = dataclasses.replace(sampling, seed=(sampling.seed + index) % _SEED_RANGE)
            jobs.append(await mesh.submit(f"{request_id}-{index}", prompt_ids, params, stop))
    except BaseException:
        for job in jobs:
            await mesh.abandon(job)
        raise
    return jobs


async def merged_events(
    mesh: Mesh, jobs: list[Submitted]
) -> AsyncIterator[tuple[int, Delta | Finish]]:
    """(choice index, event) from every job as they come; ends after the last Finish.
    A failure in one choice ends them all (the others are cancelled as their streams close)."""
    if len(jobs) == 1:
        async with aclosing(mesh.events(jobs[0])) as events:
            async for event in events:
                yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Delta | Finish | BaseException]] = asyncio.Queue()

    async def pump(index: int, job: Submitted) -> None:
        try:
            async with aclosing(mesh.events(job)) as events:
                async for event in events:
                    await queue.put((index, event))
        except Exception as exc:
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        left = len(jobs)
        while left:
            index, event = await queue.get()
            if isinstance(event, BaseException):
                raise event
            left -= isinstance(event, Finish)
            yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
