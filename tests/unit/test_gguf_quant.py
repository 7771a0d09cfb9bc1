"""GGUF quantized tensors unpacked into our layout (shared/models/gguf_quant.py): the values
`GroupQuantLinear.dequantize` gives equal gguf-py's reference dequantization bit for bit, for
every kept type, on tensors quantized by gguf-py (where it has a quantizer) or made of random
blocks by the published byte layout (the k-quants); bad data is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from loadtest.engine_bench.group_quant import F16_AT
from shared.engine.model.group_quant import GroupQuantLinear, stack_rows
from shared.models.gguf_metadata import GGUFConvertError
from shared.models.gguf_quant import BLOCKS, QuantArrays, unpack
from tests.kquant_writer import quantize_k

N, K = 24, 512


def gguf_bytes(qtype: T, seed: int = 0) -> np.ndarray:
    """An [N, K] tensor of `qtype` as GGUF stores it: [N, row bytes] uint8."""
    rng = np.random.default_rng(seed)
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        return quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.05, qtype)
    block_bytes, per_block = BLOCKS[qtype]
    blocks = rng.integers(0, 256, (N, K // per_block, block_bytes), dtype=np.uint8)
    for at in F16_AT[qtype]:
        f16 = (rng.standard_normal((N, K // per_block)) * 0.01).astype(np.float16)
        blocks[..., at : at + 2] = f16.view(np.uint8).reshape(N, K // per_block, 2)
    return blocks.reshape(N, -1)


def to_linear(arrays: QuantArrays) -> GroupQuantLinear:
    return GroupQuantLinear.from_tensors(
        arrays.params(), {name: torch.from_numpy(a) for name, a in arrays.arrays().items()}
    )


@pytest.mark.parametrize("qtype", sorted(BLOCKS, key=lambda t: t.name), ids=lambda t: t.name)
def test_unpacked_weights_equal_the_reference_dequantization(qtype):
    data = gguf_bytes(qtype)
    reference = torch.from_numpy(dequantize(data, qtype).astype(np.float32).reshape(N, K))
    w = to_linear(unpack(data, qtype, (N, K), "blk.0.attn_q.weight"))
    assert w.format == qtype.name and w.shape == (N, K)
    ours = w.dequantize()
    assert torch.equal(ours, reference)  # bit for bit (0.0 == -0.0)
    rows = torch.tensor([5, 0, 17])
    assert torch.equal(w.dequantize(rows), reference[rows])
    assert torch.equal(w.take_rows(rows).dequantize(), reference[rows])


def test_a_short_or_misshapen_tensor_is_refused_by_name():
    data = gguf_bytes(T.Q4_K)
    with pytest.raises(GGUFConvertError, match=r"blk.3.ffn_up.weight: .* bytes of Q4_K"):
        unpack(data[:, :-1], T.Q4_K, (N, K), "blk.3.ffn_up.weight")
    with pytest.raises(GGUFConvertError, match=r"blk.3.ffn_up.weight: Q4_K needs rows"):
        unpack(data, T.Q4_K, (N * 4, K // 4), "blk.3.ffn_up.weight")


def test_a_layout_with_missing_or_missized_parts_is_refused():
    arrays = unpack(gguf_bytes(T.Q4_K), T.Q4_K, (N, K), "x")
    tensors = {name: torch.from_numpy(a) for name, a in arrays.arrays().items()}
    without_scales = {k: v for k, v in tensors.items() if k != "sub_scale"}
    with pytest.raises(ValueError, match="sub_scale"):
        GroupQuantLinear.from_tensors(arrays.params(), without_scales)
    short = dict(tensors, super_min=tensors["super_min"][:, :1])
    with pytest.raises(ValueError, match="super_min is"):
        GroupQuantLinear.from_tensors(arrays.params(), short)
    with pytest.raises(ValueError, match=r"32-bit|group-64"):
        GroupQuantLinear.from_tensors(dict(arrays.params(), group=64), tensors)


def test_row_blocks_of_one_layout_stack_and_of_two_stay_parts():
    q = to_linear(unpack(gguf_bytes(T.Q5_0, 1), T.Q5_0, (N, K), "q"))
    k = to_linear(unpack(gguf_bytes(T.Q5_0, 2), T.Q5_0, (N, K), "k"))
    v = to_linear(unpack(gguf_bytes(T.Q6_K, 3), T.Q6_K, (N, K), "v"))
    fused = stack_rows([q, k, v])
    assert fused.shape == (3 * N, K) and fused.format == "Q5_0+Q6_K"
    want = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    assert torch.equal(fused.dequantize(), want)
    x = torch.randn(3, K)
    torch.testing.assert_close(fused(x), x @ want.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("qtype", "bound"),
    [(T.Q2_K, 0.35), (T.Q3_K, 0.2), (T.Q4_K, 0.08), (T.Q5_K, 0.04), (T.Q6_K, 0.025)],
    ids=["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"],
)
def test_our_k_quant_writer_is_read_back_by_gguf_py_and_by_us(qtype, bound):
    """tests/kquant_writer.py (which the tiny k-quant model of test_gguf_families.py is made
    with): gguf-py's dequantize of what it writes is near the weights (round to nearest on the
    format's grid), and our unpacking of it is that dequantization bit for bit."""
    rng = np.random.default_rng(11)
    w = (rng.standard_normal((N, K)) * 0.05 + rng.standard_normal((N, 1)) * 0.02).astype(np.float32)
    data = quantize_k(w, qtype)
    assert data.shape == (N, K // 256 * BLOCKS[qtype][0])
    reference = dequantize(data, qtype).astype(np.float32).reshape(N, K)
    assert np.linalg.norm(reference - w) / np.linalg.norm(w) < bound
    ours = to_linear(unpack(data, qtype, (N, K), "w")).dequantize()
    assert torch.equal(ours, torch.from_numpy(reference))
