"""AWQ, GPTQ and compressed-tensors pack-quantized weights -> integer codes and group scales.

The three formats store one idea, w[n, k] = (q[n, k] - z[n, g]) * s[n, g] with g column k's
group, packed into int32 words three ways (read from the formats' own code: AutoAWQ's GEMM
pack as vLLM's awq_triton dequantizes it, AutoGPTQ's QuantLinear, compressed-tensors'
pack_to_int32):

    format      codes                         zero points                 scales
    AWQ GEMM    qweight [K, N/8] along N,     qzeros [K/G, N/8], packed   scales [K/G, N]
                nibbles of 0 2 4 6 1 3 5 7    as qweight
    GPTQ        qweight [K/pf, N] along K     qzeros [K/G, N/pf] along N  scales [K/G, N]
                (pf = 32 / bits)              (format v1: z = stored + 1)
    c-t pack    weight_packed [N, K/pf]       weight_zero_point           weight_scale
                along K                       [N/pf, K/G] along N         [N, K/G]

Within a word, code j sits at bits * j. GPTQ's `g_idx` [K] (compressed-tensors'
`weight_g_idx`) names each column's group, which under act order is not k / G. A symmetric
checkpoint has z = 2^(bits - 1) (GPTQ's stored zeros are then ignored, as vLLM does;
compressed-tensors stores its codes signed, i.e. minus that midpoint, which is the same).

The one subtle rule: codes stay unsigned integers and zero points one integer per group, so
(q - z) * s is exact in fp32 (a 9-bit integer times an fp16 or bf16 scale); whatever
computes the weights later (model/wna16_linear.py) gets exactly the format's values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import torch

from shared.errors import ConfigError


class QuantFormat(IntEnum):
    AWQ = 1
    GPTQ = 2
    COMPRESSED = 3  # compressed-tensors, pack-quantized


_NAMES = {QuantFormat.AWQ: "AWQ", QuantFormat.GPTQ: "GPTQ", QuantFormat.COMPRESSED: "c-t"}
# the parts of one quantized matrix NAME (stored as NAME.part), the first one marking it
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
}
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column r of 8 is in nibble AWQ_ORDER[r]


@dataclass(slots=True, frozen=True)
class Wna16Config:
    """A checkpoint's quantization_config, as far as unpacking needs it."""

    format: QuantFormat
    bits: int  # 4 or 8
    group: int  # columns per scale; 0: a whole row (per channel)
    symmetric: bool  # no zero points: z = 2^(bits - 1)
    zero_offset: int = 0  # added to a stored zero point (GPTQ format v1: 1)

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or (self.format == QuantFormat.AWQ and self.bits != 4):
            raise ConfigError(f"{self.label}: {self.bits}-bit weights are not supported")
        if self.group < 0 or self.group % 32:
            raise ConfigError(f"{self.label}: group size {self.group} is not a multiple of 32")

    @property
    def label(self) -> str:
        """The start-up log's name, e.g. "AWQ 4-bit g128" or "GPTQ 8-bit per-channel sym"."""
        group = f"g{self.group}" if self.group else "per-channel"
        sym = " sym" if self.symmetric else ""
        return f"{_NAMES[self.format]} {self.bits}-bit {group}{sym}"

    @property
    def marker(self) -> str:
        """The part whose presence says a matrix is stored quantized."""
        return PARTS[self.format][0]


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
    raise ConfigError(
        f"quantization_config quant_method {method!r} is not supported "
        "(awq, gptq, compressed-tensors pack-quantized)"
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
    if fmt != "pack-quantized" or scheme.get("input_activations") or weights.get("type") != "int":
        raise ConfigError(
            f"compressed-tensors format {fmt!r} with {weights.get('type')} weights and "
            f"activations {scheme.get('input_activations')}: only pack-quantized int weights "
            "with float activations (W4A16, W8A16) are read"
        )
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise ConfigError(f"compressed-tensors weight strategy {strategy!r}: group or channel")
    group = _group(weights.get("group_size")) if strategy == "group" else 0
    sym = bool(weights.get("symmetric", True))
    return Wna16Config(QuantFormat.COMPRESSED, int(weights.get("num_bits", 0)), group, sym)


@dataclass(slots=True)
class IntGroups:
    """One [N, K] matrix unpacked: w = (codes - zeros) * scales, per group."""

    codes: torch.Tensor  # [N, K] uint8, unsigned, the checkpoint's column order
    scales: torch.Tensor  # [N, groups] float32: the stored scales exactly
    zeros: torch.Tensor  # [N, groups] int32
    group_of: torch.Tensor | None  # [K] int64: column k's group where not k // (K / groups)


def unpack(config: Wna16Config, parts: Mapping[str, torch.Tensor]) -> IntGroups:
    """A matrix's stored parts (PARTS, by part name) -> IntGroups; ValueError naming the part
    that is missing or of the wrong shape or dtype."""
    required = {
        QuantFormat.AWQ: ("qweight", "scales"),
        QuantFormat.GPTQ: ("qweight", "scales"),
        QuantFormat.COMPRESSED: ("weight_packed", "weight_scale"),
    }[config.format]
    if not config.symmetric:
        required += (
            ("weight_zero_point",) if config.format == QuantFormat.COMPRESSED else ("qzeros",)
        )
    missing = [p for p in required if p not in parts]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    unknown = sorted(set(parts) - set(PARTS[config.format]))
    if unknown:
        raise ValueError(f"unexpected parts {unknown}")
    return _UNPACK[config.format](config, parts)


def _awq(config: Wna16Config, parts: Mapping[str, torch.Tensor]) -> IntGroups:
    qweight, scales = _int32(parts, "qweight"), parts["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = _groups(config, k)
    _shape(scales, "scales", (groups, n))
    codes = _reorder_awq(_words(qweight, 4, dim=1))  # [K, N]
    if config.symmetric:
        zeros = torch.full((groups, n), 8, dtype=torch.int32)
    else:
        qzeros = _int32(parts, "qzeros")
        _shape(qzeros, "qzeros", (groups, n // 8))
        zeros = _reorder_awq(_words(qzeros, 4, dim=1)).to(torch.int32)
    return IntGroups(codes.t().contiguous(), _floats(scales).t().contiguous(), zeros.t(), None)


def _reorder_awq(q: torch.Tensor) -> torch.Tensor:
    """[R, C] codes in AWQ's nibble order -> natural column order."""
    return q.view(q.shape[0], -1, 8)[:, :, list(AWQ_ORDER)].reshape(q.shape)


def _gptq(config: Wna16Config, parts: Mapping[str, torch.Tensor]) -> IntGroups:
    bits, per_word = config.bits, 32 // config.bits
    qweight, scales = _int32(parts, "qweight"), parts["scales"]
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    groups = _groups(config, k)
    _shape(scales, "scales", (groups, n))
    codes = _words(qweight, bits, dim=0)  # [K, N]
    if config.symmetric:
        zeros = torch.full((groups, n), 1 << (bits - 1), dtype=torch.int32)
    else:
        qzeros = _int32(parts, "qzeros")
        _shape(qzeros, "qzeros", (groups, n // per_word))
        zeros = _words(qzeros, bits, dim=1).to(torch.int32) + config.zero_offset
    group_of = _group_index(parts.get("g_idx"), "g_idx", k, groups)
    return IntGroups(codes.t().contiguous(), _floats(scales).t().contiguous(), zeros.t(), group_of)


def _compressed(config: Wna16Config, parts: Mapping[str, torch.Tensor]) -> IntGroups:
    bits, per_word = config.bits, 32 // config.bits
    packed, scales = _int32(parts, "weight_packed"), parts["weight_scale"]
    n, k = packed.shape[0], packed.shape[1] * per_word
    if "weight_shape" in parts and [int(v) for v in parts["weight_shape"]] != [n, k]:
        raise ValueError(f"weight_shape {parts['weight_shape'].tolist()}: the codes are {n}x{k}")
    groups = _groups(config, k)
    _shape(scales, "weight_scale", (n, groups))
    codes = _words(packed, bits, dim=1)  # [N, K], stored as the signed code + 2^(bits - 1)
    if config.symmetric:
        zeros = torch.full((n, groups), 1 << (bits - 1), dtype=torch.int32)
    else:
        zero_point = _int32(parts, "weight_zero_point")
        _shape(zero_point, "weight_zero_point", (-(-n // per_word), groups))
        zeros = _words(zero_point, bits, dim=0)[:n].to(torch.int32)  # offset as the codes
    group_of = _group_index(parts.get("weight_g_idx"), "weight_g_idx", k, groups)
    return IntGroups(codes.contiguous(), _floats(scales).contiguous(), zeros, group_of)


_UNPACK = {QuantFormat.AWQ: _awq, QuantFormat.GPTQ: _gptq, QuantFormat.COMPRESSED: _compressed}


def _words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """[R, C] int32 words -> their codes (code j of a word at bits * j) as uint8, unpacked
    along `dim`: [R, C * 32 / bits] (dim 1) or [R * 32 / bits, C] (dim 0)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)  # [R, C, pf]
    rows, cols = words.shape
    if dim == 1:
        return codes.reshape(rows, -1)
    return codes.permute(0, 2, 1).reshape(-1, cols)


def _groups(config: Wna16Config, k: int) -> int:
    if k % 32 or (config.group and k % config.group):
        raise ValueError(f"{k} input columns are not whole groups of {config.group or 32}")
    return k // config.group if config.group else 1


def _group_index(g_idx: torch.Tensor | None, name: str, k: int, groups: int) -> torch.Tensor | None:
    """g_idx as int64, or None where it is k // (K / groups) (no act order)."""
    if g_idx is None:
        return None
    _shape(g_idx, name, (k,))
    if g_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} is {g_idx.dtype}, expected int32")
    g = g_idx.to(torch.int64)
    if bool(((g < 0) | (g >= groups)).any()):
        raise ValueError(f"{name} names groups outside [0, {groups})")
    return None if torch.equal(g, torch.arange(k) // (k // groups)) else g


def _int32(parts: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    t = parts[name]
    if t.dtype != torch.int32 or t.dim() != 2:
        raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype}, expected 2-D int32")
    return t


def _shape(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} is {tuple(t.shape)}, expected {shape} (wrong group size?)")


def _floats(scales: torch.Tensor) -> torch.Tensor:
    if scales.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"scales are {scales.dtype}, expected a float dtype")
    return scales.to(torch.float32)
