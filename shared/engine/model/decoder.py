"""What every decoder family shares: rope tables, the attention block over the paged KV
cache (q/k norms, partial rope, per-layer window and soft-cap), the gated MLP, the final
norm and LM head. Each family's file (llama.py, moe.py, gemma.py) writes only its layer
loop from these parts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.engine.attention import AttentionBackend
from shared.engine.attention.base import LayerAttention
from shared.engine.attention.metadata import AttentionMetadata
from shared.engine.lora.bank import AdapterBank
from shared.engine.lora.linear import LoraLinear, bank_of, base_layer, base_of
from shared.engine.model.group_quant import GroupQuantLinear
from shared.engine.model.layer_ops import LayerOps, StepRope, layer_ops
from shared.engine.model.linear_weights import LinearWeight, PackedGateUp, PackedLinear
from shared.engine.model.native_layer import NativeLayers
from shared.engine.model.rope import rope_table
from shared.engine.model.weights import LayerWeights, ModelWeights
from shared.engine.model_config import ModelConfig


class DecoderModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        attention: AttentionBackend,
        max_len: int,
    ) -> None:
        self.config = config
        self.weights = weights
        self.attention = attention
        device = weights.embed.device
        # [max_len, rotated_dims/2] complex64, beside the weights
        self.rotations = rope_table(config, max_len).to(device)
        # Gemma 3's sliding layers: their own base, no scaling
        self.local_rotations = (
            rope_table(config, max_len, config.local_rope_theta, {}).to(device)
            if config.local_rope_theta
            else self.rotations
        )
        # The residual stream's dtype: fp32 beside packed weights (batch_invariant.py), else
        # the weights' own. The embedding rows and attention's q/kv convert at the edges.
        self.act_dtype = weights.norm.dtype
        self.ops: LayerOps = layer_ops(attention, config.rms_norm_eps)
        # The norms and SiLU·up hand the matmuls bf16 rows where every matmul of a layer would
        # round its rows to bf16 anyway: the same bits, without a conversion pass per matmul.
        self.bf16_rows = all(_rounds_rows_to_bf16(layer) for layer in weights.layers)
        self.layer_attention = [
            LayerAttention(config.softmax_scale, config.window_of(i), config.attn_softcap)
            for i in range(config.num_layers)
        ]
        # a family whose layer loop can run each layer as one native call sets this
        # (llama.py); None: the Python layer
        self.native_layers: NativeLayers | None = None
        # LoRA (lora/linear.py): the bank whose adapters wrap the matrices, and the layers
        # as the native call takes them, without (a step without adapter rows runs those)
        self.adapters: AdapterBank | None = bank_of(weights.layers)
        self.base_layers = [base_layer(layer) for layer in weights.layers]

    def native_call(self) -> NativeLayers | None:
        """The native layer call for this step: None where the Python layer runs (a family or
        model without it, or a step with rows of an adapter)."""
        if self.adapters is not None and self.adapters.has_rows:
            return None
        return self.native_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, hidden] in act_dtype (a quantized table: its rows dequantized)."""
        if isinstance(self.weights.embed, GroupQuantLinear):
            return self.weights.embed.dequantize(input_ids).to(self.act_dtype)
        return F.embedding(input_ids, self.weights.embed).to(self.act_dtype)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
        """RMSNorm over the last axis; Gemma's (1 + w) offset is already in `weight`."""
        return self.ops.norm(x, weight, bf16_out)

    def self_attention(
        self,
        i: int,
        x: torch.Tensor,  # [T, hidden], normed
        layer: LayerWeights,
        cache: torch.Tensor,
        rope: StepRope,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,  # [S] int64: the rows that go on to o_proj; None: all
    ) -> torch.Tensor:  # [T or S, hidden], after o_proj
        c = self.config
        t = x.shape[0]
        heads, kv_heads, d = c.num_heads, c.num_kv_heads, c.head_dim
        qkv = linear(x, layer.qkv, layer.qkv_bias).view(t, heads + 2 * kv_heads, d)
        if layer.q_norm is not None:  # per head, before rope (Qwen3, Gemma 3)
            qkv[:, :heads] = self.norm(qkv[:, :heads], layer.q_norm)
            qkv[:, heads : heads + kv_heads] = self.norm(
                qkv[:, heads : heads + kv_heads], layer.k_norm
            )
        # attention reads q (and, for a backend that reads_new_kv, the new kv) in the cache's
        # dtype: the native kernel rounds q in its rotation pass, else the query heads alone
        # convert to a contiguous [T, heads, d] in one pass
        q = self.ops.rope_write_kv(qkv, heads, rope, cache, meta, self.attention)
        if self.attention.reads_new_kv:
            qkv = qkv.to(cache.dtype)
        if q is None:
            q = qkv[:, :heads].to(cache.dtype)
        kv = qkv[:, heads:].view(t, 2, kv_heads, d)
        attn = self.attention.attend(q, kv, cache, meta, self.layer_attention[i])  # [T, heads, d]
        attn = attn.reshape(t, heads * d)
        if keep is not None:
            attn = attn[keep]
        if not isinstance(base_of(layer.o_proj), PackedLinear):  # takes the bf16 rows as is
            attn = attn.to(x.dtype)
        return linear(attn, layer.o_proj)

    def rows_kept_after(self, i: int, logits_rows: torch.Tensor, t: int) -> torch.Tensor | None:
        """The rows that layer `i` carries past its attention: after the last layer's (its KV
        written), only those whose logits are wanted, since the other rows' o_proj and MLP
        would feed nothing (most of a prompt's rows: ~3% of a prefill step's arithmetic).
        None: every row. With the batch-invariant kernels a row's bits never depend on the rows
        beside it, so the logits are bit for bit those of every row carried through."""
        if i < self.config.num_layers - 1 or logits_rows.shape[0] == t:
            return None
        return logits_rows

    def dense_mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        return gated_mlp(
            x, layer.gate_up, layer.down, self.config.hidden_act, self.ops, self.bf16_rows
        )

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [S, hidden], the wanted rows before the final norm -> [S, vocab] float32."""
        w = self.weights
        h = self.norm(h, w.norm)
        # With torch's matmul, the two layouts of the head are each fastest for a different
        # number of rows; packed (batch-invariant) and quantized heads have a single layout.
        head = w.lm_head_column_major if h.shape[0] <= 2 else w.lm_head
        logits = linear(h, head).float()
        cap = self.config.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits


def gated_mlp(
    x: torch.Tensor,
    gate_up: LinearWeight,
    down: LinearWeight,
    act: str,
    ops: LayerOps | None = None,  # None: torch's SiLU
    bf16_rows: bool = False,  # SiLU·up in bf16 for down (DecoderModel.bf16_rows)
) -> torch.Tensor:
    """x: [T, hidden] -> [T, hidden]: down(act(gate(x)) * up(x)), gate and up fused."""
    if isinstance(base_of(gate_up), PackedGateUp):  # a SiLU MLP's, SiLU·up inside the matmul
        return linear(gate_up.silu_mul(x, bf16_rows), down)  # adapters: theirs added first
    fused = linear(x, gate_up)
    if act == "silu":
        return linear(ops.silu_mul(fused) if ops else silu_mul(fused), down)
    inter = fused.shape[1] // 2
    return linear(F.gelu(fused[:, :inter], approximate="tanh") * fused[:, inter:], down)


def silu_mul(fused: torch.Tensor) -> torch.Tensor:
    """fused [T, 2 * inter] (gate, up) -> silu(gate) * up [T, inter], by torch's ops."""
    inter = fused.shape[1] // 2
    return F.silu(fused[:, :inter]) * fused[:, inter:]


def linear(
    x: torch.Tensor,
    w: LinearWeight | LoraLinear,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, in] -> [T, out]. `w` is a float matrix (torch's matmul), one packed by
    `batch_invariant.pack_weights` (the batch-invariant C++ kernel: fp32 out, the residual
    stream's dtype beside packed weights, whether x's rows are fp32 or bf16), an int8 /
    int4 one made by `quantization.quantize_weights`, which runs its own kernel, or one of
    those with LoRA adapters beside it (lora/linear.py: each row's product added after)."""
    if isinstance(w, LoraLinear):
        return w.add_products(x, linear(x, w.base, bias))
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    if isinstance(w, PackedLinear):
        return w(x, bias, float_out=True)
    y = w(x)
    return y if bias is None else y + bias


def _rounds_rows_to_bf16(layer: LayerWeights) -> bool:
    """Whether every matmul of a dense SiLU layer rounds its rows to bf16 itself."""
    layer = base_layer(layer)  # adapters beside them change no matmul's rows
    return isinstance(layer.gate_up, PackedGateUp) and all(
        isinstance(w, PackedLinear | PackedGateUp) and w.rounds_rows_to_bf16
        for w in layer.linears()
    )
