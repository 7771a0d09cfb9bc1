"""`python -m loadtest.engine_bench.kquant16`: the k-quants' int8-activation linear on
qwen2.5-coder-1.5b's shapes, the register tile (linear_group_quant's "int8" kernel, the stored
layout) beside the kernels on panels of 16 columns (repack_kquant_amx's layout): "vnni" (the
"int8-panels" kernel, AVX512-VNNI for every row count: what hosts without AMX take) and, where
AMX tiles run, "amx" (the "int8-amx" kernel, what the engine takes there), interleaved in one
process on one torch thread: CPU ms per call (this thread's CPU time), the median of
`--rounds`, and the multiply-adds per second against one core's measured peaks
(core_peak_gops counts a multiply-add as 2 ops). The panels give the same integer sums as the
tile in another float order, each the same bits as the other (tests/unit/test_int8_panels.py);
the weights are random blocks of the format.
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


def calls(kernels, w: GroupQuantLinear, panels: dict, x: torch.Tensor) -> dict:
    """the register tile and each panel kernel (name -> the matrix repacked for it) on the same
    matrix and rows"""
    out = {"tile": lambda: kernels.linear_group_quant(x, *w.kernel_args(), "int8")}
    return out | {name: (lambda m=m: m(x)) for name, m in panels.items()}


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
    for fmt in args.formats.split(","):
        for shape, (n, k) in SHAPES.items():
            w = gguf_matrix(T[fmt], n, k, np.random.default_rng(0))
            kinds = ["vnni", "amx"] if tiles else ["vnni"]
            panels = {kind: w.with_int8_activations(vector=True, panels=kind) for kind in kinds}
            mb = sum(t.numel() * t.element_size() for t in w.tensors()) / 1e6
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                ms = median_ms(calls(kernels, w, panels, x), args.rounds)
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
