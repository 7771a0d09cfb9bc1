"""`python -m loadtest.engine_bench.kquant16`: the k-quants' int8-activation linear on
qwen2.5-coder-1.5b's shapes, today's register tile (linear_group_quant's "int8" kernel, the
stored layout) beside the kernel on panels of 16 columns (linear_kquant16, the repacked
layout) and, where AMX tiles run, the AMX kernel (the "int8-amx" kernel over
repack_kquant_amx's panels, what the engine takes there), interleaved in one process on one
torch thread: CPU ms per call (this thread's CPU time), the median of `--rounds`, and the
multiply-adds per second against one core's measured peaks (core_peak_gops counts a
multiply-add as 2 ops). The tile and panel16 give the same bits (tests/unit/test_kquant16.py),
amx the same integer sums in another float order (tests/unit/test_int8_panels.py); the weights
are random blocks of the format.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from loadtest.engine_bench.group_quant import gguf_matrix, median_ms
from shared.engine import native
from shared.engine.model.group_quant import GroupQuantLinear

SHAPES = {"gate_up": (17920, 1536), "down": (1536, 8960), "q/o": (1536, 1536)}


def calls(kernels, w: GroupQuantLinear, packed: list, amx, x: torch.Tensor) -> dict:
    """today's tile, the panel kernel and (amx: the matrix repacked, or None) the AMX kernel on
    the same matrix and rows"""
    out = {
        "tile": lambda: kernels.linear_group_quant(x, *w.kernel_args(), "int8"),
        "panel16": lambda: kernels.linear_kquant16(
            x, *packed, w.bits, w.group, w.zero, w.out_features
        ),
    }
    if amx is not None:
        out["amx"] = lambda: amx(x)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="Q4_K,Q6_K")
    parser.add_argument("--rows", default="1,16,128")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    kernels = native.load()
    assert kernels is not None and kernels.int8_dot_product_kernel(), "no AVX512-VNNI kernels"
    torch.set_num_threads(1)
    tiles = kernels.amx_tiles() == "on"
    names = ("int8", "int8_kquant", "amx_int8") if tiles else ("int8", "int8_kquant")
    peaks = {name: kernels.core_peak_gops(name, 50_000_000) for name in names}
    print("one core's peaks, Gop/s: " + ", ".join(f"{n} {g:.0f}" for n, g in peaks.items()))
    empty = torch.empty(0)
    for fmt in args.formats.split(","):
        for shape, (n, k) in SHAPES.items():
            w = gguf_matrix(T[fmt], n, k, np.random.default_rng(0))
            parts = [w.low, w.high, w.super_scale, w.sub_scale, w.super_min, w.sub_min]
            packed = kernels.repack_kquant16(
                *[empty if p is None else p for p in parts], w.bits, w.group, w.zero
            )
            amx = w.with_int8_activations(vector=True, panels="amx") if tiles else None
            mb = sum(p.numel() * p.element_size() for p in packed) / 1e6
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                ms = median_ms(calls(kernels, w, packed, amx, x), args.rounds)
                gops = {name: 2 * m * n * k / t / 1e6 for name, t in ms.items()}
                print(
                    f"{fmt} {shape} [{n}, {k}] rows {m}: "
                    + ", ".join(
                        f"{name} {t:.2f} ms ({gops[name] / 2:.0f} G mult-adds/s, "
                        f"{gops[name] / peaks['int8']:.0%} of int8, "
                        f"{gops[name] / peaks['int8_kquant']:.0%} of int8_kquant)"
                        for name, t in ms.items()
                    )
                    + "; speed-up "
                    + " / ".join(f"{name} {ms['tile'] / t:.2f}x" for name, t in ms.items())
                    + f"; weights {mb:.1f} MB: "
                    + " / ".join(f"{mb / t:.1f}" for t in ms.values())
                    + " GB/s"
                )


if __name__ == "__main__":
    main()
