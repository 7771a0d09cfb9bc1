"""The GGUF formats in panels of 16 columns with int8 activations: the k-quants Q2_K-Q6_K
(repack_kquant_amx, csrc/cpu/linear_kquant_panels.cpp) and the one-group formats Q4_0-Q8_0
(repack_block_panels, linear_block_panels.cpp), by AVX512-VNNI alone ("int8-panels", what
AVX512-VNNI hosts without AMX take) and, where AMX tiles run, on them ("int8-amx"). Each as the
engine uses it: no byte more than the stored layout, the int8 path's sums within float rounding
(`int8-generic` sums the same integers in another float order), bitwise the same for a row
whatever rows and threads share its call, the two kernels the same bits as each other, and a
repacked matrix refused where the stored layout is read."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from loadtest.engine_bench.group_quant import gguf_matrix
from shared.engine import native
from shared.engine.model.group_quant import GroupQuantLinear
from shared.engine.model.wna16_linear import from_int_groups
from shared.models.wna16 import IntGroups
from tests.unit.torch_threads import torch_threads

kernels = native.load()
pytestmark = pytest.mark.skipif(
    kernels is None or kernels.group_quant_paths()[1] != "avx512_vnni",
    reason="no AVX512-VNNI build here",
)
tiles = pytest.mark.skipif(
    kernels is None or kernels.amx_tiles() != "on", reason="no AMX tiles here"
)
N = 3 * 16
KERNELS = {"amx": "int8-amx", "vnni": "int8-panels"}
# k-quants: one super-block, qwen2.5 1.5B's hidden size. One-group formats: one tile step of
# two blocks, SmolLM2's hidden size (spans of 8, 8, 2 blocks), qwen2.5 0.5B's.
SHAPES = [(q, k) for q in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K) for k in (256, 1536)] + [
    (q, k) for q in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0) for k in (64, 576, 896)
]
IDS = [f"{q.name}-{k}" for q, k in SHAPES]


def rows(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 7] = 0.0  # a zero and an outlier per row: blocks of very different ranges
    x[:, k // 2 + 3] *= 30
    return x


def check_panels(w: GroupQuantLinear, kind: str) -> torch.Tensor:
    """`w` repacked for `kind`, checked; its result on 150 rows (past one chunk of 128)."""
    packed = w.with_int8_activations(vector=True, panels=kind)
    assert packed.kernel == KERNELS[kind]
    assert [t.numel() for t in packed.tensors()] == [t.numel() for t in w.tensors()]
    x = rows(150, w.in_features, seed=w.in_features)
    y = packed(x)
    exact = kernels.linear_group_quant(x, *w.kernel_args(), "int8-generic")
    assert torch.allclose(y, exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    for m in [*range(1, 18), 33, 129]:
        assert torch.equal(packed(x[:m]), y[:m]), m
    assert torch.equal(packed(x[140:141]), y[140:141])  # a row alone, from a later chunk
    with torch_threads(1):
        assert torch.equal(packed(x), y)
    return y


@pytest.mark.parametrize(("qtype", "k"), SHAPES, ids=IDS)
def test_by_vnni_the_int8_sums_and_the_same_bits_for_every_row_count(qtype, k):
    check_panels(gguf_matrix(qtype, N, k, np.random.default_rng(k)), "vnni")


@tiles
@pytest.mark.parametrize(("qtype", "k"), SHAPES, ids=IDS)
def test_on_tiles_the_same_and_the_same_bits_as_by_vnni(qtype, k):
    w = gguf_matrix(qtype, N, k, np.random.default_rng(k))
    on_tiles = check_panels(w, "amx")
    assert torch.equal(check_panels(w, "vnni"), on_tiles)


@pytest.mark.parametrize("kind", ["vnni", pytest.param("amx", marks=tiles)])
@pytest.mark.parametrize(("qtype", "k"), [(T.Q4_K, 256), (T.Q4_1, 64), (T.Q8_0, 64)], ids=str)
def test_a_repacked_matrix_is_no_stored_layout_and_narrow_ones_stay(kind, qtype, k):
    w = gguf_matrix(qtype, N, k, np.random.default_rng(0))
    packed = w.with_int8_activations(vector=True, panels=kind)
    with pytest.raises(ValueError, match="in panels"):
        packed.take_rows(torch.arange(16))
    with pytest.raises(ValueError, match="in panels"):
        packed.dequantize()
    assert not packed.stacks_with(w)
    narrow = gguf_matrix(qtype, N + 8, k, np.random.default_rng(0))  # not whole panels
    assert narrow.with_int8_activations(vector=True, panels=kind).kernel == "int8"
    with pytest.raises(RuntimeError, match="16-column panels"):
        kernels.linear_group_quant(rows(1, k, 0), *narrow.kernel_args(), packed.kernel)


@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_gptq_in_groups_of_32_takes_the_panels_too(bits):
    """GPTQ / AWQ symmetric in groups of 32 (every zero point at the midpoint) is a one-group
    layout: 4-bit codes with zero 8, 8-bit ones as int8 with zero 0."""
    gen = torch.Generator().manual_seed(bits)
    groups = IntGroups(
        codes=torch.randint(0, 1 << bits, (N, 256), generator=gen, dtype=torch.uint8),
        scales=torch.rand(N, 256 // 32, generator=gen) * 0.01,
        zeros=torch.full((N, 256 // 32), 1 << (bits - 1), dtype=torch.int32),
        group_of=None,
    )
    w = from_int_groups(groups, bits, f"GPTQ {bits}-bit g32")
    assert (w.per_super, w.sub_min, w.zero) == (1, None, 8 if bits == 4 else 0)
    check_panels(w, "vnni")
