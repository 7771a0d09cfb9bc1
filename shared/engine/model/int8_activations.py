"""--group-quant-activations int8: a checkpoint's kept-quantized matrices switched to the
kernel that quantizes activations to int8 per block (model/group_quant.py's
`with_int8_activations`; csrc/cpu/linear_group_quant_int8.cpp). Float matrices, and kept ones
whose layout that kernel does not take, stay as they are: every row of one matrix always goes
through one kernel, so the switch keeps batch invariance."""

from __future__ import annotations

from dataclasses import replace

from shared.engine.model.group_quant import GroupQuantLinear, GroupQuantParts
from shared.engine.model.linear_weights import LinearWeight
from shared.engine.model.weights import ModelWeights


def with_int8_activations(
    weights: ModelWeights, vector: bool, panels: str | None = None
) -> ModelWeights:
    """`weights` with every layer matrix (MoE experts too) and the head kept quantized on the
    int8 kernel (vector: its AVX512-VNNI or AVX2 path, else the generic model of it; panels:
    "amx" or "vnni", the GGUF formats it takes repacked into panels of 16 columns,
    `GroupQuantLinear.with_int8_activations`)."""

    def switch(w: LinearWeight | None) -> LinearWeight | None:
        if isinstance(w, GroupQuantLinear | GroupQuantParts):
            return w.with_int8_activations(vector, panels)
        return w

    layers = [
        replace(layer.map_linears(switch), experts=layer.experts and layer.experts.map(switch))
        for layer in weights.layers
    ]
    head = switch(weights.lm_head)
    column_major = head if weights.lm_head_column_major is weights.lm_head else None
    return replace(
        weights,
        layers=layers,
        lm_head=head,
        lm_head_column_major=column_major or switch(weights.lm_head_column_major),
    )
