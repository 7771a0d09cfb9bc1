"""Roles that change while serving (DESIGN.md section 9), over a real nats-server with a
real scheduler and real workers (tests/integration/roles_harness.py): a worker drops a role
without failing a request (its streams finish, or with `hurry` migrate and stay exact),
nothing is placed on it mid-change, its new role is announced and served; a worker killed
mid-change is lost like any other; SetRole's refusals."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import pytest
from nats.errors import NoRespondersError

from services import role_cli
from services.cli import build_parser
from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.protocol import (
    Cancel,
    DecodeTask,
    Heartbeat,
    Outcome,
    PrefillTask,
    SetRole,
    SubmitRequest,
    TaskAck,
)
from tests.engine_harness import run_to_completion
from tests.integration.roles_harness import RoleMesh, Stream, role_mesh
from tests.integration.test_worker import until, worker_config
from tests.integration.test_worker_states import LONG, LONG_PROMPT, Bench, run_bench

STEP_S = 0.02  # each engine step slowed to this, so streams outlast a role change's start


def prompt(i: int) -> list[int]:
    """50 tokens, none shared with another i's: every prompt is prefilled afresh."""
    return [(11 * i + 7 * k) % 250 + 3 for k in range(50)]


def params(i: int, max_tokens: int) -> SamplingParams:
    """Odd: seeded at temperature 0.8 (exact across a migration only as a pure function of
    seed and position); even: greedy."""
    if i % 2:
        return SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture
def slow_steps(monkeypatch):
    step = LLMEngine.run_step

    def slow(engine: LLMEngine):
        time.sleep(STEP_S)
        return step(engine)

    monkeypatch.setattr(LLMEngine, "run_step", slow)


async def submit_all(mesh: RoleMesh, ids: range, max_tokens: int) -> None:
    for i in ids:
        ack = await mesh.gateway.submit(f"r{i}", prompt(i), params(i, max_tokens))
        assert ack.accepted, ack


def assert_exact(streams: dict[str, Stream], model_dir: Path, max_tokens: int) -> None:
    """Every stream's tokens are what one engine, undisturbed, makes of its request (all in
    one batch: on the CPU the matmuls are batch-invariant)."""
    config = worker_config("", "x", "both", model_dir).engine_config()
    engine = LLMEngine(replace(config, num_kv_blocks=1024, max_num_seqs=len(streams)))
    for request_id in streams:
        i = int(request_id[1:])
        engine.add_request(request_id, prompt(i), params(i, max_tokens))
    expected = run_to_completion(engine)
    for request_id, stream in streams.items():
        assert stream.tokens == expected[request_id], (request_id, stream.failures)


@pytest.mark.parametrize("hurry", [False, True], ids=["finish", "hurry"])
def test_a_decode_worker_becomes_a_prefill_worker_while_streams_run(
    nats_server, tiny_model_dir, slow_steps, hurry
):
    """Its streams finish there (or, hurried, migrate to the other decode worker and stay
    exact); what arrives meanwhile goes elsewhere; then it prefills for the mesh."""
    max_tokens = 120

    async def main() -> dict[str, Stream]:
        roles = {"d1": "decode", "d2": "decode", "p1": "prefill"}
        async with role_mesh(nats_server.url, tiny_model_dir, roles) as mesh:
            streams = mesh.gateway.streams
            await submit_all(mesh, range(4), max_tokens)
            await until(lambda: all(len(s.tokens) >= 3 for s in streams.values()))
            target = streams["r0"].placements[0].decode_worker
            on_target = [s for s in streams.values() if s.placements[0].decode_worker == target]
            assert (await mesh.set_role(target, "prefill", hurry)).ok
            if not hurry:  # (hurried, the change is over within a poll)
                await mesh.scheduler_sees(target, "decode", "prefill")
                assert not ended(on_target), "the change began after its streams"
                await submit_all(mesh, range(4, 7), max_tokens)  # mid-change: elsewhere
                for i in range(4, 7):
                    (ack,) = streams[f"r{i}"].placements
                    assert target not in (ack.decode_worker, ack.prefill_worker), ack
            await mesh.gateway.finished()
            migrated = {s.request_id for s in streams.values() if s.failures}
            if hurry:
                assert migrated == {s.request_id for s in on_target}
                assert all(s.failures == ["changing role"] for s in on_target)
            else:
                assert not migrated, [s.failures for s in streams.values()]

            await until(lambda: mesh.announced(target, "prefill"))
            with pytest.raises(NoRespondersError):  # its decode subjects are closed
                await mesh.bus.request(
                    mesh.subjects.decode(target), DecodeTask(_solo()), TaskAck, 2
                )
            await mesh.scheduler_sees(target, "prefill")
            # Idle and uncached, it ties with p1 and wins on its id: it prefills the next.
            ack = await mesh.gateway.submit("r7", prompt(7), params(7, max_tokens))
            assert (ack.prefill_worker, ack.decode_worker) == (target, _other(target)), ack
            await mesh.gateway.finished()
            return streams

    assert_exact(asyncio.run(main()), tiny_model_dir, max_tokens)


def test_a_both_worker_drops_prefill_and_takes_it_back_while_streaming(
    nats_server, tiny_model_dir, slow_steps
):
    """both → decode → both: its streams (decode-only path) run on untouched; the prefill
    subject closes with the first change and opens with the second."""
    max_tokens = 80

    async def main() -> dict[str, Stream]:
        async with role_mesh(nats_server.url, tiny_model_dir, {"b1": "both"}) as mesh:
            streams = mesh.gateway.streams
            await submit_all(mesh, range(3), max_tokens)
            await until(lambda: all(len(s.tokens) >= 2 for s in streams.values()))
            bad = PrefillTask(_solo([0, 10**6]), "b1", 0)  # the engine refuses it: INVALID
            assert await change_role(mesh, "b1", "decode") == (True, "worker b1 serves decode")
            assert mesh.announced("b1", "decode")
            with pytest.raises(NoRespondersError):
                await mesh.bus.request(mesh.subjects.prefill("b1"), bad, TaskAck, 2)
            assert (await mesh.set_role("b1", "both")).ok
            await until(lambda: mesh.announced("b1", "both"))
            answer = await mesh.bus.request(mesh.subjects.prefill("b1"), bad, TaskAck, 2)
            assert answer.outcome == Outcome.INVALID, answer
            assert not ended(streams.values()), "streams ended too soon"
            await submit_all(mesh, range(3, 5), max_tokens)
            await mesh.gateway.finished()
            assert not any(s.failures for s in streams.values())
            ok, message = await change_role(mesh, "nobody", "prefill")
            assert not ok and "worker nobody: no answer" in message
            return streams

    assert_exact(asyncio.run(main()), tiny_model_dir, max_tokens)


def test_a_worker_killed_mid_change_is_lost_and_its_streams_complete_elsewhere(
    nats_server, tiny_model_dir
):
    """A decode worker (its own process) is told to become a prefill worker, then SIGKILLed
    before its streams end: the scheduler declares it lost, the gateway migrates its
    streams to the other decode worker, and every one completes exactly."""
    max_tokens = 600

    async def main() -> dict[str, Stream]:
        async with role_mesh(nats_server.url, tiny_model_dir, {"p1": "prefill"}) as mesh:
            process = _worker_process(mesh, "d1")
            try:
                await mesh.scheduler_sees("d1", "decode", timeout=60)  # torch loads
                streams = mesh.gateway.streams
                await submit_all(mesh, range(4), max_tokens)  # d1: the one decode worker
                await mesh.add_worker("d2", "decode")
                await mesh.scheduler_sees("d2", "decode")
                assert (await mesh.set_role("d1", "prefill")).ok
                await until(lambda: mesh.beats["d1"].next_role == "prefill")
                assert not ended(streams.values()), "too late to kill"
                process.kill()
                await mesh.gateway.finished(timeout=90)
            finally:
                process.kill()
                process.wait(timeout=10)
            assert all(s.failures == ["worker d1 lost"] for s in streams.values())
            return streams

    assert_exact(asyncio.run(main()), tiny_model_dir, max_tokens)


def test_set_role_refusals_and_a_change_waits_for_the_prefills_it_holds(
    nats_server, tiny_model_dir
):
    """An unknown role is INVALID; a second SetRole mid-change and the dropped side's new
    work are UNAVAILABLE, the kept side's work is taken; the change waits for the prefill
    whose KV is held for a transfer, and ends when that ends."""

    async def scenario(bench: Bench) -> None:
        subject = bench.subjects.role("both")

        async def set_role(role: str) -> TaskAck:
            return await bench.bus.request(subject, SetRole(role), TaskAck, 5)

        assert (await bench.prefill(bench.request("held", LONG_PROMPT))).ok  # KV to "silent"
        await until(lambda: "held" in bench.chunks)  # its first token out, its KV held
        refused = await set_role("router")
        assert refused.outcome == Outcome.INVALID and "SetRole.role" in refused.error
        assert (await set_role("decode")).ok
        again = await set_role("both")
        assert again.outcome == Outcome.UNAVAILABLE and "changing role" in again.error
        late = await bench.prefill(bench.request("late"))
        assert (late.outcome, late.error) == (Outcome.UNAVAILABLE, "changing role")
        decode = DecodeTask(bench.request("kept"))
        assert (await bench.bus.request(bench.subjects.decode("both"), decode, TaskAck, 5)).ok

        def last() -> Heartbeat:
            return bench.beats[-1]

        await until(lambda: (last().role, last().next_role) == ("both", "decode"))
        await until(lambda: any(c.finish_reason is not None for c in bench.chunks.get("kept", [])))
        await asyncio.sleep(0.5)  # the held transfer keeps the change waiting
        assert (last().role, last().next_role) == ("both", "decode")
        await bench.bus.publish(bench.subjects.cancel, Cancel("held", "client gone"))
        await until(lambda: (last().role, last().next_role) == ("decode", ""))
        with pytest.raises(NoRespondersError):
            await bench.prefill(bench.request("after"))
        assert not len(bench.worker.table)
        assert bench.worker.config.role == "decode"

    run_bench(nats_server.url, tiny_model_dir, "both", scenario, transfer_timeout=60.0)


async def change_role(mesh: RoleMesh, worker_id: str, role: str) -> tuple[bool, str]:
    """What `splitserve role --worker ID --role ROLE` does, from its own command line."""
    argv = ["role", "--worker", worker_id, "--role", role, "--wait", "20"]
    args = build_parser().parse_args([*argv, "--nats", mesh.url, "--namespace", mesh.namespace])
    return await role_cli.change_role(role_cli.command_from_args(args))


def ended(streams: Iterable[Stream]) -> list[str]:
    return [s.request_id for s in streams if s.finish is not None]


def test_past_its_timeout_a_change_hurries(nats_server, tiny_model_dir):
    """Not told to hurry, a change waits for the running stream `--role-change-timeout`, then
    fails it with an error chunk (its gateway migrates it) and switches."""

    async def scenario(bench: Bench) -> None:
        task = DecodeTask(bench.request("long", params=LONG))
        assert (await bench.bus.request(bench.subjects.decode("decode"), task, TaskAck, 5)).ok
        await until(lambda: "long" in bench.chunks)
        subject = bench.subjects.role("decode")
        started = time.monotonic()
        assert (await bench.bus.request(subject, SetRole("prefill"), TaskAck, 5)).ok
        await until(lambda: bench.errors("long") == ["changing role"])
        assert time.monotonic() - started >= 0.5
        await until(lambda: (bench.beats[-1].role, bench.beats[-1].next_role) == ("prefill", ""))
        assert not len(bench.worker.table)

    run_bench(nats_server.url, tiny_model_dir, "decode", scenario, role_change_timeout=0.5)


def _solo(prompt_ids: list[int] | None = None) -> SubmitRequest:
    ids = prompt_ids if prompt_ids is not None else prompt(99)
    return SubmitRequest("solo", "gw", ids, params(0, 4), time.time() + 30)


def _other(decode_worker: str) -> str:
    return {"d1": "d2", "d2": "d1"}[decode_worker]


def _worker_process(mesh: RoleMesh, worker_id: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "services.worker.cli", "--role", "decode"]
    command += ["--model-dir", str(mesh.model_dir), "--model-name", "tiny"]
    command += ["--worker-id", worker_id, "--num-kv-blocks", "256", "--kv-transport", "nats"]
    command += ["--nats", mesh.url, "--namespace", mesh.namespace]
    return subprocess.Popen(command, cwd=Path(__file__).parents[2])
