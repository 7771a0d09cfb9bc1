"""`LoraLinear`: a layer's matrix with the adapters' low-rank products added, per row.

`attach(weights, bank)` wraps the fused qkv, o_proj, gate_up and down of every dense layer;
`model/decoder.linear` computes the base product as before, then asks the bank to add each
adapter's B(A(x)) to its own rows. Rows of the base model get nothing added, so their bits
are the base model's. The one rule: a LoRA engine packs gate_up as a plain matrix (no
SiLU·up inside the matmul, batch_invariant.pack_weights' silu_mlp off), since the adapters'
gate and up products must join before the SiLU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from shared.engine.lora.bank import AdapterBank
from shared.engine.lora.targets import Target
from shared.engine.model.linear_weights import LinearWeight
from shared.engine.model.weights import ModelWeights


@dataclass(slots=True, frozen=True)
class LoraLinear:
    base: LinearWeight
    layer: int
    target: Target
    bank: AdapterBank

    def add_products(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y: the base's product of x -> y with each row's adapter product added."""
        return self.bank.add_products(x, y, self.layer, self.target)


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
