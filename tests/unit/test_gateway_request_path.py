"""The gateway's request path as values: a model's defaults applied without parsing again,
refusals and failures turned into HTTP only by `api_error`, retries decided on the outcome,
one GatewayRequest's wire id per attempt, a body read and validated once."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.errors import ApiError, api_error
from services.gateway.gateway_request import GatewayRequest, RequestSpec
from services.gateway.model_client import retrying
from services.gateway.openai_schema import parse_request, with_defaults
from services.gateway.refusals import Failure, GenerationFailed, Refused, UpstreamUnavailable
from services.gateway.request_body import RequestBody
from shared.engine.sampling_params import SamplingParams
from shared.models.generation_config import SamplingDefaults
from shared.protocol import Outcome

MODEL_DEFAULTS = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "prompt": "hi"},
        {"model": "m", "prompt": "hi", "temperature": 0.0, "top_k": 5},
        {"model": "m", "prompt": "hi", "top_p": None, "min_p": 0.2},
    ],
)
def test_a_models_defaults_apply_as_parsing_with_them_would(body):
    parsed = parse_request("completion", body)
    assert with_defaults(parsed, MODEL_DEFAULTS) == parse_request(
        "completion", body, MODEL_DEFAULTS
    )


def test_refusals_become_the_clients_statuses():
    busy = api_error(Refused(Outcome.BUSY, "request refused: queue full", 2.5))
    assert (busy.status, busy.message, busy.retry_after) == (
        429,
        "request refused: queue full",
        2.5,
    )
    assert busy.response().headers["Retry-After"] == "3"
    assert api_error(Refused(Outcome.INVALID, "invalid request: x")).status == 400
    assert api_error(Refused(Outcome.UNAVAILABLE, "no worker", 1)).status == 503
    assert api_error(Refused(Outcome.FAILED, "no worker", 1)).status == 503
    upstream = api_error(UpstreamUnavailable("upstream answered 500", 500))
    assert (upstream.status, upstream.code) == (500, "upstream_unavailable")


def test_every_429_and_503_says_when_to_try_again():
    unplaced = api_error(GenerationFailed("no worker in time", Failure.UNPLACED))
    assert unplaced.response().headers["Retry-After"] == "1"
    failed = api_error(Refused(Outcome.FAILED, "internal error"))
    assert (failed.status, failed.retry_after) == (503, 1.0)
    upstream = api_error(UpstreamUnavailable("upstream answered 429", 429))
    assert upstream.response().headers["Retry-After"] == "1"
    busy = GenerationFailed("choice 1", Failure.REFUSED, Refused(Outcome.BUSY, "", 4.0))
    assert api_error(busy).response().headers["Retry-After"] == "4"
    lost = api_error(GenerationFailed("worker lost", Failure.LOST))
    assert lost.status == 502 and "Retry-After" not in lost.response().headers


def test_only_a_refusal_that_allows_it_is_tried_again():
    assert all(Refused(o, "").may_try_again for o in (Outcome.BUSY, Outcome.UNAVAILABLE))
    assert Refused(Outcome.FAILED, "").may_try_again
    assert not Refused(Outcome.INVALID, "").may_try_again
    assert [UpstreamUnavailable("", s).may_try_again for s in (429, 500, 502, 503, 504)] == [
        True, False, True, True, True,
    ]  # fmt: skip


def test_failures_become_the_clients_statuses():
    statuses = {
        f: api_error(GenerationFailed("x", f)).status for f in Failure if f != Failure.REFUSED
    }
    assert statuses == {Failure.LOST: 502, Failure.TIMED_OUT: 504, Failure.UNPLACED: 503}
    refused = GenerationFailed("choice 1 was refused", Failure.REFUSED, Refused(Outcome.BUSY, ""))
    error = api_error(refused)
    assert (error.status, error.code) == (429, "generation_failed") and refused.may_try_again
    assert error.response().headers["Retry-After"] == "1"
    invalid = Refused(Outcome.INVALID, "")
    assert not GenerationFailed("", Failure.REFUSED, invalid).may_try_again


def test_every_attempt_has_its_own_wire_id():
    job = GatewayRequest(RequestSpec("abc", [1, 2], SamplingParams()), 0.0, 0.0, 0.0)
    assert job.wire_id == "abc"
    job.attempt = 2
    assert job.wire_id == "abc~2"


def test_retrying_waits_out_a_busy_refusal_but_not_an_invalid_one():
    async def scenario() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        calls = {"busy": 0, "invalid": 0}

        async def busy_then_ok() -> int:
            calls["busy"] += 1
            if calls["busy"] < 3:
                raise Refused(Outcome.BUSY, "full", 0.0)
            return 7

        async def invalid() -> int:
            calls["invalid"] += 1
            raise Refused(Outcome.INVALID, "bad")

        assert await retrying(busy_then_ok, loop.time() + 5) == 7
        with pytest.raises(Refused):
            await retrying(invalid, loop.time() + 5)
        return calls["busy"], calls["invalid"]

    assert asyncio.run(scenario()) == (3, 1)


def test_a_body_is_validated_once():
    body = RequestBody("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert body.model == "m" and body.parsed() is body.parsed()
    with pytest.raises(ApiError, match="not valid JSON"):
        RequestBody("chat", None).parsed()
    assert RequestBody("chat", [1]).model is None
