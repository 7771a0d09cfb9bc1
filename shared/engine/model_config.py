"""The model's shape and numerics, read from an HF-layout `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Llama-family decoder hyper-parameters (Llama 2/3, SmolLM, Mistral, Qwen2)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, float | str] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        architecture = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{model_dir}: architecture {architecture} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        heads = raw["num_attention_heads"]
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", architecture == "Qwen2ForCausalLM")),
            rope_scaling=dict(raw.get("rope_scaling") or {}),
            eos_token_ids=_eos_ids(Path(model_dir), raw),
        )


def _eos_ids(model_dir: Path, raw: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present (it wins, as in HF), else config.json."""
    gen_path = model_dir / "generation_config.json"
    value = raw.get("eos_token_id")
    if gen_path.exists():
        value = json.loads(gen_path.read_text()).get("eos_token_id", value)
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)
