"""Quantization at load: make a quantized weight set, then the model uses it.

`quantize_weights(weights, "int8" | "int4" | "w8a8")` replaces each layer's four matrices
(fused qkv, o_proj, fused gate_up, down) and the LM head by a quantized linear
(model/linear_weights.py, which also describes the kernels); `LlamaModel` calls any of them through
`model.llama.linear`. The embedding stays in float (a lookup reads T rows). The LM head is
int8 in every mode.

A checkpoint that shipped quantized (GGUF formats kept at pull; AWQ, GPTQ, compressed-tensors
as they ship; model/group_quant.py) runs as it is: `shipped_quantization` refuses
--quantization for it and names its formats for the log.

int8 and int4 are weight-only through torch's kernels (`Int8Linear`, `Int4Linear`). w8a8 is
int8 weights and per-row int8 activations through the AVX512-VNNI kernel (`Int8DotLinear`,
batch-invariant), refused where the C++ kernels lack it; it costs more perplexity than int8
(see docs/benchmarks.md).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import cache
from pathlib import Path

import torch

from shared.engine import native
from shared.engine.model.checkpoint import gguf_kept_formats, quantized_formats
from shared.engine.model.group_quant import GroupQuantLinear, GroupQuantParts
from shared.engine.model.linear_weights import (
    Int4Linear,
    Int8DotLinear,
    Int8Linear,
    LinearWeight,
    PackedGateUp,
    PackedLinear,
    QuantizedLinear,
)
from shared.engine.model.weights import LayerWeights, ModelWeights
from shared.errors import ConfigError

QUANTIZATIONS = ("int8", "int4", "w8a8")

log = logging.getLogger(__name__)


@cache
def int8_dot_product() -> bool:
    """Whether the C++ kernels have the W8A8 AVX512-VNNI kernel."""
    kernels = native.load()
    return kernels is not None and kernels.int8_dot_product_kernel()


def int8_panels() -> str | None:
    """Where the GGUF formats' int8-activation kernel takes panels of 16 columns here (the
    k-quants and Q4_0-Q8_0): "amx" (the CPU has AMX, the OS granted the tiles, the build has
    them: on tiles), "vnni" (an AVX512-VNNI build: by VNNI alone), else None."""
    kernels = native.load()
    if kernels is None:
        return None
    if kernels.amx_tiles() == "on":
        return "amx"
    return "vnni" if kernels.group_quant_paths()[1] == "avx512_vnni" else None


def shipped_quantization(model_dir: Path, quantization: str | None, device: str) -> list[str]:
    """The formats the checkpoint at `model_dir` keeps quantized ([]: none). ConfigError where
    --quantization asks for another (re-quantizing quantized weights loses twice) or the
    device is not a CPU (the kernel is a CPU one)."""
    formats = quantized_formats(model_dir)
    if formats and quantization:
        raise ConfigError(
            f"{model_dir} is already quantized ({', '.join(formats)}): serve it without "
            f"--quantization {quantization}, or pull a float copy (splitserve pull "
            "--no-keep-quant, GGUF) to quantize it our way"
        )
    if formats and device != "cpu":
        raise ConfigError(
            f"{model_dir} is quantized ({', '.join(formats)}), which runs on CPUs only: "
            "use --device cpu, or pull a float copy (splitserve pull --no-keep-quant)"
        )
    return formats


def takes_int8_activations(model_dir: Path, shipped: list[str], choice: str) -> bool:
    """Whether a checkpoint's kept matrices take int8 activations (--group-quant-activations;
    auto: where it holds GGUF formats, as llama.cpp runs them)."""
    if not shipped or choice == "float":
        return False
    return choice == "int8" or bool(gguf_kept_formats(model_dir))


@cache
def group_quant_paths() -> tuple[str, str]:
    """The group-quant kernel's paths in this build, for fp32 and for int8 activations
    ("avx512" | "avx2" | "generic", "avx512_vnni" | "avx2" | "generic"); generic without
    the kernels."""
    kernels = native.load()
    if kernels is None:
        return "generic", "generic"
    fp32, int8 = kernels.group_quant_paths()
    return fp32, int8


_PATH_WORDS = {"avx512": "AVX-512", "avx512_vnni": "AVX512-VNNI", "avx2": "AVX2"}
_PANEL_WORDS = {"amx": "AMX-INT8 tiles", "vnni": "AVX512-VNNI over 16-column panels"}


def describe_shipped(formats: list[str], int8_activations: bool = False) -> str:
    """The start-up log's words for a checkpoint's own quantization and its kernel."""
    fp32, int8 = group_quant_paths()
    if native.load() is None:
        kernel = "dequantized per call through torch (the C++ kernels are not built)"
    elif int8_activations:
        path = _PATH_WORDS.get(int8, "its generic path (no AVX2; slow)")
        panels = _PANEL_WORDS.get(int8_panels() or "")
        if panels:
            path = f"{panels} for Q4_0-Q8_0 and Q2_K-Q6_K, {path} for the rest"
        kernel = f"the group-quant kernel with int8 activations per block, {path}"
    elif fp32 != "generic":
        kernel = f"the group-quant kernel, {_PATH_WORDS[fp32]}, dequantizing in registers"
        kernel += " (batch-invariant)"
    else:
        kernel = "the group-quant kernel's generic path (no AVX2; batch-invariant, slow)"
    return f"{', '.join(formats)} kept quantized: {kernel}"


def quantize_weights(weights: ModelWeights, mode: str, group_size: int = 32) -> ModelWeights:
    """A copy of `weights` whose matrices are quantized; the float ones can then be freed."""
    if mode not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, not {mode!r}")
    on_cpu = weights.embed.device.type == "cpu"
    if mode == "w8a8" and not (on_cpu and int8_dot_product()):
        raise ConfigError(
            "w8a8 needs the C++ kernels' AVX512-VNNI W8A8 kernel on a CPU; "
            "this build or device has none (use int8, weight-only)"
        )
    int8 = Int8DotLinear.quantize if mode == "w8a8" else Int8Linear.quantize

    def q(w: torch.Tensor) -> QuantizedLinear:
        return Int4Linear.quantize(w, group_size) if mode == "int4" else int8(w)

    layers = [layer.map_linears(q) for layer in weights.layers]
    head = int8(weights.lm_head)  # [vocab, hidden]; int8 in every mode
    return replace(weights, layers=layers, lm_head=head, lm_head_column_major=head)


def weight_bytes(weights: ModelWeights) -> int:
    """Bytes a decode step streams: every layer matrix and the head (not the embedding)."""
    tensors: list[torch.Tensor] = []
    for layer in weights.layers:
        tensors += _tensors_of(layer)
    head = weights.lm_head
    tensors += _flat(head)
    return sum(t.numel() * t.element_size() for t in tensors)


def matrix_bytes(w: LinearWeight) -> int:
    """Bytes of one matrix as the engine holds it (what a step reads of it)."""
    return sum(t.numel() * t.element_size() for t in _flat(w))


def _tensors_of(layer: LayerWeights) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for w in layer.linears():
        out += _flat(w)
    return out


def _flat(w: LinearWeight) -> list[torch.Tensor]:
    if isinstance(w, torch.Tensor):
        return [w]
    if isinstance(w, PackedLinear | PackedGateUp):
        return [w.packed]
    if isinstance(w, Int8DotLinear):
        return [w.packed, w.colsums, w.scales]
    if isinstance(w, Int8Linear):
        return [w.weight, w.scales]
    if isinstance(w, GroupQuantLinear | GroupQuantParts):
        return w.tensors()
    return [w.packed, w.scales_and_zeros]
