"""Our own writer of AWQ, GPTQ, compressed-tensors (pack-, int- and float-quantized) and vLLM
checkpoints, for the tests.

A float matrix is quantized per group of columns (round to nearest on a min-max grid, GPTQ's
act order as a random column order of the groups), and its codes, zero points and scales
packed as each format stores them (shared/models/wna16.py's table). test_wna16.py checks this
packing against the formats' reference packers (vLLM's, compressed-tensors'), and our
unpacking against their reference unpackers, on what this writes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shared.models.wna16_config import FP8_FORMATS, QuantFormat

AWQ_PACK = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_PACK[i] of 8


@dataclass(slots=True)
class Quantized:
    codes: torch.Tensor  # [N, K] int64 in [0, 2^bits)
    scales: torch.Tensor  # [N, groups] float16
    zeros: torch.Tensor  # [N, groups] int64
    g_idx: torch.Tensor  # [K] int64: column k's group

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: (q - z) * s, exact (a small integer times an fp16 scale)."""
        z, s = self.zeros[:, self.g_idx], self.scales.double()[:, self.g_idx]
        return ((self.codes - z) * s).float()


def quantize(
    w: torch.Tensor, bits: int, group: int, symmetric: bool, act_order: bool, seed: int = 0
) -> Quantized:
    """w [N, K] float -> codes, fp16 scales and zero points per group of `group` columns
    (0: the whole row); act_order: the groups take the columns in a random order."""
    n, k = w.shape
    size = group or k
    g_idx = torch.arange(k) // size
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(seed))]
    order = torch.sort(g_idx, stable=True).indices  # group 0's columns, then group 1's, ...
    wg = w.double()[:, order].reshape(n, k // size, size)
    top = (1 << bits) - 1
    if symmetric:
        scales = (2 * wg.abs().amax(-1).clamp(min=1e-6) / top).half()
        zeros = torch.full(scales.shape, 1 << (bits - 1), dtype=torch.float64)
    else:
        low, high = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scales = ((high - low).clamp(min=1e-6) / top).half()
        zeros = torch.round(-low / scales.double()).clamp(0, top)
    q = (torch.round(wg / scales.double()[..., None]) + zeros[..., None]).clamp(0, top)
    codes = torch.empty(n, k, dtype=torch.int64)
    codes[:, order] = q.reshape(n, k).long()
    return Quantized(codes, scales, zeros.long(), g_idx)


def fp8_quantize(
    w: torch.Tensor, rows: int, cols: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> FP8 E4M3 values and the scales of blocks of rows x cols ([ceil(N / rows),
    ceil(K / cols)], in `dtype`), each block's largest |w| mapped to 448 as compressed-tensors'
    FloatQuantizationCompressor and DeepSeek's block quantizer do; the weights are values *
    scales (exact in fp32: 4 significant bits times 8)."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w, (0, -k % cols, 0, -n % rows))
    blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    scale = (blocks.abs().amax((1, 3)).clamp(min=1e-6) / 448).to(dtype)
    return (w / spread(scale, rows, cols, n, k)).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def spread(scale: torch.Tensor, rows: int, cols: int, n: int, k: int) -> torch.Tensor:
    """Block scales ([R, C], or as stored per tensor or channel) -> each weight's [N, K] fp32."""
    grid = scale.float().reshape(-(-n // rows), -(-k // cols))
    return grid.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]


def pack(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """[R, C] unsigned codes -> int32 words along `dim`, code j of a word at bits * j."""
    if dim == 0:
        return pack(codes.t(), bits, 1).t().contiguous()
    per_word = 32 // bits
    rows, cols = codes.shape
    c = (codes.long() & ((1 << bits) - 1)).reshape(rows, cols // per_word, per_word)
    words = (c << (torch.arange(per_word) * bits)).sum(-1)
    return (words - (words >= 1 << 31).long() * (1 << 32)).to(torch.int32)


def awq_parts(m: Quantized) -> dict[str, torch.Tensor]:
    k = m.codes.shape[1]

    def words(x: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N / 8], AWQ's nibble order
        return pack(x.reshape(x.shape[0], -1, 8)[:, :, list(AWQ_PACK)].reshape(x.shape), 4, 1)

    assert torch.equal(m.g_idx, torch.arange(k) // (k // m.scales.shape[1])), "AWQ: no act order"
    return {
        "qweight": words(m.codes.t()),
        "qzeros": words(m.zeros.t()),
        "scales": m.scales.t().contiguous(),
    }


def gptq_parts(m: Quantized, bits: int, v1: bool = True) -> dict[str, torch.Tensor]:
    return {
        "qweight": pack(m.codes.t(), bits, 0),
        "qzeros": pack(m.zeros.t() - (1 if v1 else 0), bits, 1),
        "scales": m.scales.t().contiguous(),
        "g_idx": m.g_idx.to(torch.int32),
    }


def int8_parts(m: Quantized, symmetric: bool, act_order: bool) -> dict:
    """compressed-tensors int-quantized: the codes as signed int8, scales and zero points as
    they are (its IntQuantizationCompressor's layout)."""
    parts = {"weight": (m.codes - 128).to(torch.int8), "weight_scale": m.scales.contiguous()}
    if not symmetric:
        parts["weight_zero_point"] = (m.zeros - 128).to(torch.int8)
    if act_order:
        parts["weight_g_idx"] = m.g_idx.to(torch.int32)
    return parts


def compressed_parts(m: Quantized, bits: int, symmetric: bool, act_order: bool) -> dict:
    n, k = m.codes.shape
    parts = {
        "weight_packed": pack(m.codes, bits, 1),
        "weight_scale": m.scales.contiguous(),
        "weight_shape": torch.tensor([n, k]),
    }
    if not symmetric:
        parts["weight_zero_point"] = pack(m.zeros, bits, 0)
    if act_order:
        parts["weight_g_idx"] = m.g_idx.to(torch.int32)
    return parts


@dataclass(slots=True, frozen=True)
class Scheme:
    format: QuantFormat
    bits: int
    group: int  # 0: per channel
    symmetric: bool
    act_order: bool = False
    strategy: str = "channel"  # FP8: tensor, channel, group or block (FP8_VLLM: tensor, block)
    block: tuple[int, int] = (128, 128)  # FP8 strategy block: rows x columns per scale

    def config(self) -> dict:
        if self.format == QuantFormat.AWQ:
            return {"quant_method": "awq", "bits": 4, "group_size": self.group, "version": "gemm"}
        if self.format == QuantFormat.GPTQ:
            return {
                "quant_method": "gptq",
                "bits": self.bits,
                "group_size": self.group or -1,
                "desc_act": self.act_order,
                "sym": self.symmetric,
                "checkpoint_format": "gptq",
            }
        if self.format == QuantFormat.FP8_VLLM:
            if self.strategy == "tensor":
                return {"quant_method": "fp8", "activation_scheme": "static"}
            blocks = {"weight_block_size": list(self.block)}
            return {"quant_method": "fp8", "activation_scheme": "dynamic"} | blocks
        if self.format == QuantFormat.FP8:  # W8A8 FP8: activations FP8 per token, dynamic
            weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": self.strategy}
            if self.strategy == "group":
                weights["group_size"] = self.group
            if self.strategy == "block":
                weights["block_structure"] = list(self.block)
            tokens = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
            group = {"targets": ["Linear"], "weights": weights, "input_activations": tokens}
            return {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"group_0": group},
                "ignore": ["lm_head"],
            }
        weights = {
            "num_bits": self.bits,
            "type": "int",
            "symmetric": self.symmetric,
            "strategy": "group" if self.group else "channel",
            "group_size": self.group or None,
            "actorder": "group" if self.act_order else None,
        }
        activations = None
        if self.format == QuantFormat.INT8:  # W8A8: int8 per token, dynamic
            activations = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
        group = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
        return {
            "quant_method": "compressed-tensors",
            "format": "int-quantized" if activations else "pack-quantized",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head"],
        }

    def fp8_block(self, n: int, k: int) -> tuple[int, int]:
        """The rows and columns one FP8 scale covers."""
        blocks = {"tensor": (n, k), "channel": (1, k), "group": (1, self.group)}
        return blocks.get(self.strategy, self.block)

    @property
    def fp8_scale_part(self) -> str:
        vllm_blocks = self.format == QuantFormat.FP8_VLLM and self.strategy == "block"
        return "weight_scale_inv" if vllm_blocks else "weight_scale"

    def fp8_parts(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """w's FP8 values and scales as the format stores them: compressed-tensors' in bf16
        (per tensor [1], per channel [N, 1]); vLLM's `fp8` per tensor a 0-d fp32 scale (with a
        static input scale), per block fp32 weight_scale_inv."""
        vllm = self.format == QuantFormat.FP8_VLLM
        dtype = torch.float32 if vllm else torch.bfloat16
        values, scale = fp8_quantize(w, *self.fp8_block(*w.shape), dtype=dtype)
        if self.strategy == "tensor":
            scale = scale.reshape(()) if vllm else scale.reshape(1)
        parts = {"weight": values, self.fp8_scale_part: scale}
        if vllm and self.strategy == "tensor":
            parts["input_scale"] = torch.tensor(0.02)
        return parts

    def parts(self, m: Quantized) -> dict[str, torch.Tensor]:
        if self.format == QuantFormat.AWQ:
            return awq_parts(m)
        if self.format == QuantFormat.GPTQ:
            return gptq_parts(m, self.bits)
        if self.format == QuantFormat.INT8:
            return int8_parts(m, self.symmetric, self.act_order)
        return compressed_parts(m, self.bits, self.symmetric, self.act_order)


def write_quantized(src: Path, dst: Path, scheme: Scheme, dequantized: Path) -> Path:
    """The float model at `src` with every layer matrix quantized by `scheme`, at `dst`; and
    at `dequantized`, the float model of exactly the weights it stores."""
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    floats: dict[str, torch.Tensor] = {}
    for i, (name, w) in enumerate(sorted(tensors.items())):
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            out[name] = floats[name] = w
            continue
        base = name.removesuffix("weight")
        if scheme.format in FP8_FORMATS:
            out |= {base + part: t for part, t in scheme.fp8_parts(w).items()}
            floats[name] = out[base + "weight"].float() * spread(
                out[base + scheme.fp8_scale_part], *scheme.fp8_block(*w.shape), *w.shape
            )
            continue
        m = quantize(w, scheme.bits, scheme.group, scheme.symmetric, scheme.act_order, seed=i)
        out |= {base + part: t for part, t in scheme.parts(m).items()}
        floats[name] = m.dequantize()
    config = json.loads((src / "config.json").read_text())
    for path, stored, extra in ((dst, out, scheme.config()), (dequantized, floats, None)):
        path.mkdir(parents=True, exist_ok=True)
        save_file(stored, str(path / "model.safetensors"))
        written = config if extra is None else config | {"quantization_config": extra}
        (path / "config.json").write_text(json.dumps(written, indent=2))
        for extra_file in src.glob("*.json"):
            if extra_file.name != "config.json":
                shutil.copy(extra_file, path / extra_file.name)
    return dst
