"""The bf16 cache's attention path (csrc/cpu/attention_bf16.h): dot products over the cache
as it lies, the softmax weights rounded to bf16 once, the context fetched ahead. Its error
against fp32 attention over the same bf16 inputs stays of the order of the output's own
rounding to bf16, and the start-up log names the path every dtype and head shape takes."""

from __future__ import annotations

import pytest
import torch

from shared.engine import native
from shared.engine.attention.cpu_backend import CpuAttention
from shared.engine.attention.torch_backend import TorchAttention
from tests.unit.attention_cases import make_step

kernels = native.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels not built")
DOT_PRODUCTS = kernels is not None and kernels.bf16_dot_product_kernel()


def _errors(step) -> tuple[float, float]:
    """(max |ours - fp32 reference|, max |fp32 reference rounded to bf16 - reference|)."""
    ours = CpuAttention().attend(step.q, step.kv, step.cache, step.meta).float()
    reference = TorchAttention().attend(
        step.q.float(), step.kv.float(), step.cache.float(), step.meta
    )
    rounding = (reference.to(torch.bfloat16).float() - reference).abs().max().item()
    return (ours - reference).abs().max().item(), rounding


@pytest.mark.skipif(not DOT_PRODUCTS, reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize(
    ("decodes", "prefills"),
    [([1, 2, 31, 200, 2000], []), ([], [(0, 64)]), ([700], [(300, 33)])],
    ids=["decodes", "prefill", "mixed"],
)
def test_the_error_is_of_the_order_of_the_outputs_own_rounding(decodes, prefills):
    """Weights rounded to bf16 add about one more rounding of the output: measured at
    1.0-2.1x the rounding error itself (these steps, seeds 0-2). A path that loses a token's
    weight (an odd context's last pair, say) errs by that token's whole share and fails."""
    step = make_step(
        decodes, prefills, heads=9, kv_heads=3, d=64, block_size=16, dtype=torch.bfloat16
    )
    error, rounding = _errors(step)
    assert error <= 3 * rounding, (error, rounding)


@pytest.mark.skipif(not DOT_PRODUCTS, reason="this CPU has no AVX512-BF16")
def test_head_dims_that_are_not_a_multiple_of_32_read_only_their_own_dims():
    """d = 80, 16 and 48: the last 32-wide vector reaches past the head (masked in q, not
    stored in out), and p.V runs 64 or 32 dims a pass: every dim of every head comes out."""
    for heads, kv_heads, d in ((8, 8, 80), (4, 2, 16), (8, 2, 48)):
        step = make_step(
            [5, 77],
            [(16, 9)],
            heads=heads,
            kv_heads=kv_heads,
            d=d,
            block_size=4,
            dtype=torch.bfloat16,
        )
        error, rounding = _errors(step)
        assert error <= 3 * rounding, (d, error, rounding)


def test_the_start_up_log_names_the_path_each_cache_takes():
    def path(dtype, heads=9, kv_heads=3, d=64) -> str:
        return CpuAttention().describe(heads, kv_heads, d, dtype)

    features = kernels.cpu_features()
    avx512, avx2 = "avx512f" in features, "avx2" in features
    wide = "widened to fp32" if avx512 else "8-key tiles (AVX2)" if avx2 else "scalar"
    assert ("bf16 dot products" if DOT_PRODUCTS else wide) in path(torch.bfloat16)
    assert wide in path(torch.float32)
    # past the dot products' 128 dims, a bf16 cache takes the fp32 tiles
    assert wide in path(torch.bfloat16, 8, 8, 256)
    assert "one head at a time" in path(torch.float16)
    if avx512:
        assert "more than 8 heads a KV head" in path(torch.bfloat16, 32, 2, 64)
    elif avx2:  # the AVX2 tiles take whole vectors of 8 dims
        assert "8-key tiles (AVX2)" in path(torch.float16)
        assert "not a multiple of 8" in path(torch.float32, 9, 3, 60)
    with pytest.raises(RuntimeError, match="head shape"):
        path(torch.bfloat16, 9, 2, 64)
