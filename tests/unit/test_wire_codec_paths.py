"""The wire codec's compiled plans: a frame round-trips to an equal message, and a bad value
anywhere is refused with the path to it (fields, list indices, map keys), whether it sits in
a list that the fast path takes whole or deep inside nested messages."""

from __future__ import annotations

import msgpack
import pytest

from shared.engine.sampling_params import SamplingParams
from shared.protocol import SubmitRequest, TokenChunk, TokenLogprob
from shared.wire_codec import SCHEMA_VERSION, WireError, decode, encode

SUBMIT = SubmitRequest(
    "r1",
    "g1",
    list(range(100)),
    SamplingParams(temperature=0.5, stop_token_ids=(2, 3), logit_bias={7: -1.5}, seed=4),
    deadline=1e9,
)
CHUNK = TokenChunk("r1", 0, [5, 6], logprobs=[TokenLogprob(5, -0.5, [(5, -0.5), (9, -2.0)])])


def frame_of(message) -> list:
    return msgpack.unpackb(encode(message), raw=False, strict_map_key=False)


def refusal(message, edit) -> str:
    frame = frame_of(message)
    edit(frame[2])
    with pytest.raises(WireError) as refused:
        decode(msgpack.packb(frame, use_bin_type=True), type(message))
    return str(refused.value)


@pytest.mark.parametrize("message", [SUBMIT, CHUNK])
def test_a_message_round_trips_to_an_equal_one(message):
    assert decode(encode(message), type(message)) == message


def test_the_stop_tuple_and_bias_map_come_back_as_their_types():
    params = decode(encode(SUBMIT), SubmitRequest).sampling
    assert params.stop_token_ids == (2, 3) and params.logit_bias == {7: -1.5}


def test_a_bool_among_the_prompt_ids_is_refused_with_its_index():
    def edit(fields):
        fields["prompt_token_ids"][57] = True

    assert refusal(SUBMIT, edit) == "SubmitRequest.prompt_token_ids[57]: expected int, got bool"


def test_whole_numbers_in_a_float_field_become_floats():
    frame = frame_of(CHUNK)
    frame[2]["logprobs"][0]["top"][1] = [9, -2]
    top = decode(msgpack.packb(frame), TokenChunk).logprobs[0].top
    assert top == [(5, -0.5), (9, -2.0)] and type(top[1][1]) is float


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda f: f["logprobs"][0]["top"][1].append(1.0),
            "TokenChunk.logprobs[0].top[1]: expected 2 items, got 3",
        ),
        (
            lambda f: f["logprobs"][0]["top"][1].__setitem__(0, "x"),
            "TokenChunk.logprobs[0].top[1][0]: expected int, got str",
        ),
        (lambda f: f["logprobs"][0].pop("logprob"), "TokenChunk.logprobs[0].logprob: missing"),
        (
            lambda f: f["logprobs"][0].__setitem__("extra", 1),
            "TokenChunk.logprobs[0]: unknown field(s) ['extra']",
        ),
        (lambda f: f.__setitem__("logprobs", {}), "TokenChunk.logprobs: expected a list"),
    ],
)
def test_a_bad_value_deep_in_a_chunk_is_named_by_its_path(edit, expected):
    assert refusal(CHUNK, edit) == expected


def test_a_bad_map_key_and_value_are_named():
    def bad_key(fields):
        fields["sampling"]["logit_bias"] = {"7": -1.5}

    def bad_value(fields):
        fields["sampling"]["logit_bias"] = {7: "high"}

    assert refusal(SUBMIT, bad_key) == (
        "SubmitRequest.sampling.logit_bias key: expected int, got str"
    )
    assert refusal(SUBMIT, bad_value) == (
        "SubmitRequest.sampling.logit_bias[7]: expected float, got str"
    )


def test_an_optional_field_takes_null_or_its_type_and_nothing_else():
    def null_seed(fields):
        fields["sampling"]["seed"] = None

    frame = frame_of(SUBMIT)
    null_seed(frame[2])
    assert decode(msgpack.packb(frame), SubmitRequest).sampling.seed is None

    def text_seed(fields):
        fields["sampling"]["seed"] = "4"

    assert refusal(SUBMIT, text_seed) == (
        "SubmitRequest.sampling.seed: str matches none of int | None"
    )


def test_a_frame_of_the_wrong_version_is_refused_before_its_fields():
    frame = frame_of(SUBMIT)
    frame[0] = SCHEMA_VERSION + 1
    with pytest.raises(WireError, match="schema version"):
        decode(msgpack.packb(frame), SubmitRequest)
