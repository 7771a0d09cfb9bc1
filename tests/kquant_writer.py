"""Our own writer of GGUF k-quant blocks (Q2_K to Q6_K), for the tests: gguf-py dequantizes
but does not quantize them.

Round to nearest on each format's grid, packed in ggml's byte layout (block_q2_K: 16 bytes of
4-bit scales and mins, 64 of 2-bit codes, d, dmin; block_q3_K: 32 bytes of high bits, 64 of
2-bit codes, 12 of 6-bit scales, d; block_q4_K / q5_K: d, dmin, 12 bytes of 6-bit scales and
mins, [32 bytes of fifth bits,] 128 of nibbles; block_q6_K: 128 bytes of low nibbles, 64 of
high bit pairs, 16 int8 scales, d). Not llama.cpp's search for the best
scales: the tests need valid blocks of known weights, not the smallest error.
tests/unit/test_gguf_quant.py checks that gguf-py's dequantize reads back what this wrote.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from gguf import GGMLQuantizationType as T

QK_K = 256


def quantize_k(w: np.ndarray, qtype: T) -> np.ndarray:
    """w [N, K] float (K a multiple of 256) -> [N, K / 256 * block bytes] uint8."""
    n, k = w.shape
    blocks = w.astype(np.float32).reshape(n, k // QK_K, QK_K)
    packed = _WRITERS[qtype](blocks)
    return packed.reshape(n, -1)


def _f16(x: np.ndarray) -> np.ndarray:
    """[...] float -> [..., 2] uint8 (fp16 bytes) and the fp16 values as float32."""
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(*x.shape, 2)


def _min_grid(groups: np.ndarray, top: int, factor_max: int):
    """w = d * sc * q - dmin * m per group, q in 0..top, sc and m in 0..factor_max: (d, dmin,
    sc, m, q) by round to nearest (d and dmin as their fp16 values)."""
    low = np.minimum(groups.min(-1), 0.0)
    scale = (groups.max(-1) - low) / top
    d = (scale.max(-1) / factor_max).astype(np.float16).astype(np.float32)
    dmin = (-low.min(-1) / factor_max).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.maximum(d[..., None], 1e-12)), 1, factor_max)
    m = np.clip(np.round(-low / np.maximum(dmin[..., None], 1e-12)), 0, factor_max)
    step = (d[..., None] * sc)[..., None]
    offset = (dmin[..., None] * m)[..., None]
    q = np.clip(np.round((groups + offset) / step), 0, top).astype(np.uint8)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q


def _two_bits(q: np.ndarray) -> np.ndarray:
    """[n, nb, 256] codes -> [n, nb, 64] bytes: weight 128 h + 32 j + t's low two bits at bit
    2 j of byte 32 h + t."""
    pairs = (q & 0x03).reshape(*q.shape[:2], 2, 4, 32)
    return (
        (sum(pairs[..., j, :] << (2 * j) for j in range(4)))
        .astype(np.uint8)
        .reshape(*q.shape[:2], 64)
    )


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    """w = d * sc * q - dmin * m per 16 weights, q in 0..3, sc and m 4-bit."""
    n, nb = blocks.shape[:2]
    d, dmin, sc, m, q = _min_grid(blocks.reshape(n, nb, 16, 16), 3, 15)
    return np.concatenate(
        [sc | (m << 4), _two_bits(q.reshape(n, nb, 256)), _f16(d), _f16(dmin)], axis=-1
    )


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    """w = d * (sc - 32) * (u - 4) per 16 weights, u in 0..7 (2 low bits, 1 high), sc 6-bit."""
    n, nb = blocks.shape[:2]
    groups = blocks.reshape(n, nb, 16, 16)
    scale = np.abs(groups).max(-1) / 4
    d = (scale.max(-1) / 31).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.maximum(d[..., None], 1e-12)), 1, 31)
    step = (d[..., None] * sc)[..., None]
    u = (np.clip(np.round(groups / step), -4, 3) + 4).astype(np.uint8).reshape(n, nb, 256)
    high = (u >> 2).reshape(n, nb, 8, 32)  # bit 4 h + j of hmask[t]: weight 128 h + 32 j + t
    hmask = sum(high[:, :, b, :] << b for b in range(8)).astype(np.uint8)
    six = (sc + 32).astype(np.uint8)  # [n, nb, 16]
    low = np.concatenate(
        [(six[..., 0:4] & 0x0F) | ((six[..., 8:12] & 0x0F) << 4),
         (six[..., 4:8] & 0x0F) | ((six[..., 12:16] & 0x0F) << 4)], axis=-1,
    )  # fmt: skip
    top = sum((six[..., 4 * i : 4 * i + 4] >> 4) << (2 * i) for i in range(4)).astype(np.uint8)
    return np.concatenate([hmask, _two_bits(u), low, top, _f16(d)], axis=-1)


def _q4_k(blocks: np.ndarray, bits: int = 4) -> np.ndarray:
    """w = d * sc * q - dmin * m per 32 weights, q in 0..2^bits - 1, sc and m 6-bit; Q5_K's
    fifth bit of weight t of group j is bit j of qh[t]."""
    groups = blocks.reshape(*blocks.shape[:2], 8, 32)
    d, dmin, sc, m, q = _min_grid(groups, (1 << bits) - 1, 63)  # q [n, nb, 8, 32]
    scales = np.concatenate(
        [
            (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6),
            (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4),
        ],
        axis=-1,
    )  # ggml's get_scale_min_k4, inverted
    nibbles = q & 0x0F
    qs = (nibbles[..., 0::2, :] | (nibbles[..., 1::2, :] << 4)).reshape(*q.shape[:2], 128)
    if bits == 4:
        return np.concatenate([_f16(d), _f16(dmin), scales, qs], axis=-1)
    qh = sum(((q[..., j, :] >> 4) & 1) << j for j in range(8)).astype(np.uint8)
    return np.concatenate([_f16(d), _f16(dmin), scales, qh, qs], axis=-1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """w = d * sc * (q - 32) per 16 weights, q in 0..63, sc int8."""
    n, nb = blocks.shape[:2]
    groups = blocks.reshape(n, nb, 16, 16)
    scale = np.abs(groups).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.maximum(d[..., None], 1e-12)), 1, 127).astype(np.int8)
    step = (d[..., None] * sc)[..., None]
    q = (np.clip(np.round(groups / step), -32, 31) + 32).astype(np.uint8).reshape(n, nb, 2, 128)
    # weight 128 h + 64 p + t: its low nibble in ql[64 h + t] at bit 4 p; weight
    # 128 h + 32 p + t: its high pair in qh[32 h + t] at bit 2 p
    ql = (q[..., :64] & 0x0F) | ((q[..., 64:] & 0x0F) << 4)
    high = (q >> 4).reshape(n, nb, 2, 4, 32)
    qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    return np.concatenate(
        [ql.reshape(n, nb, 128), qh.reshape(n, nb, 64), sc.view(np.uint8), _f16(d)], axis=-1
    )


_WRITERS = {
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: partial(_q4_k, bits=5),
    T.Q6_K: _q6_k,
}
