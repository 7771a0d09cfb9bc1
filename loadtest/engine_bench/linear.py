"""`splitserve bench linear`: matmul time per forward step, torch against the batch-invariant
C++ kernels, on SmolLM2-135M's shapes. `--numerics`: fp32 (torch's fp32 matmul vs the FMA
chain of csrc/cpu/linear.cpp), bf16 (torch's bf16 matmul vs linear_bf16.cpp's AMX tiles or
AVX512-BF16 dot products, where built) or int8 (torch's weight-only int8 kernel vs the W8A8
AMX-INT8 tiles or VNNI dot products of linear_int8.cpp).

One step of T rows: 30 layers of fused qkv [960, 576], o_proj [576, 576], fused gate_up
[3072, 576] and down [576, 1536], then the LM head [49152, 576]. torch gets the engine's
layouts (column-major layers; the head column-major up to 2 rows, row-major above); the
kernel its packed ones. Weights repeat across layers here, so they stay in cache: this
times the arithmetic, not the weight streaming of a real decode (see `bench engine`).

Each step's line also gives the kernel's Gop/s (2 per multiply-add) as a fraction of the
peak for the same instruction of as many cores as torch has threads, measured on the spot
with all of them running at once (csrc/cpu/peak.cpp, machine_share.all_cores_peak).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loadtest.engine_bench.machine_share import all_cores_peak, kernel_numerics
from shared.engine import native
from shared.engine.batch_invariant import PackedLinear
from shared.engine.model.linear_weights import Int8DotLinear, Int8Linear
from shared.engine.model.weights import column_major

MATRICES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)


@dataclass(slots=True, frozen=True)
class LinearBenchConfig:
    rows: tuple[int, ...] = (1, 32, 64, 256)
    layers: int = 30
    trials: int = 7
    numerics: str = "fp32"


def clock() -> float:
    """Seconds: this thread's CPU time with one torch thread (other load on the machine does
    not count), else wall time."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def time_matrix(
    shape: tuple[int, int], rows: int, trials: int, head: bool, numerics: str = "fp32"
) -> list[float]:
    """[torch, kernel] µs per [rows, K] @ [N, K].T: the best of `trials` runs of repeated
    calls (a few ms each), the two interleaved."""
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if numerics == "bf16" else torch.float32
    w = torch.randn(*shape, generator=gen).to(dtype)
    x = torch.randn(rows, shape[1], generator=gen).to(dtype)
    calls: list[Callable[[], torch.Tensor]]
    if numerics == "int8":
        weight_only, w8a8 = Int8Linear.quantize(w), Int8DotLinear.quantize(w)
        calls = [lambda: weight_only(x), lambda: w8a8(x)]
    else:
        torch_w = column_major(w) if not head or rows <= 2 else w
        packed = PackedLinear.pack(w)
        calls = [lambda: F.linear(x, torch_w), lambda: packed(x)]
    for call in calls:  # warm-up
        call()
    repeats = max(1, 2 * 10**8 // (rows * shape[0] * shape[1]))  # ~2e8 multiply-adds a run
    best = [float("inf")] * len(calls)
    for _ in range(trials):
        for i, call in enumerate(calls):
            start = clock()
            for _ in range(repeats):
                call()
            best[i] = min(best[i], (clock() - start) / repeats)
    return [t * 1e6 for t in best]


def step_multiply_adds(rows: int, layers: int) -> int:
    """Multiply-adds of one forward step's matmuls over `rows` rows."""
    per_layer = sum(n * k for n, k in MATRICES.values())
    return rows * (layers * per_layer + HEAD[0] * HEAD[1])


def run_linear_bench(cfg: LinearBenchConfig) -> None:
    print(
        f"torch threads: {torch.get_num_threads()}; ms of matmuls per forward step "
        f"({cfg.numerics}; {'thread CPU time' if torch.get_num_threads() == 1 else 'wall'})"
    )
    threads = torch.get_num_threads()
    kernels = native.load()
    if cfg.numerics == "int8" and not kernels.int8_dot_product_kernel():
        raise SystemExit("bench linear --numerics int8: this CPU has no W8A8 kernel (AVX512-VNNI)")
    numerics = kernel_numerics(kernels, cfg.numerics)
    peak = all_cores_peak(kernels.core_peak_gops, numerics, threads)
    print(f"{numerics} multiply-add peak of {threads} core(s) at once, measured: {peak:.0f} Gop/s")
    print(f"{'rows':>5} {'matrix':>8} {'torch':>9} {'kernel':>9} {'ratio':>6}")
    for rows in cfg.rows:
        total = [0.0, 0.0]
        for name, shape in [*MATRICES.items(), ("lm_head", HEAD)]:
            count = 1 if name == "lm_head" else cfg.layers
            times = time_matrix(shape, rows, cfg.trials, count == 1, cfg.numerics)
            ms = [t * count / 1e3 for t in times]
            total = [a + b for a, b in zip(total, ms, strict=True)]
            print_row(rows, name, ms)
        print_row(rows, "step", total)
        gops = 2 * step_multiply_adds(rows, cfg.layers) / (total[1] / 1e3) / 1e9
        print(f"{rows:>5} {'kernel':>8} {gops:>9.0f} Gop/s = {gops / peak:.0%} of the peak")


def print_row(rows: int, name: str, ms: list[float]) -> None:
    print(f"{rows:>5} {name:>8} {ms[0]:>9.2f} {ms[1]:>9.2f} {ms[1] / ms[0]:>6.2f}")
