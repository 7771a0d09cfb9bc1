"""vLLM as the workers' engine (`--engine vllm`, docs/vllm.md): `splitserve up` as real
processes with the real model, called with the OpenAI SDK.

- aggregated (one worker of role both): the same greedy text as vLLM alone on the prompts;
- disaggregated (1 prefill + 2 decode workers, KV over vLLM's NIXL connector): the same
  text again, and vLLM's own counters on the decode workers say every prompt token was
  pulled from the prefill worker, none computed;
- vLLM's KV cache events reach the scheduler as our block hashes: after a request, the
  prefill worker and the decode worker that served it report the prompt's blocks;
- a stream closed by its client frees its blocks in vLLM; a decode worker SIGKILLed
  mid-stream: every stream completes (migrated);
- an idle mesh of vLLM workers leaves the cores free (no NIXL progress thread spinning:
  services/worker/vllm_nixl_plugin.py).

Needs vLLM (`make install ENGINE=vllm`); skipped, saying so, without it. The engines run
eagerly (`--no-vllm-compile`): each starts in well under a minute on a small CPU box.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer

from loadtest.mesh_bench.idle import cpu_seconds, process_tree
from services.offline import chat_prompt_ids
from shared.bus import Bus
from shared.engine.block_hash import hash_full_blocks
from shared.protocol import KVEvents
from shared.subjects import Subjects
from tests.e2e.test_chaos import worker_pid
from tests.e2e.test_mesh import Mesh

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed here (make install ENGINE=vllm)",
    ),
]

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves falling in the park.",
    "Explain in one sentence why the sky is blue.",
]
MAX_TOKENS = 24
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
# Small, single-threaded and eager (no minutes of torch.compile): the CI box has 2 cores for
# every engine of the mesh. float32: a decode engine recomputes the last prompt token on
# its own (vLLM's P/D), and in bfloat16 that rounding alone flips greedy near-ties.
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "2048", "--kv-cache-gib", "0.25"]
VLLM_FLAGS = [
    *("--engine", "vllm", "--no-vllm-compile", "--block-size", str(BLOCK_SIZE)),
    *ENGINE_FLAGS,
    *("--num-threads", "1"),
]
READY_S = 300

REFERENCE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
prompts, max_tokens, model = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
llm = LLM(model=model, dtype="float32", max_model_len=2048, block_size=32,
          kv_cache_memory_bytes=1 << 28, seed=0, enforce_eager=True,
          max_num_batched_tokens=256, max_num_seqs=64)
params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False)
# One at a time, as the test sends them: vLLM's numerics depend on the batch.
outs = [llm.generate([TokensPrompt(prompt_token_ids=p)], params)[0] for p in prompts]
print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def vllm_alone(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy token ids of vLLM by itself (its offline `LLM`), one process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    args = [sys.executable, "-c", REFERENCE, json.dumps(prompts), str(max_tokens), str(model_dir)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=READY_S, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[0].removeprefix("TOKENS "))


@pytest.fixture(scope="module")
def prompts(real_model_dir: Path) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    return [chat_prompt_ids(real_model_dir, tokenizer, message) for message in PROMPTS]


@pytest.fixture(scope="module")
def expected(real_model_dir: Path, prompts: list[list[int]]) -> list[str]:
    tokenizer = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    tokens = vllm_alone(real_model_dir, prompts, MAX_TOKENS)
    return [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]


def vllm_mesh(model_dir: Path, home: Path, extra: list[str]) -> Iterator[Mesh]:
    mesh = Mesh(model_dir, home, [*VLLM_FLAGS, *extra])
    try:
        mesh.wait_ready(READY_S)
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def aggregated(real_model_dir, tmp_path_factory) -> Iterator[Mesh]:
    home = tmp_path_factory.mktemp("vllm-agg")
    yield from vllm_mesh(real_model_dir, home, ["--aggregated", "--prefill", "1"])


@pytest.fixture(scope="module")
def disaggregated(real_model_dir, tmp_path_factory) -> Iterator[Mesh]:
    home = tmp_path_factory.mktemp("vllm-disagg")
    # Every prompt goes through a prefill worker (none is short enough to skip it). Three
    # engines share the 2-core box with the test: a worker's heartbeat may be late by
    # seconds, which must not count as its loss.
    extra = ["--prefill", "1", "--decode", "2", "--local-prefill-tokens", "0"]
    extra += ["--heartbeat-timeout", "15"]
    yield from vllm_mesh(real_model_dir, home, extra)


def chat_texts(mesh: Mesh) -> list[str]:
    model = mesh.client.models.list().data[0].id
    texts = []
    for message in PROMPTS:
        reply = mesh.client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": message}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        texts.append(reply.choices[0].message.content)
    return texts


def worker_beats(mesh: Mesh, role: str) -> list:
    return [b for b in mesh.next_heartbeats() if b.role == role]


def test_aggregated_vllm_worker_answers_as_vllm_alone(aggregated, expected):
    assert chat_texts(aggregated) == expected
    (beat,) = aggregated.next_heartbeats()
    assert beat.engine == "vllm" and beat.role == "both"


def test_disaggregated_over_nixl_moves_kv_without_recompute(disaggregated, expected, prompts):
    assert chat_texts(disaggregated) == expected
    prefill = worker_beats(disaggregated, "prefill")
    decode = worker_beats(disaggregated, "decode")
    blocks = sum(-(-len(p) // BLOCK_SIZE) for p in prompts)
    assert sum(b.kv_blocks_sent for b in prefill) >= blocks  # more if one was migrated
    # vLLM's decode engines computed no prompt token (its stats count the last one, which
    # it recomputes, as transferred too): every one came over NIXL.
    # (more than the prompts when one was migrated: it comes back with its delivered tokens)
    assert sum(b.prefix_queries for b in decode) >= sum(len(p) for p in prompts)
    assert sum(b.prefix_queries - b.prefix_hits for b in decode) == 0, decode
    assert sum(b.kv_blocks_received for b in decode) == sum(b.kv_blocks_sent for b in prefill)


SHARED_CONTEXT = "Here is the context to answer from: " + "lorem ipsum dolor sit amet " * 24


def stored_hashes_during(mesh: Mesh, call) -> dict[str, set[int]]:
    """Each worker's block hashes its KV events stored (net of removals) while `call` ran
    and for 3 s after it (workers send their events with their heartbeats, once a second),
    heard on `ss.kv.events` as the scheduler hears them (with its NATS role)."""
    cached: dict[str, set[int]] = {}

    async def on_events(events: KVEvents, headers) -> None:
        blocks = cached.setdefault(events.worker_id, set())
        blocks.difference_update(events.removed)
        blocks.update(events.stored)

    async def listen() -> None:
        url = f"nats://127.0.0.1:{mesh.nats_port}"
        bus = await Bus.connect(url, "test-kv", auth=mesh.credentials.auth("scheduler"))
        try:
            await bus.subscribe(Subjects().kv_events, KVEvents, on_events)
            await asyncio.to_thread(call)
            await asyncio.sleep(3.0)
        finally:
            await bus.close()

    asyncio.run(listen())
    return cached


def test_vllm_kv_events_reach_the_scheduler_as_our_block_hashes(disaggregated, real_model_dir):
    tokenizer = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    prompt = chat_prompt_ids(real_model_dir, tokenizer, SHARED_CONTEXT)
    beats = {b.worker_id: b for b in disaggregated.next_heartbeats()}
    model = next(iter(beats.values())).model
    assert {b.block_size for b in beats.values()} == {BLOCK_SIZE}
    ours = set(hash_full_blocks(prompt, BLOCK_SIZE, model))
    assert len(ours) >= 4

    def ask() -> None:
        disaggregated.client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": SHARED_CONTEXT}],
            max_tokens=4,
            temperature=0,
        )

    cached = stored_hashes_during(disaggregated, ask)
    holders = {beats[w].role for w, blocks in cached.items() if ours <= blocks}
    # The prefill engine computed the prompt's blocks, the decode engine pulled them; both
    # keep them in their prefix caches, and the scheduler now indexes them for routing.
    assert holders == {"prefill", "decode"}, {w: len(b & ours) for w, b in cached.items()}


def wait_idle(mesh: Mesh, timeout: float = 30) -> list:
    """Every worker's heartbeat: nothing running, every block free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        beats = mesh.next_heartbeats()
        if all(not b.num_requests and b.free_blocks == b.total_blocks for b in beats):
            return beats
    raise AssertionError(f"blocks not freed: {beats}")


def test_a_closed_stream_frees_its_blocks(disaggregated):
    model = disaggregated.client.models.list().data[0].id
    stream = disaggregated.client.completions.create(
        model=model,
        prompt="Count to a thousand:",
        max_tokens=1500,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 5:
            break
    busy = [b for b in disaggregated.next_heartbeats() if b.role == "decode" and b.num_running]
    assert busy, "the stream should still be decoding"
    stream.close()
    wait_idle(disaggregated)


IDLE_WINDOW_S = 5.0
IDLE_CORES_AT_MOST = 0.3  # heartbeats and vLLM's idle loops; one spinning thread is 1.0


def test_an_idle_vllm_mesh_leaves_the_cores_free(disaggregated):
    wait_idle(disaggregated)  # after the requests above: every NIXL agent is in use
    pids = process_tree(disaggregated.process.pid)
    before, began = cpu_seconds(pids), time.monotonic()
    time.sleep(IDLE_WINDOW_S)
    after, wall = cpu_seconds(pids), time.monotonic() - began
    cores = sum(after[p] - before[p] for p in after if p in before) / wall
    print(f"idle mesh of 3 vLLM workers: {cores:.2f} cores")
    assert cores < IDLE_CORES_AT_MOST, f"{cores:.2f} cores busy with no request"


def stream_text(mesh: Mesh, prompt: str, progress: list[int], slot: int) -> tuple[str, str]:
    client = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key="x", timeout=120, max_retries=0)
    stream = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt,
        max_tokens=60,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces, finish = [], ""
    for chunk in stream:
        progress[slot] += 1
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    return "".join(pieces), finish


def test_decode_worker_sigkill_mid_stream_every_stream_completes(disaggregated):
    prompts = [f"Story number {i}: once upon a time" for i in range(4)]
    progress = [0] * len(prompts)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(stream_text, disaggregated, p, progress, i) for i, p in enumerate(prompts)
        ]
        give_up = time.monotonic() + 60
        while min(progress) < 5 and time.monotonic() < give_up:
            time.sleep(0.05)
        os.kill(worker_pid(disaggregated, "decode-0"), signal.SIGKILL)
        results = [f.result(timeout=180) for f in futures]
    assert [finish for _, finish in results] == ["length"] * len(prompts)
    assert all(text for text, _ in results)
