"""Long contexts in the AVX-512 paged attention: a row that sees more than 512 tokens is
attended in parts cut at multiples of 512 and merged by the parts' top scores and sums. A
few rows spread their parts over the threads, many rows take theirs one after another, and
a prefill chunk reads them from its widened copy: the row's bits must be the same in every
case, and match the torch backend."""

from __future__ import annotations

import pytest
import torch

from shared.engine import native
from shared.engine.attention.cpu_backend import CpuAttention
from shared.engine.attention.row_plan import plan_rows
from shared.engine.attention.torch_backend import TorchAttention
from tests.unit.attention_cases import make_step
from tests.unit.test_fused_ops import DTYPES, _attend_rows, _close, _thread_counts

kernels = native.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels not built")

# decode rows of 1300 (three parts), 512 (one: the cut falls at its end) and 513 tokens (two,
# the second of one token), 40 (one); a 20-row prefill chunk whose rows see 1031-1050 tokens
DECODES = [1300, 512, 513, 40]
CHUNK = (1030, 20)


def _step(dtype: torch.dtype, seed: int = 0):
    return make_step(
        DECODES, [CHUNK], heads=9, kv_heads=3, d=64, block_size=16, dtype=dtype, seed=seed
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("window", "softcap"), [(0, 0.0), (700, 0.0), (0, 30.0)], ids=["full", "window", "softcap"]
)
def test_a_long_row_has_the_same_bits_alone_in_a_batch_and_under_any_threads(
    dtype, window, softcap
):
    """Alone, a row's parts are items of their own over the threads; in the whole step (24
    rows) each row is one item, its parts in turn; the chunk's rows read a widened copy."""
    step = _step(dtype)
    plan = plan_rows(step.meta, 16)
    every = torch.arange(step.q.shape[0])
    results = _thread_counts(lambda: _attend_rows(step, plan, every, window, softcap))
    full = results[0]
    for out in results[1:]:
        assert torch.equal(out, full)
    for row in range(step.q.shape[0]):
        for alone in _thread_counts(
            lambda row=row: _attend_rows(step, plan, torch.tensor([row]), window, softcap)
        ):
            assert torch.equal(alone, full[row : row + 1]), row
    pair = torch.tensor([0, 1])
    assert torch.equal(_attend_rows(step, plan, pair, window, softcap), full[:2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("peak", [None, 5, 700, 1290], ids=["none", "part0", "part1", "part2"])
def test_merged_parts_match_torch(dtype, peak):
    """The merge weights each part by its sum and top score: the result matches one softmax
    over the whole context, also when one key (in the first, second or third part of the
    1300-token row) outscores every other by far."""
    step = _step(dtype, seed=1)
    if peak is not None:
        table = step.meta.decode_block_tables[0]
        slot = int(table[peak // 16]) * 16 + peak % 16
        step.cache.view(-1, 2, 3, 64)[slot, 0] = step.q[0].view(3, 3, 64)[:, 0] * 4
    ours = CpuAttention().attend(step.q, step.kv, step.cache, step.meta)
    _close(ours, TorchAttention().attend(step.q, step.kv, step.cache, step.meta), dtype)
