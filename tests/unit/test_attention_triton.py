"""The Triton kernels, run by Triton's interpreter on CPU, against the torch reference on
small random steps: split-K decodes (contexts beyond one split), GQA, block sizes, prefill
chunks over a cached prefix, fp32 and bf16; and the KV write."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

import pytest
import torch

from shared.engine.attention import get_backend
from shared.engine.attention.torch_backend import TorchAttention
from tests.unit.attention_cases import make_step

pytestmark = pytest.mark.skipif(
    os.environ["TRITON_INTERPRET"] != "1" and not torch.cuda.is_available(),
    reason="needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"
CASES = {
    # decodes, prefills (cached, chunk), heads, kv_heads, d, block_size
    "decode-gqa3": ([1, 17, 40], [], 6, 2, 16, 16),
    "split-k": ([700, 5], [], 4, 1, 16, 16),
    "mixed-cached-prefix": ([9], [(0, 5), (20, 6)], 4, 2, 16, 4),
    "mha-d64-block1": ([3, 2], [(3, 3)], 2, 2, 64, 1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_matches_torch_reference(case, dtype):
    decodes, prefills, heads, kv_heads, d, block_size = CASES[case]
    step = make_step(
        decodes, prefills, heads=heads, kv_heads=kv_heads, d=d, block_size=block_size, dtype=dtype
    )
    q, cache = step.q.to(DEVICE), step.cache.to(DEVICE)
    ours = get_backend("triton").attend(q, step.kv.to(DEVICE), cache, step.meta).cpu()
    reference = TorchAttention().attend(
        step.q.float(), step.kv.float(), step.cache.float(), step.meta
    )
    assert ours.dtype == dtype
    atol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours.float(), reference, atol=atol, rtol=0)


def test_write_kv_fills_exactly_the_mapped_slots():
    step = make_step([5, 33], [(16, 7)], heads=4, kv_heads=2, d=16, block_size=4)
    reference = torch.zeros_like(step.cache)
    TorchAttention().write_kv(reference, step.kv, step.meta)
    ours = torch.zeros_like(step.cache).to(DEVICE)
    get_backend("triton").write_kv(ours, step.kv.to(DEVICE), step.meta)
    assert torch.equal(ours.cpu(), reference)
