"""Closed-loop users in the style of Locust: user classes with weighted tasks and waits.

A scenario is a tuple of `UserClass`es. Each task builds the `BenchRequest` a user sends;
after each reply the user waits `wait_time()` seconds and picks its next task by weight.
Users start at `spawn_rate` per second up to `users`; at `run_time` no new request starts
and the runner waits for those in flight.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from loadtest.client import ClientConfig, send_request
from loadtest.openloop import RunResult
from loadtest.progress import Progress
from loadtest.request import BenchRequest, RequestRecord

WaitTime = Callable[[random.Random], float]


def between(low: float, high: float) -> WaitTime:
    """Wait a uniform random time in [low, high] seconds, as Locust's `between`."""
    return lambda rng: rng.uniform(low, high)


def constant(seconds: float) -> WaitTime:
    return lambda rng: seconds


@dataclass(slots=True, frozen=True)
class Task:
    name: str
    make: Callable[[random.Random], BenchRequest]
    weight: int = 1


@dataclass(slots=True, frozen=True)
class UserClass:
    name: str
    tasks: tuple[Task, ...]
    wait_time: WaitTime
    weight: int = 1

    def pick(self, rng: random.Random) -> Task:
        return rng.choices(self.tasks, weights=[t.weight for t in self.tasks])[0]


@dataclass(slots=True, frozen=True)
class UsersConfig:
    users: int = 10
    spawn_rate: float = 1.0  # users started per second
    run_time_s: float = 60.0
    seed: int = 0
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.users < 1 or self.spawn_rate <= 0 or self.run_time_s <= 0:
            raise ValueError("users, spawn rate and run time must be positive")


def assign_classes(classes: tuple[UserClass, ...], n: int) -> list[UserClass]:
    """n users spread over the classes in proportion to their weights, interleaved."""
    total = sum(c.weight for c in classes)
    out: list[UserClass] = []
    counts = dict.fromkeys(range(len(classes)), 0)
    for i in range(n):
        # the class furthest below its share of the first i + 1 users goes next
        k = max(counts, key=lambda j: classes[j].weight * (i + 1) / total - counts[j])
        counts[k] += 1
        out.append(classes[k])
    return out


async def run_users(
    client: ClientConfig, cfg: UsersConfig, scenario: tuple[UserClass, ...], label: str = ""
) -> RunResult:
    records: list[RequestRecord] = []
    progress = Progress(0, label) if cfg.show_progress else None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        deadline = start + cfg.run_time_s

        async def user(index: int, cls: UserClass) -> None:
            rng = random.Random(f"{cfg.seed}-{index}")
            await asyncio.sleep(index / cfg.spawn_rate)
            while time.perf_counter() < deadline:
                task = cls.pick(rng)
                record = await send_request(session, client, task.make(rng))
                records.append(record)
                if progress:
                    progress.update(record.ok)
                left = max(0.0, deadline - time.perf_counter())
                await asyncio.sleep(min(cls.wait_time(rng), left))

        classes = assign_classes(scenario, cfg.users)
        await asyncio.gather(*(user(i, c) for i, c in enumerate(classes)))
    if progress:
        progress.close()
    end = max((r.end for r in records), default=start)
    return RunResult(records, start, end - start)
