"""The quantization_config of an AWQ, GPTQ, compressed-tensors or vLLM `fp8` checkpoint, as
far as unpacking it (wna16.py; FP8: fp8_weights.py) needs: the format, bits, group size,
symmetry, FP8 block rows, and the stored parts of a matrix per format.

The one subtle rule: a config is refused here, by name, for anything unpacking cannot do
exactly; whatever parses is a layout wna16.unpack reads bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from shared.errors import ConfigError


class QuantFormat(IntEnum):
    AWQ = 1
    GPTQ = 2
    COMPRESSED = 3  # compressed-tensors, pack-quantized
    INT8 = 4  # compressed-tensors, int-quantized (or naive-quantized) 8-bit: W8A8, W8A16
    FP8 = 5  # compressed-tensors, float-quantized FP8 E4M3: per tensor, channel, group, block
    FP8_VLLM = 6  # vLLM's own `fp8` quant_method: per tensor, or per block (weight_scale_inv)


FP8_FORMATS = (QuantFormat.FP8, QuantFormat.FP8_VLLM)  # the values are FP8, not integers


_NAMES = {
    QuantFormat.AWQ: "AWQ",
    QuantFormat.GPTQ: "GPTQ",
    QuantFormat.COMPRESSED: "c-t",
    QuantFormat.INT8: "c-t int",
    QuantFormat.FP8: "c-t fp8",
    QuantFormat.FP8_VLLM: "fp8",
}
# the parts of one quantized matrix NAME (stored as NAME.part), the first one marking it (but
# vLLM's fp8 per tensor: weight_scale; Wna16Config.marker)
PARTS = {
    QuantFormat.AWQ: ("qweight", "qzeros", "scales"),
    QuantFormat.GPTQ: ("qweight", "qzeros", "scales", "g_idx"),
    QuantFormat.COMPRESSED: (
        "weight_packed",
        "weight_scale",
        "weight_zero_point",
        "weight_shape",
        "weight_g_idx",
    ),
    QuantFormat.INT8: (
        "weight_scale",
        "weight",
        "weight_zero_point",
        "weight_g_idx",
        "input_scale",  # a static activation scheme's: read past
        "input_zero_point",
    ),
    QuantFormat.FP8: ("weight_scale", "weight", "input_scale"),
    QuantFormat.FP8_VLLM: ("weight_scale_inv", "weight", "weight_scale", "input_scale"),
}


@dataclass(slots=True, frozen=True)
class Wna16Config:
    """A checkpoint's quantization_config, as far as unpacking needs it."""

    format: QuantFormat
    bits: int  # 4 or 8
    group: int  # columns per scale; 0: a whole row (per channel)
    symmetric: bool  # no zero points: z = 2^(bits - 1)
    zero_offset: int = 0  # added to a stored zero point (GPTQ format v1: 1)
    per_tensor: bool = False  # one scale for the whole matrix (c-t int strategy "tensor")
    block_rows: int = 1  # rows per scale: FP8 block scales (block_rows x group), e.g. 128

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or (self.format == QuantFormat.AWQ and self.bits != 4):
            raise ConfigError(f"{self.label}: {self.bits}-bit weights are not supported")
        if self.group < 0 or self.group % 32:
            raise ConfigError(f"{self.label}: group size {self.group} is not a multiple of 32")
        if self.block_rows < 1 or (self.block_rows > 1 and not self.group):
            raise ConfigError(f"{self.label}: blocks of {self.block_rows} rows need a group size")

    @property
    def label(self) -> str:
        """The start-up log's name, e.g. "AWQ 4-bit g128", "GPTQ 8-bit per-channel sym" or
        "fp8 8-bit block128x128 sym"."""
        group = f"g{self.group}" if self.group else "per-channel"
        group = f"block{self.block_rows}x{self.group}" if self.block_rows > 1 else group
        group = "per-tensor" if self.per_tensor else group
        sym = " sym" if self.symmetric else ""
        return f"{_NAMES[self.format]} {self.bits}-bit {group}{sym}"

    @property
    def marker(self) -> str:
        """The part whose presence says a matrix is stored quantized."""
        return self.scale_part if self.format == QuantFormat.FP8_VLLM else PARTS[self.format][0]

    @property
    def scale_part(self) -> str:
        """The part holding an FP8 matrix's scales: vLLM's `fp8` names its block scales
        weight_scale_inv (DeepSeek's name; they multiply all the same)."""
        vllm_blocks = self.format == QuantFormat.FP8_VLLM and not self.per_tensor
        return "weight_scale_inv" if vllm_blocks else "weight_scale"


def read_config(model_dir: Path) -> Wna16Config | None:
    """config.json's quantization_config (None: a float checkpoint); ConfigError naming what
    is not supported."""
    path = model_dir / "config.json"
    raw = json.loads(path.read_text()) if path.exists() else {}
    q = raw.get("quantization_config")
    return None if q is None else parse_config(q)


def parse_config(q: Mapping) -> Wna16Config:
    method = str(q.get("quant_method", "")).lower()
    if method == "awq":
        if str(q.get("version", "gemm")).lower() != "gemm":
            raise ConfigError(f"AWQ version {q.get('version')!r}: only the GEMM layout is read")
        bits, group = q.get("bits", q.get("w_bit", 4)), q.get("group_size", q.get("q_group_size"))
        return Wna16Config(QuantFormat.AWQ, int(bits), _group(group), not q.get("zero_point", True))
    if method == "gptq":
        version = str(q.get("checkpoint_format", "gptq")).lower()
        if version not in ("gptq", "gptq_v2"):
            raise ConfigError(f"GPTQ checkpoint_format {version!r}: gptq or gptq_v2 only")
        offset = 1 if version == "gptq" else 0
        sym = bool(q.get("sym", True))
        return Wna16Config(
            QuantFormat.GPTQ, int(q.get("bits", 0)), _group(q.get("group_size")), sym, offset
        )
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fp8":
        return _vllm_fp8(q)
    raise ConfigError(
        f"quantization_config quant_method {method!r} is not supported "
        "(awq, gptq, fp8, compressed-tensors pack-, int- or float-quantized)"
    )


def _group(size: object) -> int:
    return 0 if size is None or int(size) <= 0 else int(size)  # type: ignore[call-overload]


def _compressed_tensors(q: Mapping) -> Wna16Config:
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"compressed-tensors: {len(groups)} config groups (one is read)")
    scheme = next(iter(groups.values()))
    fmt = scheme.get("format") or q.get("format")
    weights = scheme.get("weights") or {}
    activations = scheme.get("input_activations")
    bits = int(weights.get("num_bits", 0))
    if fmt == "float-quantized":
        return _fp8(weights, activations)
    packed = fmt == "pack-quantized" and not activations
    whole = fmt in INT_FORMATS and bits == 8 and _int8_activations(activations)
    if weights.get("type") != "int" or not (packed or whole):
        raise ConfigError(
            f"compressed-tensors format {fmt!r} with {weights.get('type')} weights and "
            f"activations {activations}: pack-quantized int weights with float activations "
            "(W4A16, W8A16), int-quantized 8-bit weights with int8 or float activations "
            "(W8A8, W8A16) and float-quantized FP8 weights (per channel or tensor) are read"
        )
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel") and not (whole and strategy == "tensor"):
        raise ConfigError(f"compressed-tensors weight strategy {strategy!r}: group or channel")
    group = _group(weights.get("group_size")) if strategy == "group" else 0
    sym = bool(weights.get("symmetric", True))
    if whole:
        return Wna16Config(QuantFormat.INT8, bits, group, sym, per_tensor=strategy == "tensor")
    return Wna16Config(QuantFormat.COMPRESSED, bits, group, sym)


INT_FORMATS = ("int-quantized", "naive-quantized")  # the weights in their int8 dtype


def _int8_activations(activations: Mapping | None) -> bool:
    """No activation scheme, or an 8-bit integer one (W8A8: per token, or static per tensor)."""
    return not activations or (
        activations.get("type") == "int" and int(activations.get("num_bits", 0)) == 8
    )


def _fp8(weights: Mapping, activations: Mapping | None) -> Wna16Config:
    """float-quantized: FP8 E4M3 weights, symmetric, one scale per tensor, channel, group of
    columns or block (rows x columns); the activation scheme (FP8 per token, per group,
    static, or none) is not what runs."""
    strategy = weights.get("strategy")
    float8 = weights.get("type") == "float" and int(weights.get("num_bits", 0)) == 8
    strategies = ("channel", "tensor", "group", "block")
    if not float8 or strategy not in strategies or not weights.get("symmetric", True):
        raise ConfigError(
            f"compressed-tensors float-quantized weights {weights.get('type')} "
            f"{weights.get('num_bits')}-bit, strategy {strategy!r}: FP8 (8-bit float) per "
            "tensor, channel, group or block, symmetric, is read"
        )
    if activations and activations.get("type") not in ("float", None):
        raise ConfigError(f"compressed-tensors FP8 weights with {activations} activations")
    if strategy == "group":
        return _fp8_blocks(QuantFormat.FP8, [1, weights.get("group_size")], "group_size")
    if strategy == "block":
        return _fp8_blocks(QuantFormat.FP8, weights.get("block_structure"), "block_structure")
    return Wna16Config(QuantFormat.FP8, 8, 0, True, per_tensor=strategy == "tensor")


def _vllm_fp8(q: Mapping) -> Wna16Config:
    """vLLM's own `fp8`: FP8 E4M3 weights with one scale per tensor (`weight_scale`), or per
    block of rows x columns (`weight_block_size`, scales in `weight_scale_inv`: DeepSeek's and
    Qwen's FP8 checkpoints); its activation scheme (dynamic, static) is not what runs."""
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static") or q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(
            f"fp8 activation_scheme {scheme!r}, fmt {q.get('fmt')!r}: e4m3 weights with a "
            "dynamic or static scheme are read"
        )
    block = q.get("weight_block_size")
    if block is None:
        return Wna16Config(QuantFormat.FP8_VLLM, 8, 0, True, per_tensor=True)
    if scheme != "dynamic":
        raise ConfigError("fp8 weight_block_size with a static activation scheme (vLLM's too)")
    return _fp8_blocks(QuantFormat.FP8_VLLM, block, "weight_block_size")


def _fp8_blocks(fmt: QuantFormat, block: object, key: str) -> Wna16Config:
    """Scales per block of [rows, columns]: columns a multiple of 32 (the kernel's group)."""
    shape = list(block) if isinstance(block, list | tuple) else []
    if len(shape) != 2 or not all(isinstance(b, int) and b > 0 for b in shape) or shape[1] % 32:
        raise ConfigError(
            f"FP8 {key} {block!r}: [rows, columns] with columns a multiple of 32 is read"
        )
    return Wna16Config(fmt, 8, shape[1], True, block_rows=shape[0])
