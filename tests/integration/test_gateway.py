"""The gateway over a real nats-server, called with the official openai SDK: chat and
completions, streaming, stops, cancels, stalls, bad requests, overload, keys and readiness
(the harness: tests/integration/gateway_harness.py)."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest

from shared.protocol import Outcome
from tests.e2e.conftest import real_model_dir  # noqa: F401  (fixture)
from tests.integration.gateway_harness import (
    MAX_MODEL_LEN,
    MESSAGES,
    MODEL,
    NO_SCHEDULER_GRACE_S,
    REPLY,
    Harness,
    gw_fixture,  # noqa: F401  (fixtures)
    http,
    migrating_gw_fixture,  # noqa: F401  (fixtures)
)
from tests.integration.test_observability import metric, scrape

pytestmark = pytest.mark.e2e


def test_chat_non_streaming(gw: Harness) -> None:
    ids = gw.reply_script()
    reply = gw.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    assert reply.choices[0].message.content == REPLY
    assert reply.choices[0].finish_reason == "stop"
    prompt = gw.text.chat_prompt_ids(MESSAGES)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), len(ids))
    assert reply.usage.total_tokens == len(prompt) + len(ids)
    sent = gw.mesh.submitted[-1]
    assert sent.gateway_id == "gw1" and sent.prompt_token_ids == prompt
    assert sent.sampling.temperature == 0.0
    assert sent.sampling.max_tokens == MAX_MODEL_LEN - len(prompt)
    assert sent.deadline > time.time() + 500


def test_chat_streaming_with_usage(gw: Harness) -> None:
    ids = gw.reply_script(chunk=1)  # one token a chunk: the emoji spans several
    chunks = list(
        gw.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY and "\ufffd" not in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)


def test_completions_length(gw: Harness) -> None:
    ids = gw.reply_script(finish="length")
    client = gw.client()
    reply = client.completions.create(model=MODEL, prompt="Once", max_tokens=len(ids))
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (REPLY, "length")
    assert reply.usage.completion_tokens == len(ids)
    assert gw.mesh.submitted[-1].sampling.max_tokens == len(ids)
    chunks = list(client.completions.create(model=MODEL, prompt=[[1, 2, 3]], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == REPLY
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_cuts_and_cancels(gw: Harness) -> None:
    gw.reply_script(chunk=1)
    reply = gw.client().chat.completions.create(model=MODEL, messages=MESSAGES, stop=["ere!"])
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("Hi th", "stop")
    assert gw.wait_cancelled(gw.mesh.submitted[-1].request_id)


def test_client_disconnect_cancels(gw: Harness) -> None:
    gw.reply_script()
    gw.mesh.script = gw.mesh.script[:1]  # then nothing: the request stays in flight
    stream = gw.client().chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
    next(iter(stream))
    stream.close()
    assert gw.wait_cancelled(gw.mesh.submitted[-1].request_id, timeout=1.5)


def test_stall_and_worker_error(gw: Harness) -> None:
    gw.reply_script()
    gw.mesh.script = gw.mesh.script[:1]
    with pytest.raises(openai.InternalServerError) as info:
        gw.client().completions.create(model=MODEL, prompt="x")
    assert info.value.status_code == 504 and "no token" in info.value.message
    assert gw.wait_cancelled(gw.mesh.submitted[-1].request_id)
    gw.mesh.script = [([5], None, ""), ([], None, "decode worker out of memory")]
    stream = gw.client().completions.create(model=MODEL, prompt="x", stream=True)
    with pytest.raises(openai.APIError, match="out of memory"):
        list(stream)


def test_a_failed_attempt_migrates_with_the_tokens_delivered(migrating_gw: Harness) -> None:
    gw = migrating_gw
    ids = gw.reply_script()
    first_chunk, *rest = gw.mesh.script
    gw.mesh.script = [first_chunk, ([], None, "decode worker lost"), *rest]
    reply = gw.client().chat.completions.create(model=MODEL, messages=MESSAGES)
    assert reply.choices[0].message.content == REPLY
    assert reply.usage.completion_tokens == len(ids)  # no token twice, none missing
    first, migrated = gw.mesh.submitted[-2:]
    assert (migrated.request_id, migrated.attempt) == (f"{first.request_id}~1", 1)
    assert migrated.delivered_token_ids == first_chunk[0]
    # it names the failed attempt's split, for whichever scheduler replica places it
    assert (first.last_prefill, first.last_decode) == ("", "")
    split = (migrated.last_prefill, migrated.last_decode, migrated.last_delivered)
    assert split == ("w0", "w1", 0)
    assert migrated.deadline == first.deadline and migrated.sampling == first.sampling
    assert gw.wait_cancelled(first.request_id)  # the failed attempt frees its blocks


def test_bad_requests_name_the_field(gw: Harness) -> None:
    status, body = http(gw, "/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    long_prompt = "word " * MAX_MODEL_LEN
    cases = [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": 5}, "temperature"),
        ({"model": "gpt-4"}, "model"),
        ({"messages": [{"role": "user", "content": long_prompt}]}, "messages"),
        ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({"tools": [{"type": "function", "function": {"name": "not a name"}}]}, "tools"),
    ]
    for extra, param in cases:
        body = {"model": MODEL, "messages": MESSAGES} | extra
        with pytest.raises(openai.BadRequestError) as info:
            gw.client().chat.completions.create(**body)
        assert info.value.body["param"] == param, extra


def test_overload_and_no_scheduler(gw: Harness) -> None:
    gw.reply_script()
    gw.mesh.refuse = True
    with pytest.raises(openai.RateLimitError) as info:  # BUSY: the scheduler's queue is full
        gw.client().completions.create(model=MODEL, prompt="x")
    assert info.value.response.headers["Retry-After"] == "3"
    for outcome in (Outcome.UNAVAILABLE, Outcome.FAILED):  # no worker took it: never a 400
        gw.mesh.refusal = outcome
        with pytest.raises(openai.InternalServerError) as info:
            gw.client().completions.create(model=MODEL, prompt="x")
        assert info.value.status_code == 503 and f"{outcome.name} here" in info.value.message
        assert info.value.response.headers["Retry-After"] == "3"
    gw.mesh.refusal = Outcome.INVALID
    with pytest.raises(openai.BadRequestError) as bad:
        gw.client().completions.create(model=MODEL, prompt="x")
    assert bad.value.body["message"] == "invalid request: INVALID here"
    gw.mesh.refuse, gw.mesh.refusal = False, Outcome.BUSY
    before = scheduler_waits(gw, "unanswered")
    gw.run(gw.mesh.submit_sub.unsubscribe())
    try:
        asked = time.monotonic()
        with pytest.raises(openai.InternalServerError) as info:
            gw.client().completions.create(model=MODEL, prompt="x")
        waited = time.monotonic() - asked
        assert info.value.status_code == 503 and "no scheduler" in info.value.message
        assert NO_SCHEDULER_GRACE_S - 0.15 <= waited < NO_SCHEDULER_GRACE_S + 3, waited
    finally:
        gw.mesh.submit_sub = gw.run(gw.mesh.serve_submit())
    count, seconds = scheduler_waits(gw, "unanswered")
    assert count == before[0] + 1  # timed within the client's wait, over the grace
    assert NO_SCHEDULER_GRACE_S - 0.15 <= seconds - before[1] <= waited


def test_a_scheduler_back_within_the_grace_takes_the_request(gw: Harness) -> None:
    """No scheduler subscribed as the request comes (one moving to another NATS node): the
    gateway asks again until one is, and the client sees only a late first token."""
    gw.reply_script()
    before, waits = len(gw.mesh.submitted), scheduler_waits(gw, "answered")
    gw.run(gw.mesh.submit_sub.unsubscribe())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            asked = time.monotonic()
            reply = pool.submit(gw.client().completions.create, model=MODEL, prompt="x")
            time.sleep(NO_SCHEDULER_GRACE_S / 2)
            assert not reply.done()  # still asking, not refused
        finally:
            gw.mesh.submit_sub = gw.run(gw.mesh.serve_submit())
        assert reply.result(timeout=10).choices[0].text == REPLY
        answered = time.monotonic() - asked
    assert len(gw.mesh.submitted) == before + 1  # asked again, placed once
    count, seconds = scheduler_waits(gw, "answered")
    assert count == waits[0] + 1  # timed within the client's wait, most of the half grace
    assert NO_SCHEDULER_GRACE_S / 2 - 0.15 <= seconds - waits[1] <= answered


def scheduler_waits(gw: Harness, outcome: str) -> tuple[float, float]:
    """(count, seconds) of the gateway's submits that asked again for a scheduler."""
    samples = scrape(urlsplit(gw.url).port)
    name = "splitserve_gateway_scheduler_wait_seconds"
    return metric(samples, name + "_count", outcome=outcome), metric(
        samples, name + "_sum", outcome=outcome
    )


def test_api_key_models_health(gw: Harness) -> None:
    with pytest.raises(openai.AuthenticationError):
        gw.client(api_key="wrong").models.list()
    assert [m.id for m in gw.client().models.list()] == [MODEL]
    assert http(gw, "/health", key="wrong")[0] == 200


@pytest.mark.parametrize(
    ("roles", "status"),
    [([], 503), (["prefill"], 503), (["decode", "decode"], 503), (["prefill", "decode"], 200)]
    + [(["both"], 200)],
)
def test_ready_needs_both_roles(gw: Harness, roles: list[str], status: int) -> None:
    gw.mesh.roles = roles
    assert http(gw, "/ready", key="none")[0] == status


def test_gateway_never_imports_torch() -> None:
    code = "import sys, services.gateway.app, services.gateway.cli; print('torch' in sys.modules)"
    root = Path(__file__).parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
