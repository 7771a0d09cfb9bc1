"""LoRA adapters on vLLM workers (`--engine vllm --lora-modules`, docs/lora.md): `splitserve
up` as real processes with the real model and a random PEFT adapter of it, called with the
OpenAI SDK. The adapter and the base answer as vLLM alone does with and without the
adapter's LoRARequest (greedy), and differently from each other; `/v1/models` lists the
adapter with its parent; one loaded through the gateway's route answers as the first (the
same checkpoint), and is gone after the unload route.

Needs vLLM (`make install ENGINE=vllm`); skipped, saying so, without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer

from loadtest.engine_bench.lora import write_random_adapter
from services.offline import chat_prompt_ids
from shared.engine.model_config import ModelConfig
from tests.e2e import test_vllm_engine
from tests.e2e.test_mesh import Mesh
from tests.e2e.test_vllm_engine import READY_S, VLLM_FLAGS

pytestmark = test_vllm_engine.pytestmark  # e2e, slow, and skipped without vLLM

PROMPTS = ["What is the capital of France?", "Name three colours of the rainbow."]
MAX_TOKENS = 16
RANK = 8

REFERENCE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
prompts, max_tokens = json.loads(sys.argv[1]), int(sys.argv[2])
model, adapter = sys.argv[3], sys.argv[4]
llm = LLM(model=model, dtype="float32", max_model_len=2048, block_size=32,
          kv_cache_memory_bytes=1 << 28, seed=0, enforce_eager=True,
          max_num_batched_tokens=256, max_num_seqs=64, enable_lora=True, max_loras=4,
          max_lora_rank=16)
params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False)
lora = LoRARequest("tuned", 1, adapter)
tokens = {}
for name, request in (("", None), ("tuned", lora)):
    outs = [llm.generate([TokensPrompt(prompt_token_ids=p)], params, lora_request=request)[0]
            for p in prompts]
    tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
print("TOKENS", json.dumps(tokens))
"""


@pytest.fixture(scope="module")
def adapter(real_model_dir: Path, tmp_path_factory) -> Path:
    config = ModelConfig.from_dir(real_model_dir)
    path = tmp_path_factory.mktemp("vllm-lora") / "tuned"
    return write_random_adapter(path, config, RANK, seed=5, std=0.05)


@pytest.fixture(scope="module")
def expected(real_model_dir: Path, adapter: Path) -> dict[str, list[str]]:
    """Greedy texts of vLLM by itself (its offline `LLM`), base ("") and with the adapter."""
    tokenizer = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    prompts = [chat_prompt_ids(real_model_dir, tokenizer, message) for message in PROMPTS]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    args = [sys.executable, "-c", REFERENCE, json.dumps(prompts), str(MAX_TOKENS)]
    args += [str(real_model_dir), str(adapter)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=READY_S, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    tokens = json.loads(lines[0].removeprefix("TOKENS "))
    return {
        name: [tokenizer.decode(t, skip_special_tokens=True) for t in outs]
        for name, outs in tokens.items()
    }


@pytest.fixture(scope="module")
def mesh(real_model_dir: Path, adapter: Path, tmp_path_factory) -> Iterator[Mesh]:
    home = tmp_path_factory.mktemp("vllm-lora-mesh")
    extra = ["--aggregated", "--prefill", "1", "--lora-modules", f"tuned={adapter}"]
    mesh = Mesh(real_model_dir, home, [*VLLM_FLAGS, *extra])
    try:
        mesh.wait_ready(READY_S)
        yield mesh
    finally:
        mesh.stop()


def texts(mesh: Mesh, model: str) -> list[str]:
    replies = [
        mesh.client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": message}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        for message in PROMPTS
    ]
    return [reply.choices[0].message.content for reply in replies]


def post(mesh: Mesh, route: str, body: dict) -> str:
    request = urllib.request.Request(
        f"{mesh.base}{route}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return reply.read().decode()


def test_the_adapter_and_the_base_answer_as_vllm_alone(mesh, expected):
    assert expected["tuned"] != expected[""]  # the adapter matters
    models = {m.id: m for m in mesh.client.models.list().data}
    base = next(name for name in models if name != "tuned")
    assert models["tuned"].model_extra.get("parent") == base
    assert texts(mesh, base) == expected[""]
    assert texts(mesh, "tuned") == expected["tuned"]


def test_an_adapter_loaded_through_the_gateway_serves_then_unloads(mesh, adapter, expected):
    load = {"lora_name": "again", "lora_path": str(adapter)}
    assert "Success" in post(mesh, "/v1/load_lora_adapter", load)
    assert texts(mesh, "again") == expected["tuned"]
    assert "Success" in post(mesh, "/v1/unload_lora_adapter", {"lora_name": "again"})
    with pytest.raises(openai.BadRequestError):
        texts(mesh, "again")
