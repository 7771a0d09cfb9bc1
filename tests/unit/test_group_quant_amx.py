"""The k-quants on AMX-INT8 tiles (csrc/cpu/linear_kquant_amx.cpp, kernel "int8-amx" over
repack_kquant_amx's panels): the int8 path's result within float rounding for Q2_K to
Q6_K, bitwise the same for a row whatever rows and threads share its call (the engine takes
this path for every row count where the tiles run), and a repacked matrix refused where the
stored layout is read. Runs where the CPU has AMX and the OS grants the tiles. The one-group
formats' panels: test_block_panels.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from loadtest.engine_bench.group_quant import gguf_matrix
from shared.engine import native
from tests.unit.panel_checks import check_panels, panel_rows

kernels = native.load()
pytestmark = pytest.mark.skipif(
    kernels is None or kernels.amx_tiles() != "on", reason="no AMX tiles here"
)
N = 3 * 16


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("k", [256, 1536])
def test_the_int8_sums_and_the_same_bits_for_every_row_count(qtype, k):
    check_panels(gguf_matrix(qtype, N, k, np.random.default_rng(k)), "amx")


def test_a_repacked_matrix_is_no_stored_layout():
    w = gguf_matrix(T.Q4_K, N, 256, np.random.default_rng(0))
    amx = w.with_int8_activations(vector=True, panels="amx")
    with pytest.raises(ValueError, match="in panels"):
        amx.take_rows(torch.arange(16))
    with pytest.raises(ValueError, match="in panels"):
        amx.dequantize()
    assert not amx.stacks_with(w)
    narrow = gguf_matrix(T.Q4_K, N + 5, 256, np.random.default_rng(0))  # not whole panels
    assert narrow.with_int8_activations(vector=True, panels="amx").kernel == "int8"
    with pytest.raises(RuntimeError, match="16-column panels"):
        kernels.linear_group_quant(panel_rows(1, 256, 0), *narrow.kernel_args(), "int8-amx")
