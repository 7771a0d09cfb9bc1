"""Rope scaling as transformers computes it: for each type, our table's rotation at position
p equals attention_factor * e^(i * p * inv_freq) from transformers' own rope init function
at the sequence length HF decoding uses there (p + 1 for dynamic and longrope)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from shared.engine.model.rope import rope_table
from shared.engine.model_config import ModelConfig

MAX_LEN = 96
BASE = {
    "vocab_size": 32,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 48,
}
LONG = {
    "short_factor": [1.0 + 0.2 * i for i in range(8)],
    "long_factor": [1.5 + 0.5 * i for i in range(8)],
}
CASES = {
    "linear": (LlamaConfig, {"rope_type": "linear", "factor": 4.0}),
    "dynamic": (LlamaConfig, {"rope_type": "dynamic", "factor": 3.0}),
    "yarn": (
        LlamaConfig,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 12},
    ),
    "yarn-mscale": (
        LlamaConfig,
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 16,
            "mscale": 0.7,
            "mscale_all_dim": 0.5,
            "beta_fast": 16,
            "beta_slow": 2,
        },
    ),
    "llama3": (
        LlamaConfig,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "longrope": (
        Phi3Config,
        {"rope_type": "longrope", "original_max_position_embeddings": 24, **LONG},
    ),
    "longrope-partial": (
        Phi3Config,
        {
            "rope_type": "longrope",
            "original_max_position_embeddings": 24,
            "partial_rotary_factor": 0.5,
            "short_factor": LONG["short_factor"][:4],
            "long_factor": LONG["long_factor"][:4],
        },
    ),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
def test_table_matches_transformers_rope_init(tmp_path, case, spelling):
    config_cls, scaling = CASES[case]
    theta = 5000.0
    base = BASE.copy()
    if config_cls is Phi3Config:  # Phi-3 keeps it beside the rope parameters
        base["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    hf = config_cls(**base, rope_parameters={"rope_theta": theta, **scaling})
    raw = {"architectures": [config_cls.__name__.replace("Config", "ForCausalLM")], **base}
    if spelling == "rope_parameters":  # transformers 5's config.json
        raw["rope_parameters"] = {"rope_theta": theta, **scaling}
    else:  # transformers 4's: the base beside, `type` for the rope type
        raw["rope_theta"] = theta
        raw["rope_scaling"] = {k: v for k, v in scaling.items() if k != "rope_type"}
        raw["rope_scaling"]["type"] = (
            "su" if scaling["rope_type"] == "longrope" else scaling["rope_type"]
        )
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = rope_table(ModelConfig.from_dir(tmp_path), MAX_LEN)
    init = ROPE_INIT_FUNCTIONS[scaling["rope_type"]]
    for p in range(MAX_LEN):
        inv_freq, attention_factor = init(hf, "cpu", seq_len=p + 1)
        expected = torch.polar(torch.full_like(inv_freq, attention_factor), p * inv_freq.float())
        assert torch.allclose(ours[p], expected, atol=1e-5, rtol=1e-5), (case, p)
    assert ours.shape == (MAX_LEN, len(inv_freq))


def test_unknown_rope_type_is_refused(tmp_path):
    raw = {"architectures": ["LlamaForCausalLM"], **BASE, "rope_scaling": {"rope_type": "wavy"}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="rope_scaling type 'wavy' is not supported"):
        rope_table(ModelConfig.from_dir(tmp_path), 8)
