"""A model's generation_config.json: its sampling values are the defaults of a request that
leaves them out; what a request sets wins; no file means OpenAI's defaults."""

from __future__ import annotations

import json

from services.gateway.openai_schema import parse_request
from shared.models.generation_config import SamplingDefaults, load_sampling_defaults


def test_model_defaults_fill_what_the_request_leaves_out(tmp_path):
    generation = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                  "eos_token_id": [2, 7], "repetition_penalty": True}  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    defaults = load_sampling_defaults(tmp_path)
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    body = {"model": "m", "prompt": "hi", "top_p": 0.5}
    sampling = parse_request("completion", body, defaults).sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.6, 0.5, 20)


def test_no_generation_config_means_openai_defaults(tmp_path):
    assert load_sampling_defaults(tmp_path) == SamplingDefaults()
    sampling = parse_request("completion", {"model": "m", "prompt": "hi"}).sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (1.0, 1.0, 0)
