"""Every field the gateway sends, as vLLM's sampling parameters (vllm_sampling.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (make install ENGINE=vllm)")

from services.worker.vllm_sampling import request_seed, to_vllm
from shared.engine.errors import InvalidRequest
from shared.engine.sampling_params import SamplingParams


def test_every_field_maps():
    ours = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        logit_bias={7: 2.0},
        seed=11,
        stop_token_ids=(2, 3),
        ignore_eos=True,
        min_tokens=3,
        max_tokens=20,
        logprobs=5,
        guided_kind="regex",
        guided_spec="[a-z]+",
    )
    theirs = to_vllm("r", ours, num_delivered=0)
    assert (theirs.temperature, theirs.top_p, theirs.top_k, theirs.min_p) == (0.7, 0.9, 40, 0.05)
    assert theirs.repetition_penalty == 1.1
    assert (theirs.frequency_penalty, theirs.presence_penalty) == (0.5, -0.5)
    assert theirs.logit_bias == {7: 2.0}
    assert theirs.seed == 11 and theirs.stop_token_ids == [2, 3] and theirs.ignore_eos
    assert (theirs.min_tokens, theirs.max_tokens, theirs.logprobs) == (3, 20, 5)
    assert theirs.structured_outputs.regex == "[a-z]+"


def test_a_resumed_request_asks_for_what_it_lacks():
    theirs = to_vllm("r", SamplingParams(max_tokens=20, min_tokens=8), num_delivered=5)
    assert (theirs.max_tokens, theirs.min_tokens) == (15, 3)
    with pytest.raises(InvalidRequest) as err:
        to_vllm("r", SamplingParams(max_tokens=5), num_delivered=5)
    assert err.value.field == "max_tokens"


def test_a_prefill_runs_one_token_and_keeps_its_kv_for_the_decode_engine():
    params = {"do_remote_decode": True}
    theirs = to_vllm(
        "r", SamplingParams(max_tokens=20, min_tokens=4), 0, max_tokens=1, kv_transfer_params=params
    )
    assert (theirs.max_tokens, theirs.min_tokens) == (1, 1)
    assert theirs.extra_args == {"kv_transfer_params": params}


def test_unseeded_requests_get_the_same_seed_on_every_worker():
    assert request_seed("abc", None) == request_seed("abc", None) != request_seed("abd", None)
    assert request_seed("abc", 5) == 5
    assert to_vllm("abc", SamplingParams(), 0).seed == request_seed("abc", None)


@pytest.mark.parametrize(
    ("kind", "spec", "field"),
    [("choice", "[1, 2]", "guided_spec"), ("choice", "not json", "guided_spec")],
)
def test_a_spec_vllm_cannot_take_is_refused_naming_the_field(kind, spec, field):
    with pytest.raises(InvalidRequest) as err:
        to_vllm("r", SamplingParams(guided_kind=kind, guided_spec=spec), 0)
    assert err.value.field == field


def test_guided_kinds():
    def guided(kind: str, spec: str = ""):
        return to_vllm(
            "r", SamplingParams(guided_kind=kind, guided_spec=spec), 0
        ).structured_outputs

    assert guided("json_object").json_object is True
    assert guided("json_schema", '{"type": "object"}').json == '{"type": "object"}'
    assert guided("grammar", 'root ::= "a"').grammar == 'root ::= "a"'
    assert guided("choice", '["yes", "no"]').choice == ["yes", "no"]
    assert to_vllm("r", SamplingParams(), 0).structured_outputs is None
