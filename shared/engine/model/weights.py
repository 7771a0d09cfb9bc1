"""Load an HF-layout checkpoint from safetensors into the engine's fused layout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from shared.engine.model.linear_weights import LinearWeight
from shared.engine.model.rope import interleave_permutation
from shared.engine.model_config import ModelConfig

CPU = torch.device("cpu")


def column_major(w: torch.Tensor) -> torch.Tensor:
    """The same [out, in] matrix stored as [in, out]: F.linear then streams it in the order
    that is fastest for the few-row products of decoding (measured: ~1.4x at one row)."""
    return w.t().contiguous().t()


def _same(w: torch.Tensor) -> torch.Tensor:
    return w


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    # [(heads + 2 * kv_heads) * head_dim, hidden]; q and k rows interleaved
    qkv: LinearWeight
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim] (Qwen2)
    o_proj: LinearWeight  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: LinearWeight  # [2 * intermediate, hidden]
    down: LinearWeight  # [hidden, intermediate]


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: LinearWeight  # [vocab, hidden]; tied: the embedding
    # the same, laid out for torch's 1-2 row products (packed or quantized: the same object)
    lm_head_column_major: LinearWeight


def load_weights(
    model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device = CPU
) -> ModelWeights:
    """The checkpoint in `dtype` on `device`. Each tensor moves there as it is read, so the
    host never holds more than one tensor of a model bound for a GPU."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = handle.get_tensor(name).to(device=device, dtype=dtype)

    def take(name: str) -> torch.Tensor:
        try:
            return tensors.pop(name)
        except KeyError:
            raise KeyError(f"{model_dir}: tensor {name} is missing") from None

    d = config.head_dim
    perm = interleave_permutation(d).to(device)
    # The CPU's matmul is fastest on the column-major layout for decoding's few rows; a
    # GPU's takes the checkpoint's own [out, in] layout, and the head is not stored twice.
    layout = column_major if device.type == "cpu" else _same

    def interleave(w: torch.Tensor, heads: int) -> torch.Tensor:
        return w.view(heads, d, -1)[:, perm].reshape(w.shape)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        q = interleave(take(p + "self_attn.q_proj.weight"), config.num_heads)
        k = interleave(take(p + "self_attn.k_proj.weight"), config.num_kv_heads)
        v = take(p + "self_attn.v_proj.weight")
        bias = None
        if config.attention_bias:
            qb = interleave(take(p + "self_attn.q_proj.bias"), config.num_heads)
            kb = interleave(take(p + "self_attn.k_proj.bias"), config.num_kv_heads)
            bias = torch.cat([qb, kb, take(p + "self_attn.v_proj.bias")])
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=layout(torch.cat([q, k, v])),
                qkv_bias=bias,
                o_proj=layout(take(p + "self_attn.o_proj.weight")),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=layout(
                    torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
                ),
                down=layout(take(p + "mlp.down_proj.weight")),
            )
        )
    embed = take("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else take("lm_head.weight")
    tensors.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    weights = ModelWeights(
        embed=embed,
        layers=layers,
        norm=take("model.norm.weight"),
        lm_head=lm_head,
        lm_head_column_major=layout(lm_head),
    )
    unused = [name for name in tensors if "rotary_emb" not in name]
    if unused:
        raise ValueError(f"{model_dir}: unexpected tensors {unused[:5]}")
    return weights
