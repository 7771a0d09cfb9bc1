"""GGUF tensors to HF tensors: names, dequantization to float32 or, with keep_quant, the
quantized matrices unpacked into our layout (gguf_quant.py), and llama.cpp's Q/K permutation.

Shapes: GGUF lists dimensions innermost-first (`blk.0.attn_q.weight` is [in, out]); the
numpy arrays that `GGUFReader` and `gguf.quants.dequantize` give back are row-major
[out, in], the same layout as HF `nn.Linear.weight`, so no transpose is needed.
"""

from __future__ import annotations

import re

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from shared.models.gguf_metadata import GGUFConvertError, HParams
from shared.models.gguf_quant import KEPT_TYPES, QuantArrays, unpack

Tensor = np.ndarray | QuantArrays  # a float array, or a matrix kept quantized

# float types, and every quantized one we keep (gguf-py dequantizes them all for a float pull)
SUPPORTED_TYPES = (
    frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
    | KEPT_TYPES
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# blk.{i}.<gguf part> -> model.layers.{i}.<hf part>; the suffix (.weight / .bias) is kept.
_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# What some architectures name differently, or add (Qwen3's q/k norms, Gemma's sandwich
# norms, Phi-3's fused qkv and gate_up, Qwen3-MoE's router).
_ARCH_PARTS = {
    "qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "qwen3moe": {
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate_inp": "mlp.gate",
    },
    "gemma2": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "gemma3": {
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# Qwen3-MoE's experts, stacked in one [experts, out, in] tensor each
_EXPERT_PARTS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# read into config.json (gguf_metadata), not weights
_CONFIG_TENSORS = frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """HF name of a GGUF tensor: blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = _LAYER_PARTS | _ARCH_PARTS.get(arch, {})
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match[2] not in parts:
        raise GGUFConvertError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, suffix = match.groups()
    return f"model.layers.{layer}.{parts[part]}.{suffix}"


def dequantize_tensor(tensor: ReaderTensor) -> np.ndarray:
    """The tensor as a float32 array in row-major (outermost-first) shape."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise GGUFConvertError(
            f"{tensor.name}: tensor type {tensor.tensor_type.name} is not supported "
            f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})"
        )
    values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    # tensor.shape is innermost-first; reversed it is the numpy (row-major) shape.
    return values.reshape(tuple(int(d) for d in reversed(tensor.shape)))


def read_tensor(tensor: ReaderTensor, keep_quant: bool) -> Tensor:
    """A 2-D tensor of a kept type as `QuantArrays` with keep_quant, else float32."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if keep_quant and tensor.tensor_type in KEPT_TYPES and len(shape) == 2:
        return unpack(tensor.data, tensor.tensor_type, (shape[0], shape[1]), tensor.name)
    return dequantize_tensor(tensor)


def read_experts(tensor: ReaderTensor, keep_quant: bool) -> list[Tensor]:
    """A stacked [E, out, in] expert tensor as one matrix per expert: `QuantArrays` with
    keep_quant where its type is kept (each expert's rows are whole blocks), else float32."""
    experts, out, inner = (int(d) for d in reversed(tensor.shape))
    if keep_quant and tensor.tensor_type in KEPT_TYPES:
        raw = np.asarray(tensor.data).reshape(experts, -1)  # each expert's bytes, in order
        return [
            unpack(raw[e], tensor.tensor_type, (out, inner), f"{tensor.name}[{e}]")
            for e in range(experts)
        ]
    stacked = dequantize_tensor(tensor)
    return [np.ascontiguousarray(stacked[e]) for e in range(experts)]


def unpermute_rope(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's Q/K row permutation for one weight or bias.

    HF's llama rotates the two halves of each head ([x0..x_{d/2-1}], [x_{d/2}..]); llama.cpp
    rotates adjacent pairs, so its converter reorders each head's rows from
    (2, d/2) to (d/2, 2). We reorder them back: w [n_heads * d, in] viewed as
    [n_heads, d/2, 2, in] -> [n_heads, 2, d/2, in].
    """
    out = w.shape[0]
    head_dim = out // n_heads
    if isinstance(w, QuantArrays):  # the same reordering, of whole rows
        rows = np.arange(out).reshape(n_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(out)
        return w.take_rows(rows)
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(out, *rest)


def read_state_dict(reader: GGUFReader, hp: HParams, keep_quant: bool = False) -> dict[str, Tensor]:
    """Every tensor of the file as float32 (with keep_quant, its matrices of a kept type as
    `QuantArrays`, MoE experts one per expert), under its HF name, Q/K un-permuted for llama
    (the other architectures run the NEOX rope, HF's layout already)."""
    state: dict[str, Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_TENSORS:
            continue
        match = _LAYER_NAME.fullmatch(tensor.name)
        if match is not None and match[2] in _EXPERT_PARTS:  # [E, out, in] -> one per expert
            proj = _EXPERT_PARTS[match[2]]
            for e, w in enumerate(read_experts(tensor, keep_quant)):
                state[f"model.layers.{match[1]}.mlp.experts.{e}.{proj}.weight"] = w
            continue
        name = hf_tensor_name(tensor.name, hp.arch)
        w = read_tensor(tensor, keep_quant and not name.endswith("norm.weight"))
        if hp.arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norm weights with the 1 added
        # Only the llama architecture is permuted by llama.cpp (it uses the "normal" rope
        # there); qwen2 runs the NEOX rope, which is HF's layout already.
        if hp.arch == "llama" and ".attn_q." in tensor.name:
            w = unpermute_rope(w, hp.num_heads)
        elif hp.arch == "llama" and ".attn_k." in tensor.name:
            w = unpermute_rope(w, hp.num_kv_heads)
        state[name] = w if isinstance(w, QuantArrays) else np.ascontiguousarray(w)
    _check_complete(state, hp)
    return state


def _check_complete(state: dict[str, Tensor], hp: HParams) -> None:
    """Raise if a tensor the HF model needs is missing or has the wrong shape."""
    expected = {
        "model.embed_tokens.weight": (hp.vocab_size, hp.hidden_size),
        "model.norm.weight": (hp.hidden_size,),
    }
    if not hp.tie_word_embeddings:
        expected["lm_head.weight"] = (hp.vocab_size, hp.hidden_size)
    for i in range(hp.num_layers):
        expected |= _layer_shapes(hp, f"model.layers.{i}.")
    for name, shape in expected.items():
        if name not in state:
            raise GGUFConvertError(f"GGUF file has no tensor for {name}")
        if state[name].shape != shape:
            raise GGUFConvertError(f"{name}: shape {state[name].shape}, expected {shape}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise GGUFConvertError(f"unexpected tensors for {hp.arch}: {unexpected}")


def _layer_shapes(hp: HParams, p: str) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of one layer of `hp.arch`."""
    q_out, kv_out = hp.num_heads * hp.head_dim, hp.num_kv_heads * hp.head_dim
    h, f = hp.hidden_size, hp.intermediate_size
    extra = hp.extra or {}
    shapes = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.o_proj.weight": (h, q_out),
    }
    if hp.arch == "phi3":
        shapes[p + "self_attn.qkv_proj.weight"] = (q_out + 2 * kv_out, h)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * f, h)
    else:
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
    if hp.arch == "qwen3moe":
        experts, moe_f = extra["num_experts"], extra["moe_intermediate_size"]
        shapes[p + "mlp.gate.weight"] = (experts, h)
        for e in range(experts):
            ep = f"{p}mlp.experts.{e}."
            shapes |= {ep + "gate_proj.weight": (moe_f, h), ep + "up_proj.weight": (moe_f, h)}
            shapes[ep + "down_proj.weight"] = (h, moe_f)
    elif hp.arch != "phi3":
        shapes |= {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h)}
        shapes[p + "mlp.down_proj.weight"] = (h, f)
    else:
        shapes[p + "mlp.down_proj.weight"] = (h, f)
    if hp.arch in ("qwen3", "qwen3moe", "gemma3"):
        shapes[p + "self_attn.q_norm.weight"] = (hp.head_dim,)
        shapes[p + "self_attn.k_norm.weight"] = (hp.head_dim,)
    if hp.arch in ("gemma2", "gemma3"):
        shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
        shapes[p + "post_feedforward_layernorm.weight"] = (h,)
    if hp.arch == "qwen2":
        shapes |= {p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,)}
        shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
    return shapes
