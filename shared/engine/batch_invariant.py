"""Batch-invariant matmuls: a row's logits do not depend on what else shares its step.

Seeded sampling is a pure function of (seed, position) only if the logits are too. torch's
CPU matmul (MKL / oneDNN) is not batch-invariant: the same input row gets different last
bits depending on how many rows share the call (one row takes a GEMV, 2-3 rows and 4+ rows
other blocked paths). Rarely, an inverse-CDF draw sits within those bits of a boundary, and
a request migrated to another worker, or re-batched, then samples a different token.

`pack_weights(weights)` replaces every float matrix (fused qkv, o_proj, fused gate_up,
down, the LM head) by a `PackedLinear` (model/linear_weights.py), which runs the C++ kernel
of csrc/cpu/linear.cpp: each output element is one k-ordered chain of fused multiply-adds
whatever the number of rows, the tiling or the thread count. bf16 weights on an AVX512-BF16
CPU take linear_bf16.cpp's kernels: AMX tiles where the CPU has them and the OS grants them
(every row count, one row alone included), else bf16 dot products; either is one k-ordered
sequence per element too. The LM head has a single layout for every row count.
The rest of the forward pass is already per row: RMSNorm, rope, SiLU, the embedding, and
the `cpu` attention backend (one routine per (row, head), decode and prefill rows alike).
w8a8 weights are batch-invariant too (AMX-INT8 tiles or the AVX512-VNNI kernel, the same bits
from either; quantization.py); the `torch` attention backend and int8 / int4 weight-only
(torch's kernels) are not.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from shared.engine import native
from shared.engine.attention import resolve_backend
from shared.engine.engine_config import EngineConfig
from shared.engine.model.linear_weights import LinearWeight, PackedGateUp, PackedLinear
from shared.engine.model.weights import ModelWeights
from shared.engine.quantization import int8_dot_product


def resolve(config: EngineConfig) -> bool:
    """config.batch_invariant → on or off. None (auto): on when the C++ kernels are built,
    the weights are float or w8a8 (the VNNI kernel) and attention resolves to `cpu` (so
    never on CUDA). True without the kernels raises (EngineConfig itself refuses True with
    int4, another attention backend or a CUDA device). resolve.py calls it when an engine is
    built; EngineConfig never does."""
    built = native.load() is not None
    w8a8 = config.quantization == "w8a8" and built and int8_dot_product()
    if config.batch_invariant is None:
        backend = resolve_backend(config.attention_backend, config.torch_device)
        cpu_attention = backend == "cpu"  # never on CUDA: auto is triton there
        return built and (config.quantization is None or w8a8) and cpu_attention
    if config.batch_invariant and not built:
        raise RuntimeError(
            "batch_invariant needs the C++ CPU kernels: run `make install` "
            "(or `python -m shared.engine.native`) with a C++ compiler present"
        )
    if config.batch_invariant and config.quantization == "w8a8" and not w8a8:
        raise RuntimeError("w8a8 needs the AVX512-VNNI kernel (not on this CPU)")
    return config.batch_invariant


def pack_weights(weights: ModelWeights, silu_mlp: bool = False) -> ModelWeights:
    """Packs the matrices of `weights` in place, one layer at a time (so the float copies go
    as it goes), and returns it. The embedding stays as it is (a lookup); a tied head is
    packed as a copy of it. silu_mlp: the MLPs are SiLU-gated, so a gate_up that fits becomes
    a `PackedGateUp` (SiLU·up applied by the matmul itself).

    The kernels sum in fp32 and take fp32 activations whatever the weights' dtype, so the
    norms and biases become fp32 too: the model then keeps its residual stream, norms, rope
    and logits in fp32 (`DecoderModel.act_dtype`), and bf16 weights cost only the rounding of
    each matmul's input. That halves bf16's logit error against fp32 (transformers' bf16,
    which rounds the residual stream at every layer, errs more than ours)."""
    for i, layer in enumerate(weights.layers):
        weights.layers[i] = replace(
            layer,
            input_norm=_fp32(layer.input_norm),
            post_norm=_fp32(layer.post_norm),
            q_norm=_fp32(layer.q_norm),
            k_norm=_fp32(layer.k_norm),
            attn_out_norm=_fp32(layer.attn_out_norm),
            mlp_out_norm=_fp32(layer.mlp_out_norm),
            qkv_bias=_fp32(layer.qkv_bias),
            qkv=_pack(layer.qkv),
            o_proj=_pack(layer.o_proj),
            gate_up=_pack_gate_up(layer.gate_up, silu_mlp),
            down=layer.down if layer.down is None else _pack(layer.down),
            experts=layer.experts and layer.experts.map(_pack),  # MoE layers
        )
    weights.norm = weights.norm.float()
    head = _pack(weights.lm_head)  # [vocab, hidden]: one layout for any rows
    weights.lm_head = weights.lm_head_column_major = head
    return weights


def _pack(w: LinearWeight) -> LinearWeight:
    """A float matrix packed; one kept quantized (model/group_quant.py) runs its own
    batch-invariant kernel as it is."""
    return PackedLinear.pack(w) if isinstance(w, torch.Tensor) else w


def _pack_gate_up(w: LinearWeight | None, silu_mlp: bool) -> LinearWeight | None:
    if w is None or not isinstance(w, torch.Tensor):
        return w
    return PackedGateUp.pack(w) if silu_mlp and PackedGateUp.fits(w) else PackedLinear.pack(w)


def _fp32(vector: torch.Tensor | None) -> torch.Tensor | None:
    return None if vector is None else vector.float()


def describe_matmuls(config: EngineConfig, packed: bool) -> str:
    """What this engine's CPU matmuls run on, for the start-up log (no silent fallback)."""
    kernels = native.load()
    if kernels is None:
        return "torch's matmuls (the C++ kernels are not built)"
    features = ", ".join(kernels.cpu_features()) or "no AVX2"
    if config.quantization == "w8a8":
        tiles = kernels.amx_tiles() == "on"
        path = "W8A8 int8 AMX tiles (AMX-INT8)" if tiles else "W8A8 int8 dot products (AVX512-VNNI)"
    elif config.quantization:
        path = f"{config.quantization} weight-only through torch"
    elif not packed:
        path = "torch's matmuls (batch_invariant off)"
    elif config.dtype == "bfloat16" and kernels.bf16_dot_product_kernel():
        path = _BF16_PAIRS[kernels.amx_tiles()]
    elif config.dtype == "bfloat16":
        path = "bf16 weights through the fp32 FMA chain (this CPU has no AVX512-BF16 or AMX)"
    else:
        path = f"{config.dtype} through the fp32 FMA chain"
    return f"{path}; kernels built for {features}"


_BF16_PAIRS = {  # by amx_tiles(): on, refused (by the OS), absent (from the CPU)
    "on": "bf16 AMX tiles (AMX-BF16)",
    "refused": "bf16 dot products (AVX512-BF16: the OS refused AMX tile data)",
    "absent": "bf16 dot products (AVX512-BF16; this CPU has no AMX)",
}
