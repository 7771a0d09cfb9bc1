"""`splitserve bench attention`: the layers' caches and one timed step."""

from __future__ import annotations

import math

import pytest
import torch

from loadtest.engine_bench.attention import (
    AttentionBenchConfig,
    decode_step,
    layer_caches,
    time_step_ms,
)
from shared.engine import native


def test_layer_caches_are_distinct_copies_of_the_shape() -> None:
    cfg = AttentionBenchConfig(dtype="bfloat16")
    _, _, cache, _ = decode_step(cfg, batch=2, context=40)
    caches = layer_caches(cache, 3)
    assert len(caches) == 3
    assert all(c.shape == cache.shape and c.dtype == cache.dtype for c in caches)
    assert all(c.is_contiguous() for c in caches)
    assert torch.equal(caches[0], cache)
    assert not torch.equal(caches[1], caches[0]) and not torch.equal(caches[2], caches[1])
    caches[1].zero_()  # each its own memory
    assert torch.equal(caches[0], cache) and caches[2].abs().sum() > 0


@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(native.load() is None, reason="no C++ kernels built"),
        ),
    ],
)
def test_a_step_is_timed_over_layers_of_their_own_caches(backend: str) -> None:
    cfg = AttentionBenchConfig(layers=3, repeats=1, caches_bytes=1 << 20, dtype="bfloat16")
    ms = time_step_ms(cfg, backend, batch=2, context=17)
    assert math.isfinite(ms) and ms > 0
