"""Chaos (DESIGN.md section 6): `splitserve up` as real processes on a real nats-server,
the tiny random model with the real tokenizer. Workers are SIGKILLed or SIGTERMed under
load, nats-server restarts, the gateway is flooded. Every stream completes or fails with a
clear error, none hangs, migrated streams equal the engine's own tokens, and afterwards
every worker's free KV blocks are back at their totals. Each test prints one `CHAOS` line
(completed / failed / hung, the longest pause a client saw) for the README's table.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from shared.nats_server import NatsServer, start_nats_server
from tests.e2e.test_mesh import Mesh, mesh_model_dir, start_mesh  # noqa: F401 (a fixture)
from tests.engine_harness import run_to_completion

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STREAMS = 16
MAX_TOKENS = 100


@dataclass(slots=True)
class Outcome:
    text: str = ""
    finish: str | None = None
    error: str = ""  # "hung": no answer by the test's deadline
    max_gap: float = 0.0  # longest pause between two chunks, seconds


@dataclass(frozen=True, slots=True)
class Job:
    prompt: list[int]  # token ids: the same on the mesh and the reference engine
    seed: int | None  # None: greedy


def make_jobs(tag: int) -> list[Job]:
    """Fresh prompts per test (no prefix-cache hits from earlier tests); odd ones seeded."""
    rng = random.Random(tag)
    return [
        Job([rng.randrange(100, 49000) for _ in range(40 + 7 * i)], i if i % 2 else None)
        for i in range(STREAMS)
    ]


def sampling(job: Job) -> SamplingParams:
    # Seeded draws are exact functions of (seed, position), and with batch-invariant matmuls
    # (the default) so are the logits they read, whatever the batch, chunking or worker.
    # At temperature 0.8 the random tiny model's distribution is nearly flat (no token holds
    # 0.1% of the mass), so the inverse-CDF draw is as sensitive to the logits' last bits as
    # it gets: with torch's matmuls such noise moved a draw every few hundred.
    temperature = 0.8 if job.seed is not None else 0.0
    return SamplingParams(
        temperature=temperature, seed=job.seed, max_tokens=MAX_TOKENS, ignore_eos=True
    )


def reference(model_dir: Path, jobs: list[Job]) -> list[str]:
    """Each job's text from the engine alone, without any failure."""
    engine = LLMEngine(EngineConfig(model_dir=model_dir, num_kv_blocks=1024))
    for i, job in enumerate(jobs):
        engine.add_request(str(i), job.prompt, sampling(job))
    tokens = run_to_completion(engine)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tokenizer.decode(tokens[str(i)], skip_special_tokens=True) for i in range(len(jobs))]


def complete(mesh: Mesh, job: Job, timeout: float, stream: bool):
    """`job` as one completion request (its seed and sampling, MAX_TOKENS, no retries): the
    chunk stream when `stream`, else the reply."""
    client = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key="x", timeout=timeout, max_retries=0)
    extra = {"ignore_eos": True} | ({"seed": job.seed} if job.seed is not None else {})
    return client.completions.create(
        model=mesh_model_name(mesh),
        prompt=job.prompt,
        max_tokens=MAX_TOKENS,
        temperature=sampling(job).temperature,
        stream=stream,
        extra_body=extra,
    )


def stream_one(
    mesh: Mesh, job: Job, progress: list[int], slot: int, timeout: float = 60
) -> Outcome:
    outcome, pieces, last = Outcome(), [], time.monotonic()
    try:
        stream = complete(mesh, job, timeout, stream=True)
        for chunk in stream:
            now = time.monotonic()
            outcome.max_gap, last = max(outcome.max_gap, now - last), now
            progress[slot] += 1
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
                outcome.finish = chunk.choices[0].finish_reason or outcome.finish
    except openai.APIError as exc:
        outcome.error = str(exc) or type(exc).__name__
    outcome.text = "".join(pieces)
    return outcome


def mesh_model_name(mesh: Mesh) -> str:
    return mesh.client.models.list().data[0].id


def run_load(
    mesh: Mesh, jobs: list[Job], fault: Callable[[], None], after_chunks: int, limit: float = 90
) -> list[Outcome]:
    """Stream every job at once; call `fault` once every stream has `after_chunks` chunks
    (or after 10 s); a stream without an answer `limit` seconds in counts as hung."""
    progress = [0] * len(jobs)
    pool = concurrent.futures.ThreadPoolExecutor(len(jobs))
    futures = [pool.submit(stream_one, mesh, job, progress, i) for i, job in enumerate(jobs)]
    give_up = time.monotonic() + 10
    while min(progress) < after_chunks and time.monotonic() < give_up:
        time.sleep(0.02)
    fault()
    deadline = time.monotonic() + limit
    outcomes = []
    for future in futures:
        try:
            outcomes.append(future.result(max(0.1, deadline - time.monotonic())))
        except concurrent.futures.TimeoutError:
            outcomes.append(Outcome(error="hung"))
    pool.shutdown(wait=False, cancel_futures=True)
    return outcomes


def report(name: str, outcomes: list[Outcome]) -> tuple[int, int, int]:
    hung = sum(o.error == "hung" for o in outcomes)
    failed = sum(bool(o.error) for o in outcomes) - hung
    done = len(outcomes) - failed - hung
    gap = max(o.max_gap for o in outcomes)
    print(f"\nCHAOS {name}: completed={done} failed={failed} hung={hung} max_gap={gap:.1f}s")
    for o in outcomes:
        if o.error:
            print(f"  error: {o.error}")
    return done, failed, hung


def assert_same_texts(jobs: list[Job], outcomes: list[Outcome], expected: list[str]) -> None:
    """Each stream's text equals the engine's; a mismatch names the stream and where."""
    wrong = []
    for i, (job, outcome, text) in enumerate(zip(jobs, outcomes, expected, strict=True)):
        if outcome.text != text:
            at = next(
                (k for k, (a, b) in enumerate(zip(outcome.text, text, strict=False)) if a != b),
                None,
            )
            at = min(len(outcome.text), len(text)) if at is None else at
            kind = "greedy" if job.seed is None else f"seed {job.seed}"
            wrong.append(
                f"stream {i} ({kind}) differs at char {at}: got "
                f"{outcome.text[at - 20 : at + 30]!r}, engine {text[at - 20 : at + 30]!r}"
            )
    assert not wrong, "\n".join(wrong)


def worker_pid(mesh: Mesh, worker_id: str) -> int:
    """The pid of this mesh's worker process with exactly this id."""
    nats = f":{mesh.nats_port}".encode()
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if worker_id.encode() in argv and any(nats in arg for arg in argv):
            return int(entry.name)
    raise AssertionError(f"no process for worker {worker_id}")


def wait_replaced(mesh: Mesh, killed: str, timeout: float = 30) -> None:
    """Wait until the scheduler has dropped the killed worker and registered its restart
    (`<id>-r<n>`), so the next test starts on a whole mesh."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ids = {w.heartbeat.worker_id for w in mesh.status().workers}
        if killed not in ids and any(i.startswith(f"{killed}-r") for i in ids):
            return
        time.sleep(0.5)
    raise AssertionError(f"{killed} was not replaced within {timeout}s: {ids}")


def assert_blocks_return(mesh: Mesh, workers: int, timeout: float = 30) -> None:
    """Every live worker (heard from in the last 2.5 s) idle with all its blocks free and
    nothing left in its request table."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = [w.heartbeat for w in mesh.status().workers if time.time() - w.last_seen < 2.5]
        idle = all(
            b.free_blocks == b.total_blocks and not b.num_running and not b.num_requests
            for b in live
        )
        if len(live) == workers and idle:
            return
        time.sleep(0.5)
    raise AssertionError(f"blocks not returned: {live}")


@pytest.fixture(scope="module")
def two_by_two(mesh_model_dir, tmp_path_factory) -> Iterator[Mesh]:  # noqa: F811
    yield from start_mesh(
        mesh_model_dir, tmp_path_factory.mktemp("chaos-a"), ["--prefill", "2", "--decode", "2"]
    )


def test_decode_worker_sigkill_mid_stream(two_by_two, mesh_model_dir):  # noqa: F811
    jobs = make_jobs(1)
    expected = reference(mesh_model_dir, jobs)
    kill = lambda: os.kill(worker_pid(two_by_two, "decode-0"), signal.SIGKILL)  # noqa: E731
    outcomes = run_load(two_by_two, jobs, kill, after_chunks=10)
    assert report("decode SIGKILL", outcomes)[0] == STREAMS
    assert [o.finish for o in outcomes] == ["length"] * STREAMS
    assert_same_texts(jobs, outcomes, expected)
    wait_replaced(two_by_two, "decode-0")
    assert_blocks_return(two_by_two, 4)


def test_prefill_worker_sigkill(two_by_two, mesh_model_dir):  # noqa: F811
    jobs = make_jobs(2)
    expected = reference(mesh_model_dir, jobs)
    kill = lambda: os.kill(worker_pid(two_by_two, "prefill-0"), signal.SIGKILL)  # noqa: E731
    outcomes = run_load(two_by_two, jobs, kill, after_chunks=0)
    assert report("prefill SIGKILL", outcomes)[0] == STREAMS
    # Stream 5 of these jobs has a seeded draw (token 40) whose inverse-CDF margin is 1.1e-6:
    # it holds only because the mesh's logits are bitwise the engine's (batch-invariant
    # matmuls, on by default), whatever the batches and chunks the fault leads to.
    assert_same_texts(jobs, outcomes, expected)
    wait_replaced(two_by_two, "prefill-0")
    assert_blocks_return(two_by_two, 4)


def test_prefill_worker_sigterm_drains_and_exits_0(two_by_two):
    jobs = make_jobs(3)
    pid = worker_pid(two_by_two, "prefill-1")
    outcomes = run_load(two_by_two, jobs, lambda: os.kill(pid, signal.SIGTERM), after_chunks=0)
    assert report("prefill SIGTERM", outcomes)[0] == STREAMS
    deadline = time.monotonic() + 30
    while "worker prefill-1 exited with" not in two_by_two.log_path.read_text():
        assert time.monotonic() < deadline, "prefill-1 did not exit"
        time.sleep(0.2)
    assert "worker prefill-1 exited with 0" in two_by_two.log_path.read_text()
    assert_blocks_return(two_by_two, 4)


@dataclass(slots=True)
class OwnNats:
    server: NatsServer
    data_dir: Path

    def restart(self) -> None:
        self.server.stop()
        self.server = start_nats_server(self.data_dir, self.server.port)


@pytest.fixture(scope="module")
def own_nats(tmp_path_factory) -> Iterator[OwnNats]:
    data_dir = tmp_path_factory.mktemp("chaos-nats")
    nats = OwnNats(start_nats_server(data_dir), data_dir)
    yield nats
    nats.server.stop()


@pytest.fixture(scope="module")
def one_by_one(mesh_model_dir, tmp_path_factory, own_nats) -> Iterator[Mesh]:  # noqa: F811
    """1 prefill + 1 decode on a nats-server the test owns; a gateway queue of 8."""
    settings = {"SPLITSERVE_MAX_PENDING": "8", "SPLITSERVE_STALL_TIMEOUT": "15"}
    os.environ.update(settings)
    try:
        home = tmp_path_factory.mktemp("chaos-b")
        for mesh in start_mesh(mesh_model_dir, home, ["--nats", own_nats.server.url]):
            mesh.nats_port = own_nats.server.port
            yield mesh
    finally:
        for name in settings:
            os.environ.pop(name)


def test_single_decode_worker_killed_and_restarted(one_by_one):
    jobs = make_jobs(4)[:8]
    kill = lambda: os.kill(worker_pid(one_by_one, "decode-0"), signal.SIGKILL)  # noqa: E731
    outcomes = run_load(one_by_one, jobs, kill, after_chunks=10)
    done, _, hung = report("single decode SIGKILL + restart", outcomes)
    assert hung == 0 and done == len(jobs), [o.error for o in outcomes]
    assert_blocks_return(one_by_one, 2)


def wait_for_scheduler(mesh: Mesh, timeout: float = 30) -> None:
    """Until the scheduler answers a status query again (after a NATS restart)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            mesh.status()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_nats_server_restart_under_load(one_by_one, own_nats):
    jobs = make_jobs(5)[:8]
    outcomes = run_load(one_by_one, jobs, own_nats.restart, after_chunks=10)
    hung = report("nats-server restart", outcomes)[2]
    assert hung == 0
    assert all(o.finish == "length" or o.error for o in outcomes)
    wait_for_scheduler(one_by_one)  # its reconnect may trail the gateway's: 503s meanwhile
    after = run_load(one_by_one, make_jobs(6)[:4], lambda: None, after_chunks=0)
    assert report("after nats restart", after)[0] == 4
    assert_blocks_return(one_by_one, 2)


def test_flood_gets_fast_429s_and_no_5xx(one_by_one):
    jobs = make_jobs(7) * 3
    started = time.monotonic()
    outcomes = run_load(one_by_one, jobs, lambda: None, after_chunks=0)
    refused = [o for o in outcomes if "429" in o.error]
    others = [o for o in outcomes if o.error and "429" not in o.error]
    report("flood (48 requests, queue 8)", outcomes)
    assert refused and not others
    assert all(o.finish == "length" for o in outcomes if not o.error)
    assert time.monotonic() - started < 60
    assert_blocks_return(one_by_one, 2)
