"""A Llama-family layer as one native call (csrc/cpu/decoder_layer.h), for layers whose
kernels are the C++ ones the Python layer would call anyway: every matrix packed as bf16 pairs
(gate_up with SiLU·up fused), no q/k norms, no biases, the `cpu` attention backend.

The one rule: the call runs the same kernels in the same order as the Python layer, so the
logits are the same bits; `NativeLayers.fitting` refuses any model with a layer that needs
more. What it saves: docs/engine-speed.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from shared.engine.attention import AttentionBackend
from shared.engine.attention.base import LayerAttention
from shared.engine.attention.cpu_backend import CpuAttention
from shared.engine.attention.metadata import AttentionMetadata
from shared.engine.model.layer_ops import StepRope
from shared.engine.model.weights import LayerWeights
from shared.engine.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class NativeLayers:
    kernels: ModuleType
    attention: CpuAttention
    eps: float
    heads: int
    kv_heads: int

    @staticmethod
    def fitting(
        native: ModuleType | None,  # the fused ops' module (LayerOps.native); None: torch ops
        attention: AttentionBackend,
        config: ModelConfig,
        layers: list[LayerWeights],
        bf16_rows: bool,  # DecoderModel.bf16_rows
    ) -> NativeLayers | None:
        """The native call for every layer of a model, or None where a layer needs more than
        the call does (the Python layer then runs)."""
        if native is None or not isinstance(attention, CpuAttention) or not bf16_rows:
            return None
        if not all(_plain(layer) for layer in layers):
            return None
        return NativeLayers(
            native, attention, config.rms_norm_eps, config.num_heads, config.num_kv_heads
        )

    def __call__(
        self,
        h: torch.Tensor,  # [T, hidden] fp32, the residual stream
        y: torch.Tensor | None,  # [T, hidden] fp32: the previous layer's MLP output
        layer: LayerWeights,
        cache: torch.Tensor,
        rope: StepRope,
        meta: AttentionMetadata,
        keep: torch.Tensor | None,  # [S] int64: the rows that go on past attention
        attention: LayerAttention,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (h, this layer's MLP output)
        plan = self.attention.plan(meta, cache.shape[1])
        h, y = self.kernels.decoder_layer(
            h, y, layer.input_norm, layer.post_norm, self.eps,
            layer.qkv.packed, layer.o_proj.packed, layer.gate_up.packed, layer.gate_up.inter,
            layer.down.packed, rope.table, rope.positions, cache, meta.slot_mapping,
            plan.block_tables, plan.row_table, plan.row_context, self.heads, self.kv_heads,
            attention.scale, attention.window, attention.softcap, keep,
        )  # fmt: skip
        return h, y


def _plain(layer: LayerWeights) -> bool:
    """A layer the native call computes as the Python layer does, its matrices already
    pair-packed (DecoderModel.bf16_rows): nothing beside them."""
    return (
        layer.q_norm is None
        and layer.k_norm is None
        and layer.qkv_bias is None
        and layer.attn_out_norm is None
        and layer.mlp_out_norm is None
        and layer.experts is None
    )
