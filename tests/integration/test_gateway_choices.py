"""The gateway's n choices (after the first choice's first token, each with its own seed;
failures and refusals of a sibling) and `suffix` as a fill-in-the-middle prompt, over a real
nats-server with the openai SDK (the harness: tests/integration/gateway_harness.py)."""

from __future__ import annotations

import time

import openai
import pytest

from shared.protocol import SubmitRequest
from tests.e2e.conftest import real_model_dir  # noqa: F401  (fixture)
from tests.integration.gateway_harness import (  # noqa: F401  (fixtures)
    MESSAGES,
    MODEL,
    REPLY,
    Harness,
    fim_gw_fixture,
    gw_fixture,
)

pytestmark = pytest.mark.e2e


def choice_requests(gw: Harness, count: int) -> list[SubmitRequest]:
    """The last `count` submits, which must be the choices of one request, in order."""
    sent = gw.mesh.submitted[-count:]
    base = sent[0].request_id.removesuffix("-0")
    assert [r.request_id for r in sent] == [f"{base}-{i}" for i in range(count)]
    return sent


def test_n_choices_go_after_the_first_token_with_their_own_seeds(gw: Harness) -> None:
    gw.reply_script()
    client = gw.client()
    reply = client.completions.create(model=MODEL, prompt="Once", n=3, seed=5, max_tokens=20)
    assert [(c.index, c.text) for c in reply.choices] == [(i, REPLY) for i in range(3)]
    sent = choice_requests(gw, 3)
    assert [r.sampling.seed for r in sent] == [5, 6, 7]
    assert all(r.prompt_token_ids == sent[0].prompt_token_ids for r in sent)
    log = gw.mesh.log
    first_token = log.index(("token", sent[0].request_id))
    assert log.index(("submit", sent[0].request_id)) < first_token
    assert first_token < log.index(("submit", sent[1].request_id))
    assert first_token < log.index(("submit", sent[2].request_id))
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [REPLY, REPLY]
    unseeded = choice_requests(gw, 2)
    assert unseeded[0].sampling.seed != unseeded[1].sampling.seed  # each drew its own


def test_first_choice_failing_before_its_first_token_submits_no_sibling(gw: Harness) -> None:
    gw.reply_script()
    gw.mesh.script = [([], None, "prefill worker out of memory")]
    submits = len(gw.mesh.submitted)
    with pytest.raises(openai.InternalServerError, match="out of memory"):
        gw.client().completions.create(model=MODEL, prompt="x", n=4)
    assert len(gw.mesh.submitted) == submits + 1
    assert gw.wait_cancelled(gw.mesh.submitted[-1].request_id)
    gw.mesh.script = []  # accepted, then silence: the stall timeout ends it
    stream = gw.client().completions.create(model=MODEL, prompt="x", n=4, stream=True)
    with pytest.raises(openai.APIError, match="no token"):
        list(stream)
    assert len(gw.mesh.submitted) == submits + 2
    assert gw.wait_cancelled(gw.mesh.submitted[-1].request_id)


def test_a_refused_sibling_is_retried_then_fails_the_request(gw: Harness) -> None:
    gw.reply_script()
    word = gw.text.tokenizer.encode(" word").ids
    gw.mesh.script = [(word, None, "")] * 400  # choice 0 streams for longer than the retries
    gw.mesh.refuse_ending = "-1"
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError, match="choice 1 was refused"):
        gw.client().completions.create(model=MODEL, prompt="x", n=3)
    assert time.monotonic() - started >= 1.0  # retried within the stall timeout (2 s)
    base = gw.mesh.submitted[-1].request_id.removesuffix("-1")
    ids = [r.request_id for r in gw.mesh.submitted if r.request_id.startswith(base)]
    assert ids[0] == f"{base}-0" and ids.count(f"{base}-1") >= 2 and f"{base}-2" not in ids
    assert gw.wait_cancelled(f"{base}-0")  # choice 0 was still streaming: it is cancelled


def test_suffix_is_a_fill_in_the_middle_prompt(gw: Harness, fim_gw: Harness) -> None:
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    with pytest.raises(openai.BadRequestError) as info:
        gw.client().completions.create(model=MODEL, prompt=prefix, suffix=suffix)
    assert info.value.body["param"] == "suffix"
    assert "no fill-in-the-middle tokens" in info.value.body["message"]
    fim_gw.reply_script()
    client = fim_gw.client()
    reply = client.completions.create(model=MODEL, prompt=prefix, suffix=suffix, max_tokens=30)
    assert reply.choices[0].text == REPLY
    tokenizer = fim_gw.text.tokenizer
    pre, suf, mid = (
        tokenizer.token_to_id(f"<|fim_{part}|>") for part in ("prefix", "suffix", "middle")
    )
    encode = tokenizer.encode
    expected = [pre, *encode(prefix).ids, suf, *encode(suffix).ids, mid]
    assert gw.mesh.submitted[-1].prompt_token_ids == expected
    assert reply.usage.prompt_tokens == len(expected)
    echoed = client.completions.create(
        model=MODEL, prompt=prefix, suffix=suffix, echo=True, stream=True, max_tokens=30
    )
    assert "".join(c.choices[0].text for c in echoed) == prefix + REPLY
    assert gw.mesh.submitted[-1].prompt_token_ids == expected
