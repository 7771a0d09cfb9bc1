"""The gate_up matmul with SiLU·up applied on the way out (`PackedGateUp`, csrc/cpu/linear.cpp's
linear_silu_mul and the pairs-of-panels epilogue of linear_tiles.h): the bits of silu_mul over
the plain product, for fp32 and bf16 weights on every kernel path, whatever the batch size,
the rows around a row or the thread count; and which MLPs pack_weights gives it to."""

from __future__ import annotations

import pytest
import torch

from shared.engine import batch_invariant, native
from shared.engine.model.decoder import gated_mlp
from shared.engine.model.layer_ops import LayerOps
from shared.engine.model.linear_weights import PackedGateUp, PackedLinear
from shared.engine.model.weights import LayerWeights, ModelWeights

kernels = native.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels not built")
# bf16 weights: the dot products with AVX512-BF16, else widened in the FMA chain (the
# default on an AVX2 CPU); both take the fused call
WEIGHT_DTYPES = [torch.float32, torch.bfloat16]


def _gate_up(inter: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2 * inter, k, generator=gen) * 0.1).to(dtype)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("inter,k", [(64, 64), (192, 575), (1536, 576)])
def test_the_fused_call_gives_silu_mul_of_the_plain_product_bit_for_bit(dtype, inter, k):
    w = _gate_up(inter, k, dtype)
    plain, fused = PackedLinear.pack(w), PackedGateUp.pack(w)
    gen = torch.Generator().manual_seed(1)
    for m in (1, 6, 7, 64, 300):
        x = torch.randn(m, k, generator=gen)
        expected = kernels.silu_mul(plain(x))
        got = fused.silu_mul(x)
        assert got.shape == (m, inter) and got.dtype == torch.float32
        assert torch.equal(got, expected), m


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_the_product_before_the_silu_is_the_plain_matrixs(dtype):
    """What a step with LoRA rows takes from a PackedGateUp (lora/linear.py): the plain
    matrix's product bit for bit, and SiLU·up of it the fused call's."""
    w = _gate_up(192, 575, dtype, seed=4)
    plain, fused = PackedLinear.pack(w), PackedGateUp.pack(w)
    x = torch.randn(7, 575, generator=torch.Generator().manual_seed(5))
    product = fused.product(x)  # gate's and up's columns in turns of 64
    in_order = product.view(7, 3, 2, 64).transpose(1, 2).reshape(7, 384)
    assert torch.equal(in_order, plain(x))
    assert torch.equal(fused.silu_mul_of(product), fused.silu_mul(x))


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_a_row_does_not_depend_on_its_batch_or_the_thread_count(dtype):
    fused = PackedGateUp.pack(_gate_up(320, 576, dtype, seed=2))
    x = torch.randn(130, 576, generator=torch.Generator().manual_seed(3))
    full = fused.silu_mul(x)
    for m in (1, 2, 5, 13, 129):
        assert torch.equal(fused.silu_mul(x[:m]), full[:m]), m
    assert torch.equal(fused.silu_mul(x[40:47]), full[40:47])
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            assert torch.equal(fused.silu_mul(x), full), count
    finally:
        torch.set_num_threads(threads)


def test_zero_rows_and_a_bad_input_dtype():
    fused = PackedGateUp.pack(_gate_up(64, 32, torch.float32))
    assert fused.silu_mul(torch.empty(0, 32)).shape == (0, 64)
    assert torch.equal(fused.silu_mul(torch.zeros(3, 32)), torch.zeros(3, 64))
    with pytest.raises(RuntimeError, match="x must be float32"):
        fused.silu_mul(torch.zeros(3, 32, dtype=torch.bfloat16))


@pytest.mark.skipif(not kernels.bf16_dot_product_kernel(), reason="no AVX512-BF16")
def test_pair_packed_bf16_rows_in_and_out_keep_the_fp32_bits():
    """Pair kernels round x's rows to bf16 themselves, so bf16 rows in give the same bits; and
    bf16_out is the fp32 result rounded once (as torch's .to), for down's matmul next."""
    fused = PackedGateUp.pack(_gate_up(192, 575, torch.bfloat16))
    assert fused.rounds_rows_to_bf16
    x = torch.randn(37, 575, generator=torch.Generator().manual_seed(6))
    fp32 = fused.silu_mul(x)
    assert torch.equal(fused.silu_mul(x.bfloat16()), fp32)
    rounded = fused.silu_mul(x, bf16_out=True)
    assert torch.equal(rounded.view(torch.int16), fp32.bfloat16().view(torch.int16))
    fma = PackedGateUp.pack(_gate_up(64, 32, torch.float32))
    assert not fma.rounds_rows_to_bf16  # the fp32 chain takes rows unrounded
    with pytest.raises(RuntimeError, match="pair-packed bf16 weights only"):
        fma.silu_mul(torch.zeros(3, 32), bf16_out=True)


def test_gated_mlp_takes_the_fused_call_and_keeps_its_result():
    gen = torch.Generator().manual_seed(4)
    w, down = _gate_up(128, 96, torch.float32), torch.randn(96, 128, generator=gen) * 0.1
    x = torch.randn(9, 96, generator=gen)
    ops = LayerOps(kernels, 1e-6)
    down_packed = PackedLinear.pack(down)
    plain = gated_mlp(x, PackedLinear.pack(w), down_packed, "silu", ops)
    fused = gated_mlp(x, PackedGateUp.pack(w), down_packed, "silu", ops)
    assert torch.equal(fused, plain)


def _one_layer(inter: int) -> ModelWeights:
    hidden = 64
    gen = torch.Generator().manual_seed(5)

    def matrix(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=gen) * 0.1

    layer = LayerWeights(
        input_norm=torch.ones(hidden),
        post_norm=torch.ones(hidden),
        qkv=matrix(3 * hidden, hidden),
        qkv_bias=None,
        o_proj=matrix(hidden, hidden),
        gate_up=matrix(2 * inter, hidden),
        down=matrix(hidden, inter),
    )
    head = matrix(100, hidden)
    return ModelWeights(
        embed=head,
        layers=[layer],
        norm=torch.ones(hidden),
        lm_head=head,
        lm_head_column_major=head,
    )


@pytest.mark.parametrize(
    "silu_mlp,inter,kind",
    [(True, 128, PackedGateUp), (True, 96, PackedLinear), (False, 128, PackedLinear)],
)
def test_pack_weights_fuses_only_silu_mlps_whose_halves_are_whole_panels(silu_mlp, inter, kind):
    weights = batch_invariant.pack_weights(_one_layer(inter), silu_mlp)
    assert type(weights.layers[0].gate_up) is kind
