"""`check_panels(w, kind)`: a GGUF matrix repacked into panels of 16 columns (kind "amx" or
"vnni", `GroupQuantLinear.with_int8_activations`) checked as the engine uses it: no byte more
than the stored layout, the int8 kernel's result within float rounding (`int8-generic` sums
the same integers in another float order), and bitwise the same for a row whatever rows and
threads share its call. Returns the repacked matrix and its result on `panel_rows`."""

from __future__ import annotations

import torch

from shared.engine import native
from shared.engine.model.group_quant import GroupQuantLinear
from tests.unit.torch_threads import torch_threads

KERNELS = {"amx": "int8-amx", "vnni": "int8-panels"}


def panel_rows(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 7] = 0.0  # a zero and an outlier per row: blocks of very different ranges
    x[:, k // 2 + 3] *= 30
    return x


def check_panels(w: GroupQuantLinear, kind: str) -> tuple[GroupQuantLinear, torch.Tensor]:
    packed = w.with_int8_activations(vector=True, panels=kind)
    assert packed.kernel == KERNELS[kind]
    assert [t.numel() for t in packed.tensors()] == [t.numel() for t in w.tensors()]
    x = panel_rows(150, w.in_features, seed=w.in_features)  # past one chunk of 128 rows
    y = packed(x)
    exact = native.load().linear_group_quant(x, *w.kernel_args(), "int8-generic")
    assert torch.allclose(y, exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    for m in [*range(1, 18), 33, 129]:
        assert torch.equal(packed(x[:m]), y[:m]), m
    assert torch.equal(packed(x[140:141]), y[140:141])  # a row alone, from a later chunk
    with torch_threads(1):
        assert torch.equal(packed(x), y)
    return packed, y
