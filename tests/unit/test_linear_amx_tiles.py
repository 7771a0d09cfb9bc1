"""The AMX tile paths of the bf16 and W8A8 int8 linears (csrc/cpu/linear_amx.h, amx_tiles.h).

The tile walk (blocks of 32 rows x half a 64-column panel, the last 16 rows or fewer x a whole
panel, 16-pair k steps, rows and columns past the edge through a scratch block, the SiLU·up
epilogue, threads over panels) runs everywhere through `emulated_tiles`, a scalar model of the
tile operations; so these tests check it on any CPU. The tile instructions themselves run only
where the CPU has AMX and the OS grants tile data: there `tiles` is checked against the model
and for row invariance too, and `auto` must pick it. A slow test compiles the AMX build for a
Sapphire Rapids CPU on any host, so a CI machine without AMX still proves that path builds."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from shared.engine import native
from tests.unit.torch_threads import torch_threads

kernels = native.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels not built")
needs_amx = pytest.mark.skipif(
    kernels is None or kernels.amx_tiles() != "on", reason="no AMX tiles here"
)
needs_vnni = pytest.mark.skipif(
    kernels is None or not kernels.int8_dot_product_kernel(), reason="no AVX512-VNNI"
)
TILE_KERNELS = ["emulated_tiles", pytest.param("tiles", marks=needs_amx)]
SHAPES = [(64, 64), (67, 33), (576, 960), (1536, 576), (5, 1), (32, 130)]  # (K, N)


def _weights_and_rows(k: int, n: int, m: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
    return w, kernels.pack_bf16_pairs(w), torch.randn(m, k, generator=gen)


def test_the_pair_layout_pads_k_to_whole_tile_steps():
    w, packed, _ = _weights_and_rows(67, 70, 1)
    assert packed.shape == (2, 48, 128)  # ceil(67 / 2) = 34 pairs -> 48; 70 columns -> 2 panels
    pairs = packed.view(2, 48, 64, 2).permute(0, 2, 1, 3).reshape(128, 96)
    assert torch.equal(pairs[:70, :67], w)
    assert not pairs[70:].any() and not pairs[:, 67:].any()


@pytest.mark.parametrize("kernel", TILE_KERNELS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}-N{s[1]}")
def test_tiles_match_float64(kernel, shape):
    k, n = shape
    w, packed, _ = _weights_and_rows(k, n, 0, seed=k + n)
    gen = torch.Generator().manual_seed(k * n)
    bias = torch.randn(n, generator=gen).bfloat16()
    for m in (1, 15, 16, 17, 40):
        x = torch.randn(m, k, generator=gen).bfloat16()
        y = kernels.linear_bf16_pairs(x, packed, n, bias, kernel)
        reference = F.linear(x.double(), w.double(), bias.double())
        # the largest |y| could be: the rounding's bound is relative to it
        scale = (x.abs().double() @ w.abs().double().t() + bias.abs().double()).max().item()
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        # fp32 sums of exact products, then one bf16 rounding (2**-8 relative)
        assert (y.double() - reference).abs().max().item() <= 2**-8 * scale + 1e-5 * scale
        y32 = kernels.linear_bf16_pairs(x.float(), packed, n, None, kernel)  # fp32 activations
        assert y32.dtype == torch.float32
        assert torch.allclose(y32.double(), F.linear(x.double(), w.double()), atol=1e-4 * scale)


@pytest.mark.parametrize("kernel", TILE_KERNELS)
def test_a_row_is_bitwise_the_same_for_every_batch_size_and_thread_count(kernel):
    # up to 16 rows take 1 x 4 blocks, from 17 on 2 x 2 ones: rows must not tell them apart
    _, packed, x = _weights_and_rows(576, 130, 70, seed=3)
    full = kernels.linear_bf16_pairs(x, packed, 130, None, kernel)
    for m in range(1, 71):
        assert torch.equal(kernels.linear_bf16_pairs(x[:m], packed, 130, None, kernel), full[:m])
    for start in (1, 15, 17, 40):
        part = kernels.linear_bf16_pairs(x[start : start + 20], packed, 130, None, kernel)
        assert torch.equal(part, full[start : start + 20]), start
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            assert torch.equal(kernels.linear_bf16_pairs(x, packed, 130, None, kernel), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel", TILE_KERNELS)
def test_the_silu_mul_epilogue_gives_the_bits_of_the_plain_product(kernel):
    inter, k = 192, 576
    w, _, x = _weights_and_rows(k, 2 * inter, 37, seed=5)
    # PackedGateUp's order: 64 rows of gate, then the same 64 of up, pair after pair
    interleaved = w.reshape(2, inter // 64, 64, k).transpose(0, 1).reshape(2 * inter, k)
    packed = kernels.pack_bf16_pairs(interleaved)
    product = kernels.linear_bf16_pairs(x, kernels.pack_bf16_pairs(w), 2 * inter, None, kernel)
    expected = kernels.silu_mul(product)
    assert torch.equal(kernels.linear_silu_mul_bf16_pairs(x, packed, inter, kernel), expected)
    row = kernels.linear_silu_mul_bf16_pairs(x[5:6], packed, inter, kernel)
    assert torch.equal(row, expected[5:6])


def _int8_rows_and_reference(k: int, n: int, m: int, seed: int):
    """A quantized weight, rows and the kernel's exact result: x quantized per row as the kernel
    does it, integer sums, then the two scales in the kernel's order of float products."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales, x = torch.rand(n, generator=gen) / 100, torch.randn(m, k, generator=gen)
    sx = x.abs().amax(dim=1) / 127
    xq = torch.round(x * (1 / sx)[:, None]).clamp(-127, 127).long()
    reference = ((xq @ q.long().t()).float() * sx[:, None]) * scales[None, :]
    packed, colsums = kernels.pack_int8_quads(q)
    return (packed, scales, colsums), x, reference


@pytest.mark.parametrize("kernel", [*TILE_KERNELS, pytest.param("dot", marks=needs_vnni)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}-N{s[1]}")
def test_int8_kernels_give_the_exact_quantized_product(kernel, shape):
    k, n = shape
    (packed, scales, colsums), x, reference = _int8_rows_and_reference(k, n, 40, seed=k * 7 + n)
    assert packed.shape == (-(-n // 64), -(-k // 64) * 16, 256)  # quads padded to whole steps
    for m in (1, 15, 16, 17, 40):
        y = kernels.linear_int8(x[:m], packed, scales, colsums, n, None, kernel)
        assert torch.equal(y, reference[:m]), m


@pytest.mark.parametrize("kernel", TILE_KERNELS)
def test_int8_tiles_keep_rows_bitwise_across_batches_and_threads(kernel):
    (packed, scales, colsums), x, _ = _int8_rows_and_reference(576, 130, 70, seed=11)
    full = kernels.linear_int8(x, packed, scales, colsums, 130, None, kernel)
    for m in (1, 2, 15, 16, 17, 33, 69):
        assert torch.equal(kernels.linear_int8(x[:m], packed, scales, colsums, 130, None, kernel),
                           full[:m])  # fmt: skip
    with torch_threads(1):
        assert torch.equal(kernels.linear_int8(x, packed, scales, colsums, 130, None, kernel), full)


def test_tiles_by_name_are_refused_where_they_do_not_run():
    _, packed, x = _weights_and_rows(64, 64, 2)
    if kernels.amx_tiles() != "on":
        with pytest.raises(RuntimeError, match=f"AMX tiles are {kernels.amx_tiles()} here"):
            kernels.linear_bf16_pairs(x, packed, 64, None, "tiles")
    with pytest.raises(RuntimeError, match="kernel: auto, dot, tiles or emulated_tiles"):
        kernels.linear_bf16_pairs(x, packed, 64, None, "amx")
    if not kernels.int8_dot_product_kernel():
        (quads, scales, colsums), x, _ = _int8_rows_and_reference(64, 64, 2, seed=0)
        with pytest.raises(RuntimeError, match="no AVX512-VNNI kernel"):
            kernels.linear_int8(x, quads, scales, colsums, 64, None, "dot")


@needs_amx
def test_the_hardware_tiles_agree_with_the_model_and_auto_takes_them():
    w, packed, x = _weights_and_rows(1536, 576, 40, seed=7)
    hardware = kernels.linear_bf16_pairs(x, packed, 576, None, "tiles")
    model = kernels.linear_bf16_pairs(x, packed, 576, None, "emulated_tiles")
    # The same exact products; the SDM's order of the sums, which the hardware may round
    # otherwise inside one instruction, and it flushes denormals: fp32 sums' error apart,
    # not a misplaced tile's (a few % of the scale)
    scale = (x.bfloat16().abs().double() @ w.abs().double().t()).max().item()
    assert (hardware - model).abs().max().item() <= 1e-5 * scale
    assert torch.equal(kernels.linear_bf16_pairs(x, packed, 576, None, "auto"), hardware)
    (quads, scales, colsums), x, _ = _int8_rows_and_reference(1536, 576, 40, seed=7)
    int8 = [kernels.linear_int8(x, quads, scales, colsums, 576, None, k) for k in ("tiles", "dot")]
    assert torch.equal(*int8)  # exact integer sums: the tiles give the dot products' bits
    assert kernels.core_peak_gops("amx_bf16", 200_000) > kernels.core_peak_gops("bf16", 2_000_000)
    assert kernels.core_peak_gops("amx_int8", 200_000) > kernels.core_peak_gops("int8", 2_000_000)


# The tile walk with the hardware tiles: bf16 (the plain product and the SiLU·up epilogue) and
# int8.
HARDWARE_WALK = """
#include "linear_amx.h"
#include "silu_mul.h"
using amx::bf16;
using Bf16 = amx::HardwareTiles<amx::Bf16>;
using Int8 = amx::HardwareTiles<amx::Int8>;
template void linear_amx::run<Bf16>(const bf16*, int64_t, const bf16*, float*, int64_t, int64_t,
    int64_t, const linear_tiles::NoEpilogue&);
template void linear_amx::run<Bf16>(const bf16*, int64_t, const bf16*, float*, int64_t, int64_t,
    int64_t, const SiluMulPanels<float>&);
template void linear_amx::run<Bf16>(const bf16*, int64_t, const bf16*, float*, int64_t, int64_t,
    int64_t, const SiluMulPanels<c10::BFloat16>&);
template void linear_amx::run<Int8>(const uint8_t*, int64_t, const int8_t*, int32_t*, int64_t,
    int64_t, int64_t, const linear_tiles::NoEpilogue&);
"""


@pytest.mark.skipif(
    shutil.which("g++") is None or shutil.which("objdump") is None, reason="no g++ / objdump"
)
def test_the_amx_path_builds_for_a_sapphire_rapids_cpu(tmp_path):
    (tmp_path / "walk.cpp").write_text(HARDWARE_WALK)
    walk = ["tdpbf16ps", "tdpbusd", "tileloadd", "tileloaddt1", "tilestored", "tilezero"]
    wanted = {  # each source's tile instructions, as the assembler wrote them
        tmp_path / "walk.cpp": walk,
        native.ROOT / "csrc" / "cpu" / "amx_tiles.cpp": ["ldtilecfg", "tdpbusd", "tilerelease"],
    }
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), str(native.ROOT / "csrc" / "cpu")]
    for source, instructions in wanted.items():
        out = tmp_path / f"{source.stem}.o"
        command = ["g++", "-std=c++20", "-c", "-O1", "-march=sapphirerapids", "-fopenmp"]
        command += [*(f"-I{p}" for p in includes), str(source), "-o", str(out)]
        compiled = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert compiled.returncode == 0, compiled.stderr[-2000:]
        objdump = ["objdump", "-d", str(out)]
        disassembly = subprocess.run(objdump, check=True, capture_output=True, text=True).stdout
        for instruction in instructions:
            assert instruction in disassembly, (source.name, instruction)
