"""LoRA adapters through the mesh: a prefill and a decode worker over a real nats-server
(tests/integration/test_worker.py's helpers), the test playing scheduler and gateway.

Two adapters and the base model answer differently, each as transformers + peft does
(greedy), whether a request is split (KV handed from prefill to decode under its adapter) or
decoded on one worker; heartbeats announce the adapters; an AdapterCommand loads and unloads
one while the workers serve, and a bad one is refused with the reason, the worker serving on.
"""

from __future__ import annotations

import pytest

from shared.engine import native
from shared.engine.sampling_params import SamplingParams
from shared.lora_messages import AdapterAction, AdapterAnswer, AdapterCommand
from shared.protocol import DecodeTask, Outcome, TaskAck
from tests.conftest import write_tiny_model
from tests.engine_harness import hf_greedy
from tests.integration.test_worker import PROMPT, Mesh, run_mesh, until
from tests.lora_adapters import peft_greedy, peft_model, write_adapter

pytestmark = pytest.mark.skipif(native.load() is None, reason="C++ kernels not built")
MAX_TOKENS = 8
OPTIONS = {
    "sql": {"seed": 21},
    "chat": {"seed": 22, "r": 8, "target_modules": ["q_proj", "v_proj"]},
}


def greedy(adapter: str = "") -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, adapter=adapter)


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-mesh")
    model_dir = write_tiny_model(root / "model", seed=1)
    paths = {name: write_adapter(model_dir, root / name, **o) for name, o in OPTIONS.items()}
    expected = {
        name: peft_greedy(peft_model(model_dir, **o), PROMPT, MAX_TOKENS)
        for name, o in OPTIONS.items()
    }
    expected[""] = hf_greedy(model_dir, PROMPT, MAX_TOKENS)
    return root, model_dir, paths, expected


def test_adapters_and_the_base_answer_as_peft_does_through_the_mesh(nats_server, lora_setup):
    _, model_dir, paths, expected = lora_setup
    modules = tuple(f"{name}={path}" for name, path in paths.items())
    assert len({tuple(tokens) for tokens in expected.values()}) == 3  # they differ

    async def scenario(mesh: Mesh) -> None:
        await until(lambda: all(b.adapters == list(paths) for b in mesh.beats.values())
                    and len(mesh.beats) == 2)  # fmt: skip
        for adapter in ("", "sql", "chat"):
            split, local = f"split-{adapter}", f"local-{adapter}"
            await mesh.split(mesh.request(split, greedy(adapter)))
            task = DecodeTask(mesh.request(local, greedy(adapter)))
            ack = await mesh.bus.request(mesh.subjects.decode("decode"), task, TaskAck, 5)
            assert ack.ok, ack.error
            assert await mesh.tokens(split) == expected[adapter], adapter
            assert await mesh.tokens(local) == expected[adapter], adapter
        unknown = DecodeTask(mesh.request("ghost", greedy("ghost")))
        ack = await mesh.bus.request(mesh.subjects.decode("decode"), unknown, TaskAck, 5)
        assert ack.outcome == Outcome.INVALID and "ghost" in ack.error

    run_mesh(
        nats_server.url, model_dir, scenario, engine={"lora_modules": modules, "dtype": "float32"}
    )


def test_adapters_load_and_unload_while_serving(nats_server, lora_setup):
    root, model_dir, paths, expected = lora_setup

    async def command(mesh: Mesh, worker: str, message: AdapterCommand) -> AdapterAnswer:
        subject = mesh.subjects.worker_adapters(worker)
        return await mesh.bus.request(subject, message, AdapterAnswer, 30)

    async def scenario(mesh: Mesh) -> None:
        await until(lambda: len(mesh.beats) == 2)
        bad = AdapterCommand(AdapterAction.LOAD, "sql", str(root / "nowhere"))
        answer = await command(mesh, "decode", bad)
        assert answer.outcome == Outcome.INVALID and "no adapter_config.json" in answer.error
        for worker in ("prefill", "decode"):
            load = AdapterCommand(AdapterAction.LOAD, "sql", str(paths["sql"]))
            assert (await command(mesh, worker, load)).outcome == Outcome.OK
        await until(lambda: all(b.adapters == ["sql"] for b in mesh.beats.values()))
        await mesh.split(mesh.request("after-load", greedy("sql")))
        assert await mesh.tokens("after-load") == expected["sql"]
        unload = AdapterCommand(AdapterAction.UNLOAD, "sql")
        assert (await command(mesh, "decode", unload)).outcome == Outcome.OK
        await until(lambda: mesh.beats["decode"].adapters == [])
        task = DecodeTask(mesh.request("after-unload", greedy("sql")))
        ack = await mesh.bus.request(mesh.subjects.decode("decode"), task, TaskAck, 5)
        assert ack.outcome == Outcome.INVALID

    run_mesh(nats_server.url, model_dir, scenario, engine={"enable_lora": True, "dtype": "float32"})
