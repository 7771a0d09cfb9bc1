"""The C++ CPU kernels (csrc/cpu) against the torch reference backend on random steps:
block sizes, GQA ratios, context lengths 1..2000, decodes mixed with prefill chunks over a
cached prefix, fp32 and bf16 KV; and the KV write."""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine import native
from shared.engine.attention import get_backend, resolve_backend
from shared.engine.attention.torch_backend import TorchAttention
from tests.unit.attention_cases import make_step

pytestmark = pytest.mark.skipif(native.load() is None, reason="C++ kernels not built")

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", range(8))
def test_matches_torch_reference_on_random_steps(case, dtype):
    rng = random.Random(case)
    kv_heads = rng.choice([1, 2, 3])
    heads = kv_heads * rng.choice([1, 3, 4])
    block_size = rng.choice([1, 4, 16, 32])
    decodes = [rng.choice([1, 2, 17, rng.randint(1, 2000)]) for _ in range(rng.randint(0, 5))]
    prefills = [
        (rng.choice([0, rng.randint(1, 300)]), rng.randint(2, 40))
        for _ in range(rng.randint(0 if decodes else 1, 2))
    ]
    step = make_step(
        decodes,
        prefills,
        heads=heads,
        kv_heads=kv_heads,
        d=rng.choice([16, 64]),
        block_size=block_size,
        dtype=dtype,
        seed=case,
    )
    ours = get_backend("cpu").attend(step.q, step.kv, step.cache, step.meta)
    # The reference runs in float32 on the same (already rounded) inputs.
    reference = TorchAttention().attend(
        step.q.float(), step.kv.float(), step.cache.float(), step.meta
    )
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.float(), reference, atol=TOLERANCE[dtype], rtol=0)


def test_decode_over_a_long_context_without_a_mask():
    step = make_step([2048, 2048], [], heads=9, kv_heads=3, d=64, block_size=16)
    step.meta.decode_mask = None  # every gathered slot is valid: lengths come from the tables
    ours = get_backend("cpu").attend(step.q, step.kv, step.cache, step.meta)
    reference = TorchAttention().attend(step.q, step.kv, step.cache, step.meta)
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_fills_exactly_the_mapped_slots(dtype):
    step = make_step([5, 33], [(16, 7)], heads=4, kv_heads=2, d=16, block_size=4, dtype=dtype)
    ours, reference = torch.zeros_like(step.cache), torch.zeros_like(step.cache)
    get_backend("cpu").write_kv(ours, step.kv, step.meta)
    TorchAttention().write_kv(reference, step.kv, step.meta)
    assert torch.equal(ours, reference)


def test_write_kv_rejects_a_slot_outside_the_cache():
    step = make_step([3], [], heads=2, kv_heads=1, d=16, block_size=4)
    step.meta.slot_mapping = torch.tensor([step.cache.shape[0] * 4])
    with pytest.raises(RuntimeError, match="out of range"):
        get_backend("cpu").write_kv(step.cache, step.kv, step.meta)


def test_auto_picks_cpu_when_built():
    assert resolve_backend("auto") == "cpu"
