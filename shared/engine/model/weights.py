"""Load an HF-layout checkpoint from safetensors into the engine's fused layout.

Every family lands in the same `LayerWeights`: q, k, v fused (q and k rows interleaved for
rope), gate and up fused, the family's extra norms, and for MoE layers the router and the
experts instead of the dense MLP. Names differ per family (Phi-3 stores qkv and gate_up
fused already; Mixtral calls its experts w1/w3/w2); the checkpoint files come from
checkpoint.py (sharded or not, any float dtype, cast to the engine's). Matrices a pull kept
quantized load as `GroupQuantLinear`s (group_quant.py): the same row operations (rope
interleave, fusing) on whole quantized rows, the embedding too (read by rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from shared.engine.model.checkpoint import Checkpoint
from shared.engine.model.group_quant import GroupQuant, GroupQuantLinear, stack_rows
from shared.engine.model.linear_weights import LinearWeight
from shared.engine.model.rope import interleave_permutation
from shared.engine.model_config import ModelConfig

CPU = torch.device("cpu")


Matrix = torch.Tensor | GroupQuant  # a matrix as the checkpoint holds it


def column_major(w: Matrix) -> Matrix:
    """The same [out, in] matrix stored as [in, out]: F.linear then streams it in the order
    that is fastest for the few-row products of decoding (docs/ARCHITECTURE.md, "Model").
    A quantized one has its kernel's layout already."""
    return w.t().contiguous().t() if isinstance(w, torch.Tensor) else w


def _same(w: Matrix) -> Matrix:
    return w


def _rows(w: Matrix, rows: torch.Tensor) -> Matrix:
    """Rows `rows` [R] int64 of a float or quantized matrix."""
    if isinstance(w, GroupQuantLinear):
        return w.take_rows(rows)
    assert isinstance(w, torch.Tensor), "row blocks of a single layout"
    return w[rows]


@dataclass(slots=True)
class ExpertWeights:
    """One MoE layer's router and routed experts (Mixtral, Qwen3-MoE)."""

    router: LinearWeight  # [num_experts, hidden]
    gate_up: list[LinearWeight]  # per expert [2 * moe_intermediate, hidden]
    down: list[LinearWeight]  # per expert [hidden, moe_intermediate]

    def map(self, fn: Callable[[LinearWeight], LinearWeight]) -> ExpertWeights:
        """The same experts with every matrix replaced by fn(matrix)."""
        return ExpertWeights(
            fn(self.router), [fn(w) for w in self.gate_up], [fn(w) for w in self.down]
        )


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    # [(heads + 2 * kv_heads) * head_dim, hidden]; q and k rows interleaved
    qkv: LinearWeight
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim] (Qwen2)
    o_proj: LinearWeight  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]: the norm before the MLP
    gate_up: LinearWeight | None  # [2 * intermediate, hidden]; None in an MoE layer
    down: LinearWeight | None  # [hidden, intermediate]; None in an MoE layer
    q_norm: torch.Tensor | None = None  # [head_dim], interleaved as q (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # [head_dim]
    attn_out_norm: torch.Tensor | None = None  # [hidden] on the attention output (Gemma)
    mlp_out_norm: torch.Tensor | None = None  # [hidden] on the MLP output (Gemma)
    experts: ExpertWeights | None = None

    def linears(self) -> tuple[Any, ...]:
        """Its four matrices: qkv, o_proj, gate_up, down."""
        return (self.qkv, self.o_proj, self.gate_up, self.down)

    def map_linears(self, fn: Callable[[Any], Any]) -> LayerWeights:
        """A copy with `fn` of each of its four matrices (qkv, o_proj, gate_up, down)."""
        return replace(
            self,
            qkv=fn(self.qkv),
            o_proj=fn(self.o_proj),
            gate_up=fn(self.gate_up),
            down=fn(self.down),
        )


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor | GroupQuantLinear  # [vocab, hidden]
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
    ckpt = Checkpoint(Path(model_dir), dtype, device)
    d = config.head_dim
    perm = interleave_permutation(d, config.rotated_dims).to(device)
    # The CPU's matmul is fastest on the column-major layout for decoding's few rows; a
    # GPU's takes the checkpoint's own [out, in] layout, and the head is not stored twice.
    layout = column_major if device.type == "cpu" else _same
    offset = config.norm_offset

    def interleave(w: Matrix, heads: int) -> Matrix:
        if isinstance(w, torch.Tensor):
            return w.view(heads, d, -1)[:, perm].reshape(w.shape)
        return _rows(w, (torch.arange(heads)[:, None] * d + perm.cpu()).reshape(-1))

    def norm(name: str) -> torch.Tensor:
        return ckpt.take(name, offset)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        q, k, v = _qkv(ckpt, config, p + "self_attn.")
        q, k = interleave(q, config.num_heads), interleave(k, config.num_kv_heads)
        bias = None
        if config.attention_bias:
            qb = interleave(ckpt.take(p + "self_attn.q_proj.bias"), config.num_heads)
            kb = interleave(ckpt.take(p + "self_attn.k_proj.bias"), config.num_kv_heads)
            bias = torch.cat([qb, kb, ckpt.take(p + "self_attn.v_proj.bias")])
        gemma = config.sandwich_norms
        experts = _experts(ckpt, config, p, layout) if config.is_moe_layer(i) else None
        gate_up = None if experts else _gate_up(ckpt, config, p + "mlp.")
        layers.append(
            LayerWeights(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=layout(stack_rows([q, k, v])),
                qkv_bias=bias,
                o_proj=layout(ckpt.take_linear(p + "self_attn.o_proj.weight")),
                post_norm=norm(
                    p
                    + ("pre_feedforward_layernorm" if gemma else "post_attention_layernorm")
                    + ".weight"
                ),
                gate_up=None if gate_up is None else layout(gate_up),
                down=None if experts else layout(ckpt.take_linear(p + "mlp.down_proj.weight")),
                q_norm=norm(p + "self_attn.q_norm.weight")[perm] if config.qk_norm else None,
                k_norm=norm(p + "self_attn.k_norm.weight")[perm] if config.qk_norm else None,
                attn_out_norm=norm(p + "post_attention_layernorm.weight") if gemma else None,
                mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if gemma else None,
                experts=experts,
            )
        )
    embed = ckpt.take_linear("model.embed_tokens.weight")
    tied = config.tie_word_embeddings or not ckpt.has("lm_head.weight")
    lm_head = embed if tied else ckpt.take_linear("lm_head.weight")
    ckpt.discard("lm_head.weight")  # some tied checkpoints store the copy anyway
    weights = ModelWeights(
        embed=embed,
        layers=layers,
        norm=norm("model.norm.weight"),
        lm_head=lm_head,
        lm_head_column_major=layout(lm_head),
    )
    ckpt.check_all_used()
    return weights


def _qkv(ckpt: Checkpoint, config: ModelConfig, p: str) -> tuple[Matrix, Matrix, Matrix]:
    """[heads * d, hidden], [kv_heads * d, hidden] twice: Phi-3's fused qkv_proj split."""
    if ckpt.has(p + "qkv_proj.weight"):
        qkv = ckpt.take_linear(p + "qkv_proj.weight")
        q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        edges = [0, q_rows, q_rows + kv_rows, q_rows + 2 * kv_rows]
        q, k, v = (_rows(qkv, torch.arange(a, b)) for a, b in pairwise(edges))
        return q, k, v
    return tuple(ckpt.take_linear(p + f"{x}_proj.weight") for x in "qkv")  # type: ignore[return-value]


def _gate_up(ckpt: Checkpoint, config: ModelConfig, p: str) -> Matrix:
    """[2 * intermediate, hidden]: gate rows then up rows (Phi-3 stores them so)."""
    if ckpt.has(p + "gate_up_proj.weight"):
        return ckpt.take_linear(p + "gate_up_proj.weight")
    gate, up = ckpt.take_linear(p + "gate_proj.weight"), ckpt.take_linear(p + "up_proj.weight")
    return stack_rows([gate, up])


def _experts(
    ckpt: Checkpoint, config: ModelConfig, p: str, layout: Callable[[torch.Tensor], torch.Tensor]
) -> ExpertWeights:
    """Mixtral's block_sparse_moe.experts.E.w1/w3/w2 or Qwen3-MoE's mlp.experts.E.*_proj."""
    mixtral = ckpt.has(p + "block_sparse_moe.gate.weight")
    base = p + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    gate_up, down = [], []
    for e in range(config.num_experts):  # float or kept quantized (GGUF --keep-quant)
        ep = f"{base}experts.{e}."
        gate, up = (ckpt.take_linear(f"{ep}{n}.weight") for n in names[:2])
        gate_up.append(layout(stack_rows([gate, up])))
        down.append(layout(ckpt.take_linear(f"{ep}{names[2]}.weight")))
    return ExpertWeights(ckpt.take_linear(base + "gate.weight"), gate_up, down)
