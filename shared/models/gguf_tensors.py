"""GGUF tensors to HF tensors: names, dequantization to float32, and llama.cpp's Q/K permutation.

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

SUPPORTED_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q6_K,
    }
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

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str:
    """HF name of a GGUF tensor: blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_PARTS:
        raise GGUFConvertError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_PARTS[part]}.{suffix}"


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


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for one weight or bias.

    HF's llama rotates the two halves of each head ([x0..x_{d/2-1}], [x_{d/2}..]); llama.cpp
    rotates adjacent pairs, so its converter reorders each head's rows from
    (2, d/2) to (d/2, 2). We reorder them back: w [n_heads * d, in] viewed as
    [n_heads, d/2, 2, in] -> [n_heads, 2, d/2, in].
    """
    out = w.shape[0]
    head_dim = out // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(out, *rest)


def read_state_dict(reader: GGUFReader, hp: HParams) -> dict[str, np.ndarray]:
    """Every tensor of the file as float32, under its HF name, Q/K un-permuted for llama."""
    state: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        w = dequantize_tensor(tensor)
        # Only the llama architecture is permuted by llama.cpp (it uses the "normal" rope
        # there); qwen2 runs the NEOX rope, which is HF's layout already.
        if hp.arch == "llama" and ".attn_q." in tensor.name:
            w = unpermute_rope(w, hp.num_heads)
        elif hp.arch == "llama" and ".attn_k." in tensor.name:
            w = unpermute_rope(w, hp.num_kv_heads)
        state[name] = np.ascontiguousarray(w)
    _check_complete(state, hp)
    return state


def _check_complete(state: dict[str, np.ndarray], hp: HParams) -> None:
    """Raise if a tensor the HF model needs is missing or has the wrong shape."""
    q_out, kv_out = hp.num_heads * hp.head_dim, hp.num_kv_heads * hp.head_dim
    h, f = hp.hidden_size, hp.intermediate_size
    expected = {"model.embed_tokens.weight": (hp.vocab_size, h), "model.norm.weight": (h,)}
    if not hp.tie_word_embeddings:
        expected["lm_head.weight"] = (hp.vocab_size, h)
    for i in range(hp.num_layers):
        p = f"model.layers.{i}."
        expected |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
        if hp.arch == "qwen2":
            expected |= {
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            }
    for name, shape in expected.items():
        if name not in state:
            raise GGUFConvertError(f"GGUF file has no tensor for {name}")
        if state[name].shape != shape:
            raise GGUFConvertError(f"{name}: shape {state[name].shape}, expected {shape}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise GGUFConvertError(f"unexpected tensors for {hp.arch}: {unexpected}")
