"""`python -m loadtest.engine_bench.group_quant`: one decode step's matmuls on
qwen2.5-coder-0.5b's shapes, weights kept quantized through the group-quant kernel with float
activations (linear_group_quant.cpp) and with int8 ones (linear_group_quant_int8.cpp), beside
the engine's bf16 path (bf16 weights packed for linear.cpp / linear_bf16.cpp), side by side
in one process: CPU ms per step on one torch thread (this thread's CPU time, so the rest of a
loaded machine counts less), the median of `--rounds` rounds, the variants interleaved.

24 layers with weights of their own (a decode step streams them from memory): qkv [1152, 896],
o_proj [896, 896], gate_up [9728, 896], down [896, 4864]; the head [151936, 896] apart.
Formats: "q4_k_m" as llama.cpp lays that file out for this model (K = 896 is no whole number
of 256-blocks: Q5_0 there, Q4_K and Q6_K for down, the head Q8_0), "q8_0", "q4_1" (as the
default model's layers; the head Q8_0), and "awq" (4-bit g128; its head stays bf16). The int8
kernel over panels of 16 columns too where the build has them ("int8 vnni panels": Q4_0-Q8_0
by AVX512-VNNI; "int8 amx panels": those and the k-quants on AMX tiles, where they run). The
weights are random blocks of each format's layout: speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from shared.engine import native
from shared.engine.model.group_quant import GroupQuantLinear
from shared.engine.model.linear_weights import PackedLinear
from shared.engine.model.wna16_linear import from_int_groups
from shared.models.gguf_quant import BLOCKS, unpack
from shared.models.wna16 import IntGroups

SHAPES = {"qkv": (1152, 896), "o_proj": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}
HEAD = (151936, 896)
LAYERS = 24
F16_AT = {  # fp16 factors' offsets in a block (random bytes there could be NaN or inf)
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}  # fmt: skip


def gguf_matrix(qtype: T, n: int, k: int, rng: np.random.Generator) -> GroupQuantLinear:
    block_bytes, per_block = BLOCKS[qtype]
    blocks = rng.integers(0, 256, (n, k // per_block, block_bytes), dtype=np.uint8)
    for at in F16_AT[qtype]:
        f16 = (rng.standard_normal((n, k // per_block)) * 0.01).astype(np.float16)
        blocks[..., at : at + 2] = f16.view(np.uint8).reshape(n, k // per_block, 2)
    arrays = unpack(blocks.reshape(n, -1), qtype, (n, k), "bench")
    tensors = {name: torch.from_numpy(a) for name, a in arrays.arrays().items()}
    return GroupQuantLinear.from_tensors(arrays.params(), tensors)


def awq_matrix(n: int, k: int, gen: torch.Generator) -> GroupQuantLinear:
    groups = IntGroups(
        codes=torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
        scales=torch.rand(n, k // 128, generator=gen) * 0.01,
        zeros=torch.randint(0, 16, (n, k // 128), generator=gen, dtype=torch.int32),
        group_of=None,
    )
    return from_int_groups(groups, 4, "AWQ 4-bit g128")


def quantized_step(fmt: str, seed: int = 0) -> tuple[list[GroupQuantLinear], object]:
    """Every layer matrix of the step in `fmt`, and the head (bf16 for awq)."""
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    matrices = []
    for layer in range(LAYERS):
        for name, (n, k) in SHAPES.items():
            if fmt == "awq":
                matrices.append(awq_matrix(n, k, gen))
            elif fmt in ("q8_0", "q4_1"):
                matrices.append(gguf_matrix(T.Q8_0 if fmt == "q8_0" else T.Q4_1, n, k, rng))
            else:  # q4_k_m: Q6_K for half the layers' down, as llama.cpp's use_more_bits
                kind = (T.Q6_K if layer % 2 == 0 else T.Q4_K) if name == "down" else T.Q5_0
                matrices.append(gguf_matrix(kind, n, k, rng))
    if fmt == "awq":
        head = PackedLinear.pack(torch.randn(*HEAD, generator=gen).to(torch.bfloat16))
    else:
        head = gguf_matrix(T.Q8_0, *HEAD, rng)
    return matrices, head


def bf16_twin(matrices: list[GroupQuantLinear]) -> list[PackedLinear]:
    return [PackedLinear.pack(m.dequantize().to(torch.bfloat16)) for m in matrices]


def median_ms(calls: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """name -> median CPU ms of one call, the calls interleaved round by round."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():  # warm-up
        call()
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.thread_time()
            call()
            times[name].append((time.thread_time() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="q4_k_m,awq,q8_0,q4_1")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=1, help="rows per matmul (1: decode)")
    parser.add_argument(
        "--generic", action="store_true", help="also the kernels' generic paths (the same bits)"
    )
    args = parser.parse_args()
    kernels = native.load()
    assert kernels is not None, "the C++ kernels are not built (python -m shared.engine.native)"
    torch.set_num_threads(1)
    fp32_path, int8_path = kernels.group_quant_paths()
    vector = int8_path != "generic"
    panel_kinds = ["vnni"] * (int8_path == "avx512_vnni") + ["amx"] * (kernels.amx_tiles() == "on")
    print(
        f"kernels built for {', '.join(kernels.cpu_features())}; float activations: {fp32_path}, "
        f"int8: {int8_path}; rows {args.rows}"
    )
    gen = torch.Generator().manual_seed(1)
    x = {k: torch.randn(args.rows, k, generator=gen) for k in (896, 4864)}
    for fmt in args.formats.split(","):
        layers, head = quantized_step(fmt)
        int8 = [m.with_int8_activations(vector) for m in layers]
        bf16 = bf16_twin(layers)
        assert all(m.kernel.startswith("int8") for m in int8), "a matrix the int8 kernel skips"

        inputs = [x[m.in_features] for m in layers]

        def run(ms: list, inputs: list = inputs) -> Callable[[], None]:
            return lambda: [m(xi) for m, xi in zip(ms, inputs, strict=True)]

        variants = {"float act": run(layers), "int8 act": run(int8), "bf16": run(bf16)}
        for kind in [k for k in panel_kinds if fmt != "awq"]:
            ms = [m.with_int8_activations(vector, panels=kind) for m in layers]
            variants[f"int8 {kind} panels"] = run(ms)
        if args.generic:
            variants["float act generic"] = run([replace(m, kernel="generic") for m in layers])
            variants["int8 act generic"] = run([replace(m, kernel="int8-generic") for m in int8])
        step = median_ms(variants, args.rounds)
        if isinstance(head, GroupQuantLinear):
            head_int8, head_bf16 = head.with_int8_activations(vector), bf16_twin([head])[0]
            heads = {"float act": head, "int8 act": head_int8, "bf16": head_bf16}
            for kind in panel_kinds:
                heads[f"int8 {kind} panels"] = head.with_int8_activations(vector, panels=kind)
        else:
            heads = {"bf16": head}
        head_ms = median_ms({name: lambda h=h: h(x[896]) for name, h in heads.items()}, args.rounds)
        print(
            f"{fmt}: layers, CPU ms per step (median of {args.rounds}): "
            + ", ".join(f"{name} {ms:.1f}" for name, ms in step.items())
            + "; head: "
            + ", ".join(f"{name} {ms:.1f}" for name, ms in head_ms.items())
        )
        del layers, int8, bf16, head, heads


if __name__ == "__main__":
    main()
