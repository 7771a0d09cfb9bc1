"""`EngineThread`: `stop` joins a built engine's thread; one still building its engine
(weights loading) is left behind at once, and `still_loading` says so, so a worker told to
stop while it loads stops then and not once its model is in memory. Prompts queued while a
step runs keep a prefill worker's backlog raised across the step's end. A command that comes
while a step waits for cores is applied before that step. Starting the thread shortens the
process's GIL switch interval, so that a step waits less for the loop."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

from services.worker.engine_thread import GIL_SWITCH_INTERVAL_S, EngineThread, still_loading
from shared.engine.outputs import StepOutput
from shared.engine.stats import KVCacheEvents


class IdleEngine:
    """Just what the thread asks of an engine that holds no request."""

    def has_unfinished_requests(self) -> bool:
        return False

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(num_waiting=0)

    def take_kv_events(self) -> KVCacheEvents:
        return KVCacheEvents()

    def close(self) -> None:
        pass  # no tier to remove


def make_thread(build) -> EngineThread:
    return EngineThread(build, on_step=lambda step, step_started: None, on_fatal=lambda exc: None)


def test_stop_joins_the_thread_of_a_built_engine():
    thread = make_thread(IdleEngine)

    async def main() -> None:
        await thread.start()
        await thread.stop()

    asyncio.run(main())
    assert not thread.alive
    assert not still_loading()


def test_start_shortens_the_gil_switch_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # the interpreter's default, as a fresh process has it
    thread = make_thread(IdleEngine)

    async def main() -> float:
        await thread.start()
        try:
            return sys.getswitchinterval()
        finally:
            await thread.stop()

    try:
        assert asyncio.run(main()) == GIL_SWITCH_INTERVAL_S
    finally:
        sys.setswitchinterval(before)


def test_stop_leaves_a_thread_still_loading_its_engine_at_once():
    loaded = threading.Event()

    def slow_build() -> IdleEngine:
        loaded.wait(30)
        return IdleEngine()

    thread = make_thread(slow_build)

    async def main() -> float:
        starting = asyncio.create_task(thread.start())
        await asyncio.sleep(0.1)
        starting.cancel()  # what a SIGTERM during start-up does (service_loop)
        began = time.monotonic()
        await thread.stop()
        return time.monotonic() - began

    try:
        assert asyncio.run(main()) < 1
        assert thread.alive and still_loading()
    finally:
        loaded.set()
    deadline = time.monotonic() + 10
    while thread.alive:  # built at last, it finds the stop queued and ends
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not still_loading()


class RecordingLease:
    """The CoreLease calls a thread makes, in order (and the steps, logged by the engine)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []

    def acquire(self, interrupted: Callable[[], bool]) -> int | None:
        return 1

    def release(self) -> None:
        pass

    def idle(self) -> None:
        self.log.append(("idle", None))

    def set_backlog(self, backlog: bool) -> None:
        self.log.append(("backlog", backlog))

    def close(self) -> None:
        pass


class BurstEngine:
    """Each step schedules every waiting prompt; the rest of a burst of 4 arrives (is queued
    as commands) while the first step runs."""

    def __init__(self, thread: EngineThread, log: list[tuple[str, object]]) -> None:
        self.thread, self.log = thread, log
        self.waiting = 0
        self.steps_left = 0
        self.burst_sent = False
        self.last_step_num_tokens = 0

    def add(self) -> None:
        self.waiting += 1
        self.steps_left = 2

    def has_unfinished_requests(self) -> bool:
        return self.steps_left > 0

    def run_step(self) -> StepOutput:
        if not self.burst_sent:
            self.burst_sent = True
            for _ in range(3):
                self.thread.post(lambda engine: engine.add(), lambda exc: None)
        self.log.append(("step", self.waiting))
        self.last_step_num_tokens = max(1, self.waiting)
        self.waiting = 0
        self.steps_left -= 1
        return StepOutput()

    def observe_costs(self, costs: object) -> None:
        pass  # no tier to tell

    def close(self) -> None:
        pass

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(num_waiting=self.waiting, num_running=0)

    def take_kv_events(self) -> KVCacheEvents:
        return KVCacheEvents()


def _add_a_prompt_and_run_until(build, lease: RecordingLease, done, meanwhile=None) -> None:
    """An engine thread with `lease` over `build(thread)`: one prompt added, then
    `await meanwhile(thread)` if given, stopped once `done(lease.log)`."""
    thread = EngineThread(
        lambda: build(thread),
        on_step=lambda step, step_started: None,
        on_fatal=lambda exc: None,
        lease=lease,  # type: ignore[arg-type]
    )

    async def main() -> None:
        await thread.start()
        thread.post(lambda engine: engine.add(), lambda exc: None)
        if meanwhile is not None:
            await meanwhile(thread)
        deadline = time.monotonic() + 10
        while not done(lease.log):
            assert time.monotonic() < deadline, lease.log
            await asyncio.sleep(0.01)
        await thread.stop()

    asyncio.run(main())


def test_prompts_queued_during_a_step_keep_the_backlog_raised():
    lease = RecordingLease()
    _add_a_prompt_and_run_until(
        lambda thread: BurstEngine(thread, lease.log), lease, lambda log: ("step", 3) in log
    )
    first, burst = lease.log.index(("step", 1)), lease.log.index(("step", 3))
    between = [value for kind, value in lease.log[first:burst] if kind == "backlog"]
    # a decode worker that looked in between would step beside the burst
    assert between == [True], "the prompts queued during the first step are a backlog"


class ChunkedEngine:
    """One prompt that takes `chunks` steps of the token budget: scheduled by the first, so
    no longer waiting, and running (being prefilled) until the last."""

    def __init__(self, log: list[tuple[str, object]], chunks: int = 3) -> None:
        self.log = log
        self.chunks = chunks
        self.waiting, self.running, self.chunks_left = 0, 0, 0
        self.last_step_num_tokens = 0

    def add(self) -> None:
        self.waiting, self.chunks_left = 1, self.chunks

    def has_unfinished_requests(self) -> bool:
        return self.chunks_left > 0

    def run_step(self) -> StepOutput:
        self.waiting, self.chunks_left = 0, self.chunks_left - 1
        self.running = int(self.chunks_left > 0)  # held once its first token is out
        self.log.append(("step", self.chunks_left))
        self.last_step_num_tokens = 256
        return StepOutput()

    def observe_costs(self, costs: object) -> None:
        pass  # no tier to tell

    def close(self) -> None:
        pass

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(num_waiting=self.waiting, num_running=self.running)

    def take_kv_events(self) -> KVCacheEvents:
        return KVCacheEvents()


def test_a_prompt_prefilled_in_part_keeps_the_backlog_raised():
    lease = RecordingLease()

    def last_step_observed(log: list[tuple[str, object]]) -> bool:
        return ("step", 0) in log and any(
            kind == "backlog" for kind, _ in log[log.index(("step", 0)) :]
        )

    _add_a_prompt_and_run_until(lambda thread: ChunkedEngine(lease.log), lease, last_step_observed)
    first, last = lease.log.index(("step", 2)), lease.log.index(("step", 0))
    between = [value for kind, value in lease.log[first:last] if kind == "backlog"]
    after = [value for kind, value in lease.log[last:] if kind == "backlog"]
    # a decode worker that stepped beside the later chunks would halve their cores
    assert between == [True, True], lease.log
    assert after[:1] == [False], lease.log


class WaitingLease(RecordingLease):
    """The first acquire waits on another worker until a command comes in (`interrupted`)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def acquire(self, interrupted: Callable[[], bool]) -> int | None:
        if self.waiting.is_set():
            return 1
        self.waiting.set()
        give_up = time.monotonic() + 10
        while not interrupted() and time.monotonic() < give_up:
            time.sleep(0.005)
        self.log.append(("interrupted", interrupted()))
        return None


def test_a_command_that_comes_while_a_step_waits_for_cores_goes_first():
    lease = WaitingLease()
    answered_in: list[float] = []

    async def reserve_meanwhile(thread: EngineThread) -> None:
        await asyncio.to_thread(lease.waiting.wait, 10)
        began = time.monotonic()
        # a decode worker's reservation, while its step waits out a prefill backlog
        await thread.call(lambda engine: lease.log.append(("command", None)))
        answered_in.append(time.monotonic() - began)

    _add_a_prompt_and_run_until(
        lambda thread: ChunkedEngine(lease.log, chunks=1),
        lease,
        lambda log: ("step", 0) in log,
        reserve_meanwhile,
    )
    assert answered_in[0] < 2, "answered at once, not once the wait was over"
    order = [entry for entry in lease.log if entry[0] in ("interrupted", "command", "step")]
    assert order == [("interrupted", True), ("command", None), ("step", 0)]
