"""Issue 60, case 6: KV-pool exhaustion and preemption under overload (`make chaos`), through
`splitserve up` with a tiny KV pool (`--num-kv-blocks 24`: one long stream and a little
more).

- More streams than the pool holds (one or two at a time; the line's `--queue-timeout` is
  the default 60 s; 16 streams took 17 s, and 36 s beside builds and a soak): each waits
  in the scheduler's line until a decode worker has room for its prompt, or runs and is
  preempted (recomputed) when the running ones outgrow the pool, and resumes. None fails;
  every one is the engine's own text (seeded ones too: a draw is a function of seed and
  position); the decode worker counts its preemptions (`Heartbeat.num_preemptions`); every
  block comes back.
- A flood past `--max-queue`: the only refusals are the scheduler's documented ones (429,
  "scheduler busy" past `--max-queue`, "scheduler overloaded" past `--shed-share` of it;
  503 past `--queue-timeout`), each with Retry-After; every request taken completes,
  identical.
- With `--queue-timeout 1`: a request no worker has room for within it is refused 503 with
  Retry-After, never sooner; the others complete, identical.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from tests.e2e.test_chaos import (
    STREAMS,
    Job,
    assert_blocks_return,
    assert_same_texts,
    complete,
    make_jobs,
    reference,
)
from tests.e2e.test_mesh import Mesh, mesh_model_dir, start_mesh  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.chaos]
POOL_BLOCKS = 24
MAX_QUEUE = 24  # shedding starts at --shed-share (0.75) of it: 18
QUEUE_TIMEOUT_S = 1.0  # the impatient mesh's
PATIENT_S = 60.0  # the tiny pool's --queue-timeout (the default): above the longest wait seen


def tiny_pool_flags(*extra: str) -> list[str]:
    flags = ["--prefill", "1", "--decode", "1", "--path-choice", "fixed"]
    return flags + ["--num-kv-blocks", str(POOL_BLOCKS), *extra]


@pytest.fixture(scope="module")
def tiny_pool(mesh_model_dir, tmp_path_factory) -> Iterator[Mesh]:  # noqa: F811
    home = tmp_path_factory.mktemp("chaos-pool")
    flags = tiny_pool_flags("--max-queue", str(MAX_QUEUE), "--queue-timeout", str(PATIENT_S))
    yield from start_mesh(mesh_model_dir, home, flags)


@dataclass(slots=True)
class Answer:
    text: str = ""
    finish: str | None = None
    status: int = 200  # the HTTP status of a refusal
    retry_after: str | None = None  # its Retry-After header
    error: str = ""
    seconds: float = 0.0  # sent → answered (refused or last chunk)


def send(mesh: Mesh, job: Job) -> Answer:
    """One streamed request, recording a refusal's status and Retry-After."""
    answer, pieces, started = Answer(), [], time.monotonic()
    try:
        stream = complete(mesh, job, PATIENT_S + 60, stream=True)
        for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
                answer.finish = chunk.choices[0].finish_reason or answer.finish
    except openai.APIStatusError as exc:
        answer.status, answer.error = exc.status_code, exc.message
        answer.retry_after = exc.response.headers.get("retry-after")
    except openai.APIError as exc:
        answer.status, answer.error = 0, str(exc)  # failed after it was taken
    answer.text, answer.seconds = "".join(pieces), time.monotonic() - started
    return answer


def flood(mesh: Mesh, jobs: list[Job]) -> list[Answer]:
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: send(mesh, job), jobs))


def print_answers(name: str, answers: list[Answer]) -> None:
    by_status: dict[int, int] = {}
    for answer in answers:
        by_status[answer.status] = by_status.get(answer.status, 0) + 1
    print(f"\nCHAOS {name}: {dict(sorted(by_status.items()))}")
    for answer in answers:
        if answer.status not in (200, 429, 503):
            print(f"  {answer.status}: {answer.error}")


def preemptions(mesh: Mesh) -> int:
    return sum(w.heartbeat.num_preemptions for w in mesh.status().workers)


def test_more_streams_than_the_pool_holds_wait_or_are_preempted_and_none_fails(
    tiny_pool,
    mesh_model_dir,  # noqa: F811
):
    jobs = make_jobs(90)  # 16: all taken (under 18), far more than fit in the pool at once
    expected = reference(mesh_model_dir, jobs)
    before = preemptions(tiny_pool)
    answers = flood(tiny_pool, jobs)
    print_answers(f"KV pool of {POOL_BLOCKS} blocks, {len(jobs)} streams", answers)
    assert [a.status for a in answers] == [200] * len(jobs), [a.error for a in answers]
    assert [a.finish for a in answers] == ["length"] * len(jobs)
    assert_same_texts(jobs, answers, expected)  # type: ignore[arg-type] (text is all it reads)
    print(f"  longest: {max(a.seconds for a in answers):.0f} s")
    deadline = time.monotonic() + 10  # the count rides on the next heartbeat
    while (preempted := preemptions(tiny_pool) - before) == 0:
        assert time.monotonic() < deadline, "no stream was preempted: the pool was not full"
        time.sleep(0.5)
    print(f"  preemptions: {preempted}")
    assert_blocks_return(tiny_pool, 2)


def test_a_flood_past_the_queue_limit_is_refused_429_with_retry_after_only(
    tiny_pool,
    mesh_model_dir,  # noqa: F811
):
    jobs = make_jobs(91) * 3  # 48 at once: 2x --max-queue
    expected = reference(mesh_model_dir, jobs[:STREAMS]) * 3
    rejected = tiny_pool.status().rejected
    answers = flood(tiny_pool, jobs)
    print_answers(f"flood of {len(jobs)}, --max-queue {MAX_QUEUE}, {POOL_BLOCKS} blocks", answers)
    refused = [a for a in answers if a.status == 429]
    timed_out = [a for a in answers if a.status == 503]  # waited past --queue-timeout
    assert refused, "the flood met no limit"
    assert all(a.status in (200, 429, 503) for a in answers), [a.error for a in answers]
    assert all(a.retry_after and int(a.retry_after) >= 1 for a in refused + timed_out)
    limits = ("request refused: scheduler busy", "request refused: scheduler overloaded")
    assert all(any(limit in a.error for limit in limits) for a in refused), refused
    assert all("no worker had room" in a.error for a in timed_out), timed_out
    # each refusal is one of the scheduler's (the gateway's --max-pending is 256)
    assert tiny_pool.status().rejected - rejected == len(refused) + len(timed_out)
    taken = [(a, text) for a, text in zip(answers, expected, strict=True) if a.status == 200]
    assert [(a.finish, a.text) for a, _ in taken] == [("length", text) for _, text in taken]
    assert_blocks_return(tiny_pool, 2)


@pytest.fixture(scope="module")
def impatient(mesh_model_dir, tmp_path_factory) -> Iterator[Mesh]:  # noqa: F811
    home = tmp_path_factory.mktemp("chaos-pool-timeout")
    flags = tiny_pool_flags("--queue-timeout", str(QUEUE_TIMEOUT_S))
    yield from start_mesh(mesh_model_dir, home, flags)


def test_a_request_with_no_room_for_the_queue_timeout_is_refused_503_with_retry_after(
    impatient,
    mesh_model_dir,  # noqa: F811
):
    jobs = make_jobs(92)
    expected = reference(mesh_model_dir, jobs)
    answers = flood(impatient, jobs)
    print_answers(f"{len(jobs)} at once, --queue-timeout {QUEUE_TIMEOUT_S} s", answers)
    refused = [a for a in answers if a.status == 503]
    assert refused, "every request found room within the queue timeout"
    assert all(a.status in (200, 503) for a in answers), [a.error for a in answers]
    assert all(a.retry_after and int(a.retry_after) >= 1 for a in refused)
    assert all("no worker had room" in a.error for a in refused), [a.error for a in refused]
    assert all(a.seconds >= QUEUE_TIMEOUT_S for a in refused)
    for job, answer, text in zip(jobs, answers, expected, strict=True):
        if answer.status == 200:
            assert (answer.finish, answer.text) == ("length", text), job.seed
    assert_blocks_return(impatient, 2)
