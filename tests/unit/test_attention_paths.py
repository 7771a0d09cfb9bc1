"""Whichever attention path this build's CPU takes (AVX-512 tiles, bf16 dot products, the
AVX2 8-key tiles of csrc/cpu/attention_avx2.h, the scalar loop), it matches the torch
backend for every cache dtype, for head dims that fill whole vectors, leave a partial one or
take more than one pass over V, and with a sliding window or soft-capped scores; and a row
gives the same bits alone as in the batch."""

from __future__ import annotations

import pytest
import torch

from shared.engine import native
from shared.engine.attention.base import LayerAttention
from shared.engine.attention.cpu_backend import CpuAttention
from shared.engine.attention.row_plan import plan_rows
from shared.engine.attention.torch_backend import TorchAttention
from tests.unit.attention_cases import make_step
from tests.unit.test_fused_ops import _attend_rows

kernels = native.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels not built")

# one rounding of the cache dtype, or a few fp32 ulps
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}
# heads, kv_heads, d: whole vectors of 8; 17 vectors (V in passes of 8, 8, 1); 60 (no AVX2 tile)
SHAPES = [(4, 2, 8), (9, 3, 64), (2, 1, 136), (6, 3, 60)]
LAYERS = [
    pytest.param(0, 0.0, id="full"),
    pytest.param(29, 0.0, id="window"),
    pytest.param(0, 20.0, id="softcap"),
]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}".format(*s))
@pytest.mark.parametrize(("window", "softcap"), LAYERS)
def test_every_path_matches_torch_and_keeps_a_rows_bits(dtype, shape, window, softcap):
    heads, kv_heads, d = shape
    step = make_step(
        [1, 7, 9, 70],
        [(0, 13), (40, 5)],
        heads=heads,
        kv_heads=kv_heads,
        d=d,
        block_size=16,
        dtype=dtype,
        seed=d,
    )
    layer = LayerAttention(scale=d**-0.5, window=window, softcap=softcap)
    ours = CpuAttention().attend(step.q, step.kv, step.cache, step.meta, layer)
    reference = TorchAttention().attend(
        step.q.float(), step.kv.float(), step.cache.float(), step.meta, layer
    )
    scale = reference.abs().max().item() + 1.0
    assert ours.dtype == dtype
    assert (ours.float() - reference).abs().max().item() <= TOLERANCE[dtype] * scale
    plan = plan_rows(step.meta, 16)
    for row in range(step.q.shape[0]):
        alone = _attend_rows(step, plan, torch.tensor([row]), window, softcap)
        assert torch.equal(alone, ours[row : row + 1]), row
