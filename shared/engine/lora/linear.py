"""`LoraLinear`: a layer's matrix with the adapters' low-rank products added, per row.

`attach(weights, bank)` wraps the fused qkv, o_proj, gate_up and down of every dense layer;
`model/decoder.linear` computes the base product as before, then asks the bank to add each
adapter's B(A(x)) to its own rows. Rows of the base model get nothing added, so their bits
are the base model's. A SiLU MLP's gate_up stays packed for SiLU·up inside the matmul
(`PackedGateUp`), as the plain engine packs it: a step without adapter rows runs it so
(and each layer as one native call where the plain engine would: `base_layer`); a step with
adapter rows takes the matmul's product (gate's and up's columns in turns of 64), adds the
adapters' products to it in place (the kernel's interleave) and applies SiLU·up to it.

The one rule: whichever path a step takes, a base row's bits are the plain engine's (the
packed kernel's SiLU·up is the same `silu_mul_row` over the same product).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from shared.engine.lora.bank import AdapterBank
from shared.engine.lora.targets import Target
from shared.engine.model.linear_weights import PANEL, LinearWeight, PackedGateUp
from shared.engine.model.weights import LayerWeights, ModelWeights


@dataclass(slots=True, frozen=True)
class LoraLinear:
    base: LinearWeight
    layer: int
    target: Target
    bank: AdapterBank

    def add_products(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y: the base's product of x -> y with each row's adapter product added."""
        return self.bank.add_products(x, y, self.layer, self.target)

    def silu_mul(self, x: torch.Tensor, bf16_out: bool) -> torch.Tensor:
        """A packed gate_up's silu(gate) * up [T, inter], each row's adapter products added
        to gate and up before the SiLU; a step without adapter rows: the packed kernel's."""
        base = self.base
        assert isinstance(base, PackedGateUp), "silu_mul: over a packed SiLU gate_up"
        if not self.bank.has_rows:
            return base.silu_mul(x, bf16_out)
        product = base.product(x)
        self.bank.add_products(x, product, self.layer, self.target, PANEL)  # in turns
        return base.silu_mul_of(product)


def base_of(w: LinearWeight | LoraLinear | None) -> LinearWeight | None:
    """The matrix itself, without any adapters wrapped around it."""
    return w.base if isinstance(w, LoraLinear) else w


def base_layer(layer: LayerWeights) -> LayerWeights:
    """`layer` with its base matrices (the layer itself where no adapters wrap them)."""
    if not any(isinstance(w, LoraLinear) for w in layer.linears()):
        return layer
    return layer.map_linears(base_of)


def bank_of(layers: list[LayerWeights]) -> AdapterBank | None:
    """The adapters wrapped around the layers' matrices (None: a model without LoRA)."""
    for layer in layers:
        for w in layer.linears():
            if isinstance(w, LoraLinear):
                return w.bank
    return None


def attach(weights: ModelWeights, bank: AdapterBank) -> ModelWeights:
    """Wrap every dense layer's matrices in place (MoE layers: their attention only)."""
    for i, layer in enumerate(weights.layers):

        def wrap(w: LinearWeight | None, target: Target, i: int = i) -> LinearWeight | None:
            return None if w is None else LoraLinear(w, i, target, bank)  # type: ignore[return-value]

        weights.layers[i] = replace(
            layer,
            qkv=wrap(layer.qkv, Target.QKV),
            o_proj=wrap(layer.o_proj, Target.O_PROJ),
            gate_up=wrap(layer.gate_up, Target.GATE_UP),
            down=wrap(layer.down, Target.DOWN),
        )
    return weights
