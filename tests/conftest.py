"""Fixtures shared by every test: a tiny random-weight Llama written to a temporary dir.

Without a GPU, Triton kernels run in its interpreter. TRITON_INTERPRET is set here, before
any test module imports triton (vLLM's import does, in the vLLM tests), since a kernel
defined before it was set cannot be interpreted. Engines keep no packed-weight cache in
tests (a start that maps it has other phases than one that packs, and no test may depend
on which ran first), neither in-process nor in the services a test starts
(SPLITSERVE_PACKED_CACHE); tests/unit/test_packed_cache.py turns it on for itself."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shared.engine.model.packed_start import PackedCache

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SPLITSERVE_PACKED_CACHE", "false")

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def write_tiny_model(path: Path, seed: int = 0, **overrides) -> Path:
    """A random Llama in HF layout (config.json, model.safetensors), weights ~N(0, 0.1²) so
    that logits are spread out and greedy choices are not ties."""
    config = {**TINY_CONFIG, **overrides}
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    d = config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    tensors = {"model.embed_tokens.weight": rand(config["vocab_size"], hidden)}
    tensors["model.norm.weight"] = 1 + rand(hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1 + rand(hidden),
            p + "post_attention_layernorm.weight": 1 + rand(hidden),
            p + "self_attn.q_proj.weight": rand(q_out, hidden) * 3,
            p + "self_attn.k_proj.weight": rand(kv_out, hidden) * 3,
            p + "self_attn.v_proj.weight": rand(kv_out, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, q_out),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        }
        if config.get("attention_bias"):
            tensors |= {
                p + "self_attn.q_proj.bias": rand(q_out),
                p + "self_attn.k_proj.bias": rand(kv_out),
                p + "self_attn.v_proj.bias": rand(kv_out),
            }
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(config["vocab_size"], hidden)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


PACKED_CACHE_OF = PackedCache.of  # what test_packed_cache.py puts back


@pytest.fixture(scope="session", autouse=True)
def no_packed_cache() -> Iterator[None]:
    """In-process engines keep no packed-weight cache (test_packed_cache.py's aside)."""
    patch = pytest.MonkeyPatch()
    patch.setattr(PackedCache, "of", classmethod(lambda cls, *args: None))
    yield
    patch.undo()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
