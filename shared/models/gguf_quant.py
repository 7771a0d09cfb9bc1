"""GGUF quantized blocks -> our group-quantized layout, kept quantized (no float detour).

Every supported GGUF type unpacks exactly into one layout (`QuantArrays`): per weight an
unsigned code q of `bits` bits, per group of `group` weights a scale and a min, and

    w = (q - zero) * scale + min,   scale = super_scale * sub_scale, min = super_min * sub_min

with `zero` one integer per tensor, super_* fp32 per `group * per_super` weights and sub_*
int8 per group (absent: 1; an absent super_min: 0). The one subtle rule: for every format
below, either (q - zero) * scale is exact in fp32 or min is 0, so this sum (and the kernel's
fma) rounds once, exactly as gguf-py's `dequantize` and ggml-quants.c do: the unpacked values
equal the reference bit for bit (up to the sign of a zero).

    type   bits group per_super zero  super_scale sub_scale super_min sub_min
    Q4_0    4    32      1       8      d          -          -         -
    Q4_1    4    32      1       0      d          -          m         -
    Q5_0    5    32      1      16      d          -          -         -
    Q5_1    5    32      1       0      d          -          m         -
    Q8_0    8    32      1       0      d          -          -         -
    Q4_K    4    32      8       0      d          sc         dmin      -m
    Q5_K    5    32      8       0      d          sc         dmin      -m
    Q6_K    6    16     16      32      d          sc         -         -
    Q3_K    4    16     16       4      d          sc - 32    -         -
    Q2_K    4    16     16       0      d          sc         dmin      -m

Q3_K's 3-bit and Q2_K's 2-bit codes are kept as 4-bit ones (the kernels' narrowest layout):
4.6 and 5.25 bits a weight against the file's 3.44 and 2.63, still a sixth of float32's.

Codes are stored as csrc/cpu/linear_group_quant.cpp reads them: 8-bit codes as int8
[N, K]; 4-6 bit codes as a low nibble array [N, K / 2] (per 32 weights, 16 bytes: byte j
holds weight j in its low nibble and weight j + 16 in its high one) and one bit plane per
bit above 4, [N, bits - 4, K / 8] (per 16 weights a little-endian uint16, bit l: weight l).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from shared.models.gguf_metadata import GGUFConvertError

QK_K = 256
# type -> (block bytes, weights per block)
BLOCKS = {
    T.Q4_0: (18, 32),
    T.Q4_1: (20, 32),
    T.Q5_0: (22, 32),
    T.Q5_1: (24, 32),
    T.Q8_0: (34, 32),
    T.Q4_K: (144, QK_K),
    T.Q5_K: (176, QK_K),
    T.Q6_K: (210, QK_K),
    T.Q3_K: (110, QK_K),
    T.Q2_K: (84, QK_K),
}
KEPT_TYPES = frozenset(BLOCKS)
ARRAY_NAMES = ("codes", "low", "high", "super_scale", "sub_scale", "super_min", "sub_min")


@dataclass(slots=True)
class QuantArrays:
    """One [N, K] matrix in our layout (module docstring); arrays absent are None."""

    format: str  # the GGUF type it came from, e.g. "Q4_K"
    shape: tuple[int, int]  # [N, K]
    bits: int
    group: int
    per_super: int
    zero: int
    super_scale: np.ndarray  # [N, K / (group * per_super)] float32
    codes: np.ndarray | None = None  # [N, K] int8 (bits 8)
    low: np.ndarray | None = None  # [N, K / 2] uint8 (bits 4-6)
    high: np.ndarray | None = None  # [N, bits - 4, K / 8] uint8 (bits 5-6)
    sub_scale: np.ndarray | None = None  # [N, K / group] int8
    super_min: np.ndarray | None = None  # [N, K / (group * per_super)] float32
    sub_min: np.ndarray | None = None  # [N, K / group] int8

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays present, by name (ARRAY_NAMES)."""
        present = {name: getattr(self, name) for name in ARRAY_NAMES}
        return {name: a for name, a in present.items() if a is not None}

    def params(self) -> dict[str, int | str]:
        """What the checkpoint records beside the arrays (parts: the arrays' names)."""
        return {
            "parts": ",".join(self.arrays()),
            "format": self.format,
            "bits": self.bits,
            "group": self.group,
            "per_super": self.per_super,
            "zero": self.zero,
        }

    def take_rows(self, rows: np.ndarray) -> QuantArrays:
        """The matrix of rows `rows` (a permutation or selection of [0, N))."""
        picked = {name: np.ascontiguousarray(a[rows]) for name, a in self.arrays().items()}
        params = {k: v for k, v in self.params().items() if k != "parts"}
        return QuantArrays(**params, shape=(len(rows), self.shape[1]), **picked)  # type: ignore[arg-type]


def unpack(data: np.ndarray, qtype: T, shape: tuple[int, int], name: str) -> QuantArrays:
    """A GGUF tensor's raw bytes (any shape, `shape[0] * shape[1]` weights' worth) -> ours."""
    if qtype not in BLOCKS:
        raise GGUFConvertError(f"{name}: {qtype.name} is not kept quantized")
    block_bytes, per_block = BLOCKS[qtype]
    n, k = shape
    if k % per_block:
        raise GGUFConvertError(f"{name}: {qtype.name} needs rows of whole {per_block}-blocks")
    expected = n * k // per_block * block_bytes
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if raw.size != expected:
        raise GGUFConvertError(
            f"{name}: {raw.size} bytes of {qtype.name} data, expected {expected} for {n}x{k}"
        )
    blocks = raw.reshape(n, k // per_block, block_bytes)
    return _UNPACKERS[qtype](blocks, n, k)


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles (weights 0-15), then high (16-31)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes of a little-endian uint32 -> [..., 32] bits, bit j for weight j."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _simple(
    blocks: np.ndarray, n: int, k: int, fmt: str, bits: int, zero: int, has_min: bool
) -> QuantArrays:
    """Q4_0, Q4_1, Q5_0, Q5_1: d (f16) [, m (f16)] [, qh (4 bytes)], qs (16 bytes)."""
    d = _f16(blocks[..., 0:2])
    at = 4 if has_min else 2
    m = _f16(blocks[..., 2:4]) if has_min else None
    q = _nibbles(blocks[..., at + (4 if bits == 5 else 0) :])
    if bits == 5:
        q = q | (_bits32(blocks[..., at : at + 4]) << 4)
    return _layout(fmt, n, k, bits, 32, 1, zero, q.reshape(n, k), d, None, m, None)


def _q8_0(blocks: np.ndarray, n: int, k: int) -> QuantArrays:
    d = _f16(blocks[..., 0:2])
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
    return QuantArrays("Q8_0", (n, k), 8, 32, 1, 0, d, codes=codes)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> ([..., 8], [..., 8]) (ggml's
    get_scale_min_k4)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k4(blocks: np.ndarray, n: int, k: int, five: bool) -> QuantArrays:
    """Q4_K [d, dmin, scales 12, qs 128] / Q5_K [d, dmin, scales 12, qh 32, qs 128]: per 64
    weights 32 bytes of qs, low nibbles the first 32, high ones the next; Q5_K's fifth bit of
    weight l of sub-block j is bit j of qh[l]."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, mn = _k_scales(blocks[..., 4:16])
    qs = blocks[..., 48:] if five else blocks[..., 16:]
    nb = qs.shape[1]
    chunks = qs.reshape(n, nb, 4, 32)
    q = np.stack([chunks & 0x0F, chunks >> 4], axis=3).reshape(n, nb, 8, 32)
    if five:
        qh = blocks[..., 16:48]  # [n, nb, 32]
        high = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
        q = q | (high << 4)
    sub_min = (-mn.astype(np.int16)).astype(np.int8)
    fmt, bits = ("Q5_K", 5) if five else ("Q4_K", 4)
    return _layout(fmt, n, k, bits, 32, 8, 0, q.reshape(n, k), d, sc.astype(np.int8), dmin, sub_min)


def _q6_k(blocks: np.ndarray, n: int, k: int) -> QuantArrays:
    """Q6_K [ql 128, qh 64, scales 16 (int8), d]: per 128 weights, 64 bytes of ql (low nibbles
    the first 64 weights, high ones the next) and 32 of qh (2 bits each, for weights b,
    b + 32, b + 64, b + 96)."""
    nb = blocks.shape[1]
    ql = blocks[..., 0:128].reshape(n, nb, 2, 1, 64)
    ql = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    qh = blocks[..., 128:192].reshape(n, nb, 2, 1, 32)
    qh = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
    q = ql.reshape(n, nb, 256) | (qh.reshape(n, nb, 256) << 4)
    scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8)
    d = _f16(blocks[..., 208:210])
    return _layout("Q6_K", n, k, 6, 16, 16, 32, q.reshape(n, k), d, scales, None, None)


def _low_pairs(qs: np.ndarray) -> np.ndarray:
    """[n, nb, 64] bytes of 2-bit codes -> [n, nb, 2, 4, 32]: weight 128 h + 32 j + t is bits
    2j, 2j + 1 of byte 32 h + t (ggml's Q2_K / Q3_K order)."""
    n, nb = qs.shape[:2]
    halves = qs.reshape(n, nb, 2, 1, 32)
    return (halves >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)) & 0x03


def _q3_k(blocks: np.ndarray, n: int, k: int) -> QuantArrays:
    """Q3_K [hmask 32, qs 64, scales 12, d]: code u = 2 low bits | the hmask bit << 2, the
    weight d * (sc - 32) * (u - 4); weight 128 h + 32 j + t's hmask bit is bit 4 h + j of
    hmask[t]; the sixteen 6-bit scales packed as ggml's dequantize_row_q3_K unpacks them."""
    nb = blocks.shape[1]
    hmask, qs, packed = blocks[..., 0:32], blocks[..., 32:96], blocks[..., 96:108]
    d = _f16(blocks[..., 108:110])
    bit = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    high = ((hmask[:, :, None, :] >> bit) & 1).reshape(n, nb, 2, 4, 32)
    q = _low_pairs(qs) | (high << 2)
    low, top = packed[..., 0:8], packed[..., 8:12]
    tops = [(top >> s) & 0x03 for s in (0, 2, 4, 6)]  # bits 4-5 of scales 0-3, 4-7, 8-11, 12-15
    sc = np.concatenate(
        [
            (low[..., 0:4] & 0x0F) | (tops[0] << 4),
            (low[..., 4:8] & 0x0F) | (tops[1] << 4),
            (low[..., 0:4] >> 4) | (tops[2] << 4),
            (low[..., 4:8] >> 4) | (tops[3] << 4),
        ],
        axis=-1,
    )
    sub_scale = (sc.astype(np.int16) - 32).astype(np.int8)
    return _layout("Q3_K", n, k, 4, 16, 16, 4, q.reshape(n, k), d, sub_scale, None, None)


def _q2_k(blocks: np.ndarray, n: int, k: int) -> QuantArrays:
    """Q2_K [scales 16, qs 64, d, dmin]: per 16 weights a byte of scale (low nibble) and min
    (high), the weight d * sc * q - dmin * m."""
    scales = blocks[..., 0:16]
    d, dmin = _f16(blocks[..., 80:82]), _f16(blocks[..., 82:84])
    q = _low_pairs(blocks[..., 16:80])
    sub_min = (-(scales >> 4).astype(np.int16)).astype(np.int8)
    sub_scale = (scales & 0x0F).astype(np.int8)
    return _layout("Q2_K", n, k, 4, 16, 16, 0, q.reshape(n, k), d, sub_scale, dmin, sub_min)


def _layout(
    fmt: str,
    n: int,
    k: int,
    bits: int,
    group: int,
    per_super: int,
    zero: int,
    q: np.ndarray,  # [n, k] uint8 codes, natural order
    super_scale: np.ndarray,
    sub_scale: np.ndarray | None,
    super_min: np.ndarray | None,
    sub_min: np.ndarray | None,
) -> QuantArrays:
    nibble = (q & 0x0F).reshape(n, k // 32, 2, 16)
    low = (nibble[:, :, 0] | (nibble[:, :, 1] << 4)).reshape(n, k // 2)
    planes = [
        np.packbits(((q >> (4 + p)) & 1).reshape(n, k // 16, 16), axis=-1, bitorder="little")
        for p in range(bits - 4)
    ]  # each [n, k / 16, 2]: a little-endian uint16 per 16 weights
    high = np.stack([p.reshape(n, k // 8) for p in planes], axis=1) if planes else None

    def rows(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(a.reshape(n, -1))

    return QuantArrays(
        format=fmt,
        shape=(n, k),
        bits=bits,
        group=group,
        per_super=per_super,
        zero=zero,
        super_scale=rows(super_scale).astype(np.float32),
        low=np.ascontiguousarray(low),
        high=high,
        sub_scale=rows(sub_scale),
        super_min=rows(super_min),
        sub_min=rows(sub_min),
    )


_UNPACKERS = {
    T.Q4_0: lambda b, n, k: _simple(b, n, k, "Q4_0", 4, 8, False),
    T.Q4_1: lambda b, n, k: _simple(b, n, k, "Q4_1", 4, 0, True),
    T.Q5_0: lambda b, n, k: _simple(b, n, k, "Q5_0", 5, 16, False),
    T.Q5_1: lambda b, n, k: _simple(b, n, k, "Q5_1", 5, 0, True),
    T.Q8_0: _q8_0,
    T.Q4_K: lambda b, n, k: _k4(b, n, k, False),
    T.Q5_K: lambda b, n, k: _k4(b, n, k, True),
    T.Q6_K: _q6_k,
    T.Q3_K: _q3_k,
    T.Q2_K: _q2_k,
}
