"""A Llama-family layer as one native call (csrc/cpu/decoder_layer.h), where the layer's
kernels are the C++ ones the Python layer would call anyway: every matrix packed as bf16 pairs
(gate_up with SiLU·up fused), no q/k norms, no biases, the `cpu` attention backend. The call
runs the same kernels in the same order, so the logits are the same bits; it saves the Python
between them, which took 1.3 ms of a 12.3 ms single-row decode step and ~3 ms of a 64-row one
(docs/engine-speed.md, 2026-12-05).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from shared.engine.attention.base import LayerAttention
from shared.engine.attention.cpu_backend import CpuAttention
from shared.engine.attention.metadata import AttentionMetadata
from shared.engine.model.layer_ops import StepRope
from shared.engine.model.weights import LayerWeights

if TYPE_CHECKING:
    from shared.engine.model.decoder import DecoderModel


@dataclass(frozen=True, slots=True)
class NativeLayers:
    kernels: ModuleType
    attention: CpuAttention
    eps: float
    heads: int
    kv_heads: int

    @staticmethod
    def fitting(model: DecoderModel) -> NativeLayers | None:
        """The native call for every layer of `model`, or None where a layer needs more than
        the call does (the Python layer then runs)."""
        native, attention = model.ops.native, model.attention
        if native is None or not isinstance(attention, CpuAttention) or not model.bf16_rows:
            return None
        if not all(_plain(layer) for layer in model.weights.layers):
            return None
        c = model.config
        return NativeLayers(native, attention, c.rms_norm_eps, c.num_heads, c.num_kv_heads)

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
