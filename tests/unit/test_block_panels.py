"""The one-group formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) in panels of 16 columns
(repack_block_panels, csrc/cpu/linear_block_panels.cpp): by AVX512-VNNI alone ("int8-panels",
what AVX512-VNNI hosts without AMX take) and, where AMX tiles run, on them ("int8-amx"): the
int8 path's sums within float rounding, every row count the same bits, and the two kernels the
same bits as each other; a repacked matrix refused where the stored layout is read."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from loadtest.engine_bench.group_quant import gguf_matrix
from shared.engine import native
from shared.engine.model.wna16_linear import from_int_groups
from shared.models.wna16 import IntGroups
from tests.unit.panel_checks import check_panels, panel_rows

kernels = native.load()
pytestmark = pytest.mark.skipif(
    kernels is None or kernels.group_quant_paths()[1] != "avx512_vnni",
    reason="no AVX512-VNNI build here",
)
tiles = pytest.mark.skipif(
    kernels is None or kernels.amx_tiles() != "on", reason="no AMX tiles here"
)
N = 3 * 16
FORMATS = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
# one tile step of two blocks; SmolLM2's hidden size (spans of 8, 8, 2 blocks); qwen2.5 0.5B's
WIDTHS = [64, 576, 896]


@pytest.mark.parametrize("k", WIDTHS)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_by_vnni_the_int8_sums_and_the_same_bits_for_every_row_count(qtype, k):
    check_panels(gguf_matrix(qtype, N, k, np.random.default_rng(k)), "vnni")


@tiles
@pytest.mark.parametrize("k", WIDTHS)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_on_tiles_the_same_and_the_same_bits_as_by_vnni(qtype, k):
    w = gguf_matrix(qtype, N, k, np.random.default_rng(k))
    _, on_tiles = check_panels(w, "amx")
    by_vnni = w.with_int8_activations(vector=True, panels="vnni")
    assert torch.equal(by_vnni(panel_rows(150, k, seed=k)), on_tiles)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_panels_are_no_stored_layout_and_narrow_or_other_layouts_stay(qtype):
    w = gguf_matrix(qtype, N, 64, np.random.default_rng(1))
    packed = w.with_int8_activations(vector=True, panels="vnni")
    with pytest.raises(ValueError, match="in panels"):
        packed.dequantize()
    with pytest.raises(ValueError, match="in panels"):
        packed.take_rows(torch.arange(16))
    assert not packed.stacks_with(w)
    narrow = gguf_matrix(qtype, N + 8, 64, np.random.default_rng(1))  # not whole panels
    assert narrow.with_int8_activations(vector=True, panels="vnni").kernel == "int8"
    with pytest.raises(RuntimeError, match="16-column panels"):
        kernels.linear_group_quant(panel_rows(1, 64, 0), *narrow.kernel_args(), "int8-panels")
    kquant = gguf_matrix(T.Q4_K, N, 256, np.random.default_rng(1))  # VNNI panels: one-group only
    assert kquant.with_int8_activations(vector=True, panels="vnni").kernel == "int8"
    with pytest.raises(RuntimeError, match="int8-panels takes"):
        kernels.linear_group_quant(panel_rows(1, 256, 0), *kquant.kernel_args(), "int8-panels")


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
