"""Mixtral and Qwen3-MoE: the Llama-family layer whose MLP routes each token to its top-k
experts.

Router: softmax over all experts in fp32, the top k kept, renormalised to sum to 1 when the
model says so (Mixtral always, Qwen3-MoE by `norm_topk_prob`), as transformers does. The
expert kernel sorts the (token, expert) pairs by expert and runs each expert once over the
tokens that picked it (index_select, one fused gate_up and one down product), adding the
weighted rows back in expert order. A row's result depends only on that row: its experts'
products (batch-invariant when the weights are packed) and a fixed order of additions.
"""

from __future__ import annotations

import torch

from shared.engine.model.decoder import gated_mlp, linear
from shared.engine.model.layer_ops import LayerOps
from shared.engine.model.llama import LlamaModel
from shared.engine.model.weights import ExpertWeights, LayerWeights


class MoeModel(LlamaModel):
    def mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        if layer.experts is None:  # Qwen3-MoE's dense layers
            return self.dense_mlp(x, layer)
        c = self.config
        return routed_experts(
            x, layer.experts, c.num_experts_per_tok, c.norm_topk_prob, c.hidden_act, self.ops
        )


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> ([T, k] float32 weights, [T, k] int64 experts)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def routed_experts(
    x: torch.Tensor,
    experts: ExpertWeights,
    top_k: int,
    renormalize: bool,
    act: str,
    ops: LayerOps | None = None,  # None: torch's SiLU
) -> torch.Tensor:
    """x: [T, hidden] -> [T, hidden]: sum over each token's k experts of weight * expert(x)."""
    weights, chosen = route(linear(x, experts.router), top_k, renormalize)
    flat = chosen.flatten()  # [T * k]: pair j is token j // k
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens ascending
    counts = torch.bincount(flat, minlength=len(experts.gate_up)).tolist()
    rows = order // top_k  # [T * k] the token of each sorted pair
    gathered = x.index_select(0, rows)  # [T * k, hidden]: each expert's tokens contiguous
    y = torch.empty_like(gathered)
    start = 0
    for e, n in enumerate(counts):
        if n:
            group = slice(start, start + n)
            y[group] = gated_mlp(gathered[group], experts.gate_up[e], experts.down[e], act, ops)
        start += n
    y *= weights.flatten()[order].to(x.dtype).unsqueeze(1)
    # a token's k products are added in expert order, whatever else is in the batch
    return torch.zeros_like(x).index_add_(0, rows, y)
