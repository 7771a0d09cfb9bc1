"""The worker as a state machine: an engine thread that sleeps while nothing can move, engine
errors sorted into bad requests and internal failures, and a request table that ends empty
whatever ends a request (finish, cancel, a dead engine, a drain). Real workers in-process
over a real nats-server, as in test_worker.py."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest

from services.worker.runtime import Worker
from shared.bus import Bus
from shared.engine.engine import LLMEngine
from shared.engine.request_check import RequestChecker
from shared.engine.sampling_params import SamplingParams
from shared.protocol import (
    Cancel,
    DecodeTask,
    Heartbeat,
    Outcome,
    PrefillTask,
    Reservation,
    Reserve,
    SubmitRequest,
    TaskAck,
    TokenChunk,
)
from shared.subjects import Subjects
from tests.integration.test_worker import GREEDY, PROMPT, nats_only, until, worker_config

LONG_PROMPT = [(3 * i) % 250 + 3 for i in range(100)]  # 7 blocks of 16
OTHER_PROMPT = [(5 * i) % 250 + 3 for i in range(100)]  # as long, no prefix in common
LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)


class Bench:
    """One in-process worker plus the test's side of the bus (scheduler and gateway)."""

    def __init__(self, worker: Worker, bus: Bus, subjects: Subjects) -> None:
        self.worker = worker
        self.bus = bus
        self.subjects = subjects
        self.chunks: dict[str, list[TokenChunk]] = {}
        self.beats: list[Heartbeat] = []

    async def on_tokens(self, chunk: TokenChunk, headers: dict[str, str]) -> None:
        self.chunks.setdefault(chunk.request_id, []).append(chunk)

    async def on_beat(self, beat: Heartbeat, headers: dict[str, str]) -> None:
        self.beats.append(beat)

    def request(self, request_id: str, prompt=PROMPT, params=GREEDY) -> SubmitRequest:
        return SubmitRequest(request_id, "gw", list(prompt), params, time.time() + 60)

    async def prefill(self, request: SubmitRequest, decode_worker: str = "silent") -> TaskAck:
        task = PrefillTask(request, decode_worker, 0)
        return await self.bus.request(
            self.subjects.prefill(self.worker.config.worker_id), task, TaskAck, 5
        )

    def errors(self, request_id: str) -> list[str]:
        return [c.error for c in self.chunks.get(request_id, []) if c.error]


def run_bench(nats_url: str, model_dir: Path, role: str, scenario, engine=None, **overrides):
    async def main() -> None:
        namespace = f"s{time.monotonic_ns()}"
        config = worker_config(nats_url, namespace, role, model_dir)
        config = replace(config, engine=replace(config.engine, **(engine or {})), **overrides)
        worker = Worker(config, transport_factory=nats_only)
        await worker.start()
        bus = await Bus.connect(nats_url, "test")
        bench = Bench(worker, bus, Subjects(namespace))
        await bus.subscribe(bench.subjects.tokens("gw"), TokenChunk, bench.on_tokens)
        await bus.subscribe(bench.subjects.heartbeat, Heartbeat, bench.on_beat)
        # A decode worker that never acknowledges KV: a prefill's blocks stay held.
        await bus.nc.subscribe(bench.subjects.kv("silent"), cb=_ignore)
        try:
            await scenario(bench)
        finally:
            await worker.shutdown()
            await bus.close()

    asyncio.run(main())


async def _ignore(msg) -> None:
    return None


def test_a_worker_whose_queue_cannot_be_admitted_uses_no_cpu(nats_server, tiny_model_dir):
    """The first prompt's blocks are held by a transfer nobody acknowledges, so the second
    cannot be admitted: the engine thread sleeps (no step, no copy of the prefix cache)
    until a command changes something, here the Cancel that frees the blocks."""

    async def scenario(bench: Bench) -> None:
        assert (await bench.prefill(bench.request("held", LONG_PROMPT))).ok
        await until(lambda: "held" in bench.chunks)  # first token out: blocks held
        assert (await bench.prefill(bench.request("waiting", OTHER_PROMPT))).ok
        await until(lambda: bench.beats and bench.beats[-1].num_waiting == 1)
        await asyncio.sleep(0.3)
        wall, cpu = time.monotonic(), time.process_time()
        await asyncio.sleep(3.0)
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        assert cpu < 0.15 * wall, f"{cpu:.2f} s of CPU in {wall:.2f} s while nothing can run"
        assert "waiting" not in bench.chunks
        await bench.bus.publish(bench.subjects.cancel, Cancel("held", "client gone"))
        await until(lambda: "waiting" in bench.chunks, timeout=10)  # admitted at once
        await bench.bus.publish(bench.subjects.cancel, Cancel("waiting", "client gone"))
        await until(lambda: not len(bench.worker.table))
        bench.beats.clear()
        await until(lambda: bench.beats and bench.beats[-1].free_blocks == 8)
        assert bench.beats[-1].num_requests == 0

    run_bench(
        nats_server.url,
        tiny_model_dir,
        "prefill",
        scenario,
        engine={"num_kv_blocks": 8},
        heartbeat_interval=0.5,
        transfer_timeout=60.0,
    )


def test_internal_engine_errors_are_failures_and_bad_requests_are_invalid(
    nats_server, tiny_model_dir, monkeypatch
):
    """A bug inside the engine (here a ValueError, which once meant "invalid") answers
    FAILED, so the scheduler tries elsewhere and the client never sees a 400; a request
    the engine refuses on its merits answers INVALID with the engine's reason."""

    async def scenario(bench: Bench) -> None:
        subject = bench.subjects.reserve("both")
        bad = bench.request("bad", [0, 10**6])
        reply = await bench.bus.request(subject, Reserve(bad), Reservation, 5)
        assert reply.outcome == Outcome.INVALID and "token ids must be in" in reply.error
        ack = await bench.prefill(bench.request("bad-task", [0, 10**6]))
        assert ack.outcome == Outcome.INVALID and "token ids must be in" in ack.error

        def broken(*args, **kwargs):
            raise ValueError("a bug, not the request")

        monkeypatch.setattr(RequestChecker, "check", broken)
        ack = await bench.prefill(bench.request("victim"))
        assert ack.outcome == Outcome.FAILED and "internal error" in ack.error
        monkeypatch.setattr(LLMEngine, "reserve", broken)
        reply = await bench.bus.request(subject, Reserve(bench.request("victim2")), Reservation, 5)
        assert reply.outcome == Outcome.FAILED and "internal error" in reply.error
        assert not len(bench.worker.table)

    run_bench(nats_server.url, tiny_model_dir, "both", scenario)


def test_a_repeated_reserve_gets_the_reservation_it_holds_back(nats_server, tiny_model_dir):
    """A scheduler that lost the first answer (timeout, the worker briefly taken for lost)
    asks again: the same attempt gets the same reservation, not a refusal while it lives on;
    another attempt of the same id is still refused, and one reservation is held, not two."""

    async def scenario(bench: Bench) -> None:
        subject = bench.subjects.reserve("both")
        request = bench.request("again", LONG_PROMPT)
        first = await bench.bus.request(subject, Reserve(request), Reservation, 5)
        assert first.ok and first.num_blocks > 0
        stats = bench.worker.ctx.engine.stats()
        again = await bench.bus.request(subject, Reserve(request), Reservation, 5)
        assert (again.outcome, again.num_blocks, again.num_cached_blocks) == (
            Outcome.OK,
            first.num_blocks,
            first.num_cached_blocks,
        )
        assert again.transports == first.transports
        assert len(bench.worker.table) == 1
        after = bench.worker.ctx.engine.stats()
        assert (after.num_reserved, after.free_blocks) == (stats.num_reserved, stats.free_blocks)
        other = await bench.bus.request(
            subject, Reserve(replace(request, attempt=1)), Reservation, 5
        )
        assert other.outcome == Outcome.UNAVAILABLE and "duplicate request id" in other.error

    run_bench(nats_server.url, tiny_model_dir, "both", scenario)


def test_an_engine_that_dies_fails_every_request_so_gateways_migrate(
    nats_server, tiny_model_dir, monkeypatch
):
    """A step that raises stops the engine: each request it held gets an error chunk (the
    gateway's cue to migrate it), the table empties and `failed` is set (the process exits
    non-zero and is restarted)."""

    async def scenario(bench: Bench) -> None:
        for name in ("a", "b"):
            assert (await bench.prefill(bench.request(name, LONG_PROMPT, LONG))).ok
        await until(lambda: "a" in bench.chunks and "b" in bench.chunks)  # both held
        real_step = LLMEngine.run_step

        def step(engine: LLMEngine):
            if engine.has_unfinished_requests():
                raise RuntimeError("kernel exploded")
            return real_step(engine)

        monkeypatch.setattr(LLMEngine, "run_step", step)
        assert (await bench.prefill(bench.request("c", PROMPT, LONG))).ok
        await asyncio.wait_for(bench.worker.failed.wait(), timeout=10)
        await until(lambda: all(bench.errors(name) for name in ("a", "b", "c")))
        assert all("internal error" in bench.errors(n)[0] for n in ("a", "b", "c"))
        assert not len(bench.worker.table)

    run_bench(nats_server.url, tiny_model_dir, "prefill", scenario, transfer_timeout=60.0)


@pytest.mark.parametrize("role", ["both", "prefill"])
def test_a_drain_past_its_grace_fails_what_is_left_so_it_migrates(
    nats_server, tiny_model_dir, role
):
    """SIGTERM's drain: new work is refused; what is still in flight when the grace period
    ends gets an error chunk (so its gateway migrates it), and the table ends empty."""

    async def scenario(bench: Bench) -> None:
        if role == "both":
            task = bench.request("long", PROMPT, LONG)
            subject = bench.subjects.decode("both")
            ack = await bench.bus.request(subject, DecodeTask(task), TaskAck, 5)
        else:
            ack = await bench.prefill(bench.request("long", LONG_PROMPT, LONG))
        assert ack.ok
        await until(lambda: "long" in bench.chunks)
        shutdown = asyncio.create_task(bench.worker.shutdown())
        await until(lambda: bench.worker.ctx is not None and bench.worker.ctx.draining)
        refused = await bench.prefill(bench.request("late"))
        assert refused.outcome == Outcome.UNAVAILABLE and refused.error == "draining"
        await shutdown
        assert bench.errors("long") == ["the worker is shutting down"]
        assert not len(bench.worker.table)

    run_bench(
        nats_server.url,
        tiny_model_dir,
        role,
        scenario,
        grace_period=0.05,
        transfer_timeout=60.0,
    )
