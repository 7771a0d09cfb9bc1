"""LoRA adapters at the gateway (services/gateway/adapters.py), against the fake mesh: `model`
naming an adapter its workers announce submits with that adapter and answers with its name;
`/v1/models` lists adapters with their parent; vLLM's load and unload routes (behind the API
key) reach the scheduler and answer its workers' verdict; per-adapter counters."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from shared.lora_messages import AdapterAction
from tests.e2e.conftest import real_model_dir  # noqa: F401  (fixture)
from tests.integration.gateway_harness import (
    KEY,
    MESSAGES,
    MODEL,
    Harness,
    gw_fixture,  # noqa: F401  (fixtures)
    http,
    migrating_gw_fixture,  # noqa: F401  (fixtures)
)

pytestmark = pytest.mark.e2e  # the gateway's tokenizer: the real default model's


def post(gw: Harness, path: str, body: dict, key: str = KEY) -> tuple[int, str]:
    request = urllib.request.Request(gw.url + path, data=json.dumps(body).encode(), method="POST")
    request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_an_adapter_is_listed_selected_by_model_and_counted(gw: Harness):
    gw.reply_script()
    gw.mesh.adapters[:] = ["sql-lora"]
    status, listing = http(gw, "/v1/models")
    cards = {card["id"]: card for card in listing["data"]}
    assert status == 200 and cards["sql-lora"]["parent"] == MODEL and MODEL in cards
    answer = gw.client().chat.completions.create(model="sql-lora", messages=MESSAGES)
    assert answer.model == "sql-lora"
    assert gw.mesh.submitted[-1].sampling.adapter == "sql-lora"
    gw.reply_script()
    gw.client().chat.completions.create(model=MODEL, messages=MESSAGES)
    assert gw.mesh.submitted[-1].sampling.adapter == ""
    with pytest.raises(openai.BadRequestError):
        gw.client().chat.completions.create(model="no-such-lora", messages=MESSAGES)
    with urllib.request.urlopen(gw.url + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'splitserve_lora_requests_total{adapter="sql-lora"} 1.0' in metrics
    assert 'splitserve_lora_tokens_total{adapter="sql-lora",kind="generation"}' in metrics


def test_load_and_unload_reach_every_worker_behind_the_api_key(gw: Harness):
    gw.mesh.adapters[:] = []
    body = {"lora_name": "chat-lora", "lora_path": "/adapters/chat"}
    assert post(gw, "/v1/load_lora_adapter", body, key="wrong")[0] == 401
    status, text = post(gw, "/v1/load_lora_adapter", body)
    assert (status, text) == (200, "Success: LoRA adapter 'chat-lora' added successfully.")
    command = gw.mesh.adapter_commands[-1]
    assert (command.action, command.name, command.path) == (AdapterAction.LOAD, *body.values())
    gw.reply_script()
    gw.client().chat.completions.create(model="chat-lora", messages=MESSAGES)
    assert gw.mesh.submitted[-1].sampling.adapter == "chat-lora"
    status, text = post(gw, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/bad"})
    assert status == 400 and "w0: no adapter_config.json" in text
    assert post(gw, "/v1/load_lora_adapter", {"lora_name": "a b", "lora_path": "/p"})[0] == 400
    status, text = post(gw, "/v1/unload_lora_adapter", {"lora_name": "chat-lora"})
    assert status == 200 and "removed successfully" in text
    with pytest.raises(openai.BadRequestError):
        gw.client().chat.completions.create(model="chat-lora", messages=MESSAGES)


def test_a_migrated_attempt_keeps_its_adapter(migrating_gw: Harness):
    gw = migrating_gw
    gw.reply_script()
    gw.mesh.adapters[:] = ["sql-lora"]
    first_chunk, *rest = gw.mesh.script
    gw.mesh.script = [first_chunk, ([], None, "decode worker lost"), *rest]
    reply = gw.client().chat.completions.create(model="sql-lora", messages=MESSAGES)
    assert reply.model == "sql-lora"
    first, migrated = gw.mesh.submitted[-2:]
    assert migrated.attempt == 1 and migrated.sampling.adapter == "sql-lora"
    assert migrated.sampling == first.sampling
