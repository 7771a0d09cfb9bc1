"""Our own writer of GGUF k-quant blocks (Q4_K, Q6_K), for the tests: gguf-py dequantizes but
does not quantize them.

Round to nearest on each format's grid, packed in ggml's byte layout (block_q4_K: d, dmin,
12 bytes of 6-bit scales and mins, 128 bytes of nibbles; block_q6_K: 128 bytes of low
nibbles, 64 of high bit pairs, 16 int8 scales, d). Not llama.cpp's search for the best
scales: the tests need valid blocks of known weights, not the smallest error.
tests/unit/test_gguf_quant.py checks that gguf-py's dequantize reads back what this wrote.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

QK_K = 256


def quantize_k(w: np.ndarray, qtype: T) -> np.ndarray:
    """w [N, K] float (K a multiple of 256) -> [N, K / 256 * block bytes] uint8."""
    n, k = w.shape
    blocks = w.astype(np.float32).reshape(n, k // QK_K, QK_K)
    packed = {T.Q4_K: _q4_k, T.Q6_K: _q6_k}[qtype](blocks)
    return packed.reshape(n, -1)


def _f16(x: np.ndarray) -> np.ndarray:
    """[...] float -> [..., 2] uint8 (fp16 bytes) and the fp16 values as float32."""
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(*x.shape, 2)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    """w = d * sc * q - dmin * m per 32 weights, q in 0..15, sc and m 6-bit."""
    groups = blocks.reshape(*blocks.shape[:2], 8, 32)
    low = np.minimum(groups.min(-1), 0.0)
    scale = (groups.max(-1) - low) / 15
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-low.min(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.maximum(d[..., None], 1e-12)), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-low / np.maximum(dmin[..., None], 1e-12)), 0, 63).astype(np.uint8)
    step = (d[..., None] * sc)[..., None]
    offset = (dmin[..., None] * m)[..., None]
    q = np.clip(np.round((groups + offset) / step), 0, 15).astype(np.uint8)  # [n, nb, 8, 32]
    scales = np.concatenate(
        [
            (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6),
            (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4),
        ],
        axis=-1,
    )  # ggml's get_scale_min_k4, inverted
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(*q.shape[:2], 128)
    return np.concatenate([_f16(d), _f16(dmin), scales, qs], axis=-1)


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
