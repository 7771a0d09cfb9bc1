"""A prefill worker and a decode worker over a real nats-server; the test plays scheduler
and gateway with `Bus`. Workers run in-process (engine threads, one torch thread each)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families

from services.worker.config import WorkerConfig
from services.worker.runtime import Worker
from shared.bus import Bus
from shared.config import CommonConfig
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from shared.kvtransfer.transfer import TransportFactory
from shared.protocol import (
    Cancel,
    DecodeTask,
    FinishReason,
    Heartbeat,
    KVChunk,
    KVDone,
    PrefillTask,
    Reservation,
    Reserve,
    SubmitRequest,
    TaskAck,
    TokenChunk,
    WorkerLost,
    decode_one_of,
)
from shared.subjects import Subjects
from tests.engine_harness import run_to_completion

NUM_BLOCKS = 64
PROMPT = [(7 * i) % 250 + 3 for i in range(50)]  # 3 full blocks of 16, and 2 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True, logprobs=2)


def worker_config(url: str, namespace: str, role: str, model_dir: Path) -> WorkerConfig:
    engine = EngineConfig(
        model_dir=model_dir, num_kv_blocks=NUM_BLOCKS, max_num_seqs=8, max_num_batched_tokens=64
    )
    return WorkerConfig(
        worker_id=role,
        role=role,
        model_name="tiny",
        engine=engine,
        common=CommonConfig(url, namespace),
        heartbeat_interval=0.1,
        transfer_timeout=10.0,
        grace_period=2.0,
    )


def reference(model_dir: Path, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = LLMEngine(worker_config("", "x", "both", model_dir).engine_config())
    engine.add_request("ref", prompt, params)
    return run_to_completion(engine)["ref"]


class Mesh:
    """Two workers plus the test's scheduler/gateway connection."""

    def __init__(self, bus: Bus, subjects: Subjects, workers: list[Worker] | None = None) -> None:
        self.bus = bus
        self.subjects = subjects
        self.workers = workers or []
        self.chunks: dict[str, list[TokenChunk]] = {}
        self.beats: dict[str, Heartbeat] = {}
        self.blocks_sent: dict[str, int] = {}  # per request, counted on the KV subject

    async def on_tokens(self, chunk: TokenChunk, headers: dict[str, str]) -> None:
        self.chunks.setdefault(chunk.request_id, []).append(chunk)

    async def on_beat(self, beat: Heartbeat, headers: dict[str, str]) -> None:
        self.beats[beat.worker_id] = beat

    def request(self, request_id: str, params: SamplingParams, prompt=PROMPT) -> SubmitRequest:
        return SubmitRequest(request_id, "gw", list(prompt), params, time.time() + 30)

    async def split(self, request: SubmitRequest) -> Reservation:
        """Reserve on decode, then prefill on prefill: the scheduler's disaggregated path."""
        reserve = Reserve(request)
        res = await self.bus.request(self.subjects.reserve("decode"), reserve, Reservation, 5)
        assert res.ok, res.error
        task = PrefillTask(request, "decode", res.num_cached_blocks, res.transports, res.epoch)
        ack = await self.bus.request(self.subjects.prefill("prefill"), task, TaskAck, 5)
        assert ack.ok, ack.error
        return res

    async def tokens(self, request_id: str) -> list[int]:
        await until(
            lambda: any(c.finish_reason is not None for c in self.chunks.get(request_id, []))
        )
        chunks = self.chunks[request_id]
        assert all(not c.error for c in chunks), chunks
        assert [c.index for c in chunks] == list(range(len(chunks)))  # one token per chunk
        return [t for c in chunks for t in c.token_ids]


async def until(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, "timed out"
        await asyncio.sleep(0.02)


def run_mesh(
    nats_url: str,
    model_dir: Path,
    scenario: Callable[[Mesh], Awaitable[None]],
    engine: dict[str, object] | None = None,
    transport_factory: TransportFactory | None = None,
    **overrides: float,
):
    """Run `scenario` against a prefill and a decode worker (configs changed by `overrides`,
    their engines' by `engine`; KV by `transport_factory`'s transport, default the nats
    one); every worker's request table must end empty."""

    async def main() -> None:
        namespace = f"t{time.monotonic_ns()}"
        configs = [worker_config(nats_url, namespace, r, model_dir) for r in ("prefill", "decode")]
        workers = [
            Worker(
                replace(c, engine=replace(c.engine, **(engine or {})), **overrides),
                transport_factory=transport_factory or nats_only,
            )
            for c in configs
        ]
        for worker in workers:
            await worker.start()
        bus = await Bus.connect(nats_url, "test")
        mesh = Mesh(bus, Subjects(namespace), workers)
        await bus.subscribe(mesh.subjects.tokens("gw"), TokenChunk, mesh.on_tokens)
        await bus.subscribe(mesh.subjects.heartbeat, Heartbeat, mesh.on_beat)

        async def count_blocks(msg: Msg) -> None:
            message = decode_one_of(msg.data, KVChunk, KVDone)
            if isinstance(message, KVChunk) and message.layer_start == 0:
                sent = mesh.blocks_sent.get(message.request_id, 0)
                mesh.blocks_sent[message.request_id] = sent + len(message.block_hashes)

        await bus.nc.subscribe(mesh.subjects.kv("decode"), cb=count_blocks)
        try:
            await scenario(mesh)
            await until(lambda: not any(len(w.table) for w in workers), timeout=5)
        finally:
            for worker in workers:
                await worker.shutdown()
            await bus.close()

    asyncio.run(main())


def nats_only(*args: object) -> None:
    return None


def test_split_requests_stream_what_one_engine_would(nats_server, tiny_model_dir):
    async def scenario(mesh: Mesh) -> None:
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            await mesh.split(mesh.request(name, params))
            assert await mesh.tokens(name) == reference(tiny_model_dir, PROMPT, params), name
        seeded = mesh.chunks["seeded"]
        assert all(len(c.logprobs) == 1 and len(c.logprobs[0].top) == 2 for c in seeded)
        assert seeded[-1].finish_reason == FinishReason.LENGTH
        assert seeded[0].num_prompt_tokens == len(PROMPT)

    run_mesh(nats_server.url, tiny_model_dir, scenario)


def test_shared_prefix_is_not_sent_again(nats_server, tiny_model_dir):
    second = PROMPT[:48] + [9, 9, 9]  # shares the first 3 blocks

    async def scenario(mesh: Mesh) -> None:
        first = await mesh.split(mesh.request("first", GREEDY))
        assert first.num_cached_blocks == 0
        await mesh.tokens("first")
        res = await mesh.split(mesh.request("second", GREEDY, second))
        assert res.num_cached_blocks == 3
        assert await mesh.tokens("second") == reference(tiny_model_dir, second, GREEDY)
        assert mesh.blocks_sent == {"first": 4, "second": 1}

    run_mesh(nats_server.url, tiny_model_dir, scenario)


def test_cancel_mid_stream_frees_every_block(nats_server, tiny_model_dir):
    long = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)

    async def scenario(mesh: Mesh) -> None:
        await mesh.split(mesh.request("long", long))
        await until(lambda: len(mesh.chunks.get("long", [])) >= 3)
        await mesh.bus.publish(mesh.subjects.cancel, Cancel("long", "client gone"))
        mesh.beats.clear()

        def all_free() -> bool:
            beats = [mesh.beats.get(w) for w in ("prefill", "decode")]
            return all(b is not None and b.free_blocks == b.total_blocks for b in beats)

        await until(all_free, timeout=5)
        assert not any(c.finish_reason == FinishReason.LENGTH for c in mesh.chunks["long"])

    run_mesh(nats_server.url, tiny_model_dir, scenario)


def test_reservations_awaiting_kv_are_freed_by_cancel_worker_lost_and_deadline(
    nats_server, tiny_model_dir
):
    """A reservation whose KV never comes holds blocks: a Cancel, a WorkerLost naming it
    (its prefill worker died) and its transfer deadline each free them within a beat."""

    async def scenario(mesh: Mesh) -> None:
        total = NUM_BLOCKS

        async def reserve(request_id: str) -> None:
            message = Reserve(mesh.request(request_id, GREEDY))
            reply = await mesh.bus.request(mesh.subjects.reserve("decode"), message, Reservation, 5)
            assert reply.ok and reply.num_blocks == 4, reply

        async def free_blocks_become(expected: int, timeout: float) -> None:
            mesh.beats.clear()
            await until(
                lambda: "decode" in mesh.beats and mesh.beats["decode"].free_blocks == expected,
                timeout,
            )

        for request_id in ("cancelled", "orphaned", "expired"):
            await reserve(request_id)
        await free_blocks_become(total - 12, 2)
        await mesh.bus.publish(mesh.subjects.cancel, Cancel("cancelled", "client gone"))
        await free_blocks_become(total - 8, 2)
        lost = WorkerLost("prefill-gone", ["orphaned", "someone-else"])
        await mesh.bus.publish(mesh.subjects.events, lost)
        await free_blocks_become(total - 4, 2)
        await free_blocks_become(total, 8)  # "expired": reservation_timeout is 4 s here
        late = KVDone("expired", 0, 5)
        ack = await mesh.bus.request(mesh.subjects.kv("decode"), late, TaskAck, 5)
        assert not ack.ok and "no reservation" in ack.error

    run_mesh(nats_server.url, tiny_model_dir, scenario, reservation_timeout=4.0)


def test_decode_task_alone_streams_the_answer_and_bad_kv_is_refused(nats_server, tiny_model_dir):
    async def scenario(mesh: Mesh) -> None:
        task = DecodeTask(mesh.request("solo", SEEDED))
        ack = await mesh.bus.request(mesh.subjects.decode("decode"), task, TaskAck, 5)
        assert ack.ok, ack.error
        assert await mesh.tokens("solo") == reference(tiny_model_dir, PROMPT, SEEDED)

        bogus = KVChunk("nobody", 0, 0, 1, 0, [None], "float32", [1, 1, 16, 2, 2, 16], b"")
        ack = await mesh.bus.request(mesh.subjects.kv("decode"), bogus, TaskAck, 5)
        assert not ack.ok and "no reservation" in ack.error
        await mesh.split(mesh.request("victim", GREEDY))
        await mesh.tokens("victim")  # the worker is unharmed
        await until(lambda: "decode" in mesh.beats)
        beat = mesh.beats["decode"]
        assert beat.role == "decode" and beat.model == "tiny" and not beat.draining

    run_mesh(nats_server.url, tiny_model_dir, scenario)


def test_reservations_that_come_together_are_answered_between_the_same_steps(
    nats_server, tiny_model_dir, monkeypatch
):
    """A decode worker answers each request in its own task: reservations that arrive while
    it steps are applied together after the step, not one a step behind one another."""
    steps = 0
    step = LLMEngine.step

    def slow_step(engine: LLMEngine) -> list:
        nonlocal steps
        time.sleep(0.2)
        outputs = step(engine)
        steps += 1
        return outputs

    monkeypatch.setattr(LLMEngine, "step", slow_step)
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def scenario(mesh: Mesh) -> None:
        task = DecodeTask(mesh.request("running", long))
        ack = await mesh.bus.request(mesh.subjects.decode("decode"), task, TaskAck, 5)
        assert ack.ok, ack.error
        await until(lambda: len(mesh.chunks.get("running", [])) >= 2)

        async def reserve(request_id: str) -> int:
            message = Reserve(mesh.request(request_id, GREEDY))
            reply = await mesh.bus.request(mesh.subjects.reserve("decode"), message, Reservation, 5)
            assert reply.ok, reply.error
            return steps

        answered_after = await asyncio.gather(*(reserve(f"r{i}") for i in range(3)))
        assert len(set(answered_after)) == 1, f"answered after steps {answered_after}"
        for i in range(3):
            await mesh.bus.publish(mesh.subjects.cancel, Cancel(f"r{i}", "test done"))
        await mesh.bus.publish(mesh.subjects.cancel, Cancel("running", "test done"))

    run_mesh(nats_server.url, tiny_model_dir, scenario)


def test_sigterm_drains_refuses_new_work_and_exits_zero(nats_server, tiny_model_dir):
    namespace = f"t{time.monotonic_ns()}"
    command = [sys.executable, "-m", "services.worker.cli", "--role", "decode"]
    command += ["--model-dir", str(tiny_model_dir), "--worker-id", "w1", "--num-kv-blocks", "16"]
    command += ["--nats", nats_server.url, "--namespace", namespace]
    process = subprocess.Popen(command, cwd=Path(__file__).parents[2])

    async def main() -> None:
        bus = await Bus.connect(nats_server.url, "test")
        mesh = Mesh(bus, Subjects(namespace))
        await bus.subscribe(mesh.subjects.heartbeat, Heartbeat, mesh.on_beat)
        await until(lambda: "w1" in mesh.beats, timeout=30)
        assert mesh.beats["w1"].total_blocks == 16
        process.send_signal(signal.SIGTERM)
        await until(lambda: mesh.beats["w1"].draining, timeout=5)
        await bus.close()

    try:
        asyncio.run(main())
        assert process.wait(timeout=10) == 0
    finally:
        process.kill()


def test_draft_model_speculation_reaches_heartbeats_and_metrics(nats_server, tiny_model_dir):
    """The decode worker speculates with a draft model (the target itself, so drafts pass):
    the stream is plain decoding's, several tokens a chunk, and the counters reach its
    heartbeats and its /metrics. The prefill worker does not speculate."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def scenario(mesh: Mesh) -> None:
        await mesh.split(mesh.request("spec", params))
        await until(lambda: any(c.finish_reason is not None for c in mesh.chunks.get("spec", [])))
        chunks = mesh.chunks["spec"]
        assert [t for c in chunks for t in c.token_ids] == reference(tiny_model_dir, PROMPT, params)
        assert len(chunks) < params.max_tokens  # accepted drafts arrive with their step's token
        await until(lambda: "decode" in mesh.beats and mesh.beats["decode"].spec_verify_steps > 0)
        beat = mesh.beats["decode"]
        assert 0.9 * beat.spec_proposed_tokens <= beat.spec_accepted_tokens
        assert beat.spec_accepted_tokens <= beat.spec_proposed_tokens
        assert mesh.beats["prefill"].spec_proposed_tokens == 0

        def exported() -> dict[str, float]:
            url = f"http://127.0.0.1:{beat.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as reply:
                families = text_string_to_metric_families(reply.read().decode())
            return {s.name: s.value for f in families for s in f.samples if "spec_decode" in s.name}

        expected = {
            "splitserve_spec_decode_proposed_tokens_total": beat.spec_proposed_tokens,
            "splitserve_spec_decode_accepted_tokens_total": beat.spec_accepted_tokens,
            "splitserve_spec_decode_verify_steps_total": beat.spec_verify_steps,
            "splitserve_spec_decode_acceptance_rate": (
                beat.spec_accepted_tokens / beat.spec_proposed_tokens
            ),
        }
        # The counters move when a heartbeat goes out; the request is over, so they settle.
        await until(lambda: expected.items() <= exported().items(), timeout=5)

    run_mesh(
        nats_server.url,
        tiny_model_dir,
        scenario,
        engine={"speculative": "draft", "draft_model_dir": tiny_model_dir},
        metrics_port=0,
    )
