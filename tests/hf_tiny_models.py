"""Tiny random-weight checkpoints of every family the engine serves, built with
transformers' own config and model classes and saved as safetensors (save_pretrained)."""

from __future__ import annotations

from pathlib import Path

import torch

SMALL = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "initializer_range": 0.15,  # spread-out logits: greedy choices are not near-ties
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
WINDOW = 20  # sliding window of the windowed families: prompts run well past it

FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen3": ("Qwen3", {"tie_word_embeddings": False}),
    "qwen3-window": (
        "Qwen3",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "mistral-window": ("Mistral", {"sliding_window": WINDOW}),
    "mixtral": ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3-moe": (
        "Qwen3Moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
    "qwen3-moe-unnormed": (
        "Qwen3Moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": False,
        },
    ),
    "gemma2": (
        "Gemma2",
        {
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "gemma3": (
        "Gemma3Text",
        {
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    "phi3-longrope": (
        "Phi3",
        {
            "partial_rotary_factor": 0.75,
            "sliding_window": WINDOW,
            "original_max_position_embeddings": 128,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(6)],
                "long_factor": [2.0 + 0.3 * i for i in range(6)],
                "original_max_position_embeddings": 128,
            },
        },
    ),
}


def write_hf_model(
    path: Path,
    family: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **overrides,
) -> Path:
    """The checkpoint of `family` (a key of FAMILIES) under `path`, its weights in `dtype`,
    in shards of at most `max_shard_size` (with model.safetensors.index.json); returns path."""
    import transformers

    prefix, extra = FAMILIES[family]
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix.removesuffix('Text')}ForCausalLM")
    config = config_cls(**(SMALL | extra | overrides))
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # norms away from their init (ones, or Gemma's zeros)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.to(dtype)
    if max_shard_size is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    return path
