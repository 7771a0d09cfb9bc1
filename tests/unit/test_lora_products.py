"""The stacked LoRA products (csrc/cpu/lora_products.cpp through shared/engine/lora/stacked.py):
every row by its own slot's adapter in one call, against float64 on modules whose columns do
not fill whole panels, ranks below a panel and modules an adapter leaves alone; a row's bits
the same alone, in any batch, in any order and at any thread count; torch's formulation of
the same layout (off the CPU kernels) agrees.
"""

from __future__ import annotations

import pytest
import torch

from shared.engine import native
from shared.engine.lora.checkpoint import LowRankPair
from shared.engine.lora.stacked import StackedPair, lay_out
from tests.unit.torch_threads import torch_threads

pytestmark = pytest.mark.skipif(native.load() is None, reason="C++ kernels not built")

EDGES = (0, 40, 56, 72)  # three modules, of 40, 16 and 16 columns: panels with tails
K = 37
MAX_RANK = 20  # two rank panels


def random_pair(gen: torch.Generator, rank: int, present: tuple[bool, ...]) -> LowRankPair:
    a = torch.randn(len(present), rank, K, generator=gen)
    b = torch.randn(EDGES[-1], rank, generator=gen)
    for m, on in enumerate(present):
        if not on:
            a[m] = 0
            b[EDGES[m] : EDGES[m + 1]] = 0
    return LowRankPair(a, b, present)


def reference(
    x: torch.Tensor, slots: list[int], pairs: list[LowRankPair], edges: tuple[int, ...] = EDGES
) -> torch.Tensor:
    """float64: each row's sum over its adapter's modules of B_m A_m x (slots past `pairs`
    leave the matrix alone)."""
    y = torch.zeros(x.shape[0], edges[-1], dtype=torch.float64)
    for t, s in enumerate(slots):
        if not 0 <= s < len(pairs):
            continue
        pair = pairs[s]
        for m, on in enumerate(pair.present):
            if on:
                first, stop = edges[m], edges[m + 1]
                u = pair.a[m].double() @ x[t].double()
                y[t, first:stop] = pair.b[first:stop].double() @ u
    return y


def stacked(dtype: torch.dtype, seed: int = 0) -> tuple[StackedPair, list[LowRankPair]]:
    gen = torch.Generator().manual_seed(seed)
    pairs = [
        random_pair(gen, 16, (True, True, True)),
        random_pair(gen, 3, (True, False, True)),  # one rank panel, mostly padding
        random_pair(gen, 20, (False, True, False)),  # two rank panels
    ]
    pairs = [LowRankPair(p.a.to(dtype), p.b.to(dtype), p.present) for p in pairs]
    stack = StackedPair(4, EDGES, K, 2, dtype, torch.device("cpu"))
    for slot, pair in enumerate(pairs):
        stack.fill(slot, lay_out(pair, EDGES, 2))
    stack.fill(3, None)  # an adapter that leaves this matrix alone
    return stack, pairs


def run(stack: StackedPair, x: torch.Tensor, base: torch.Tensor, slots: list[int]):
    return stack.add(x, base.clone(), torch.tensor(slots, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_row_gets_its_own_adapters_product(dtype):
    stack, pairs = stacked(dtype)
    gen = torch.Generator().manual_seed(1)
    slots = [0, 1, -1, 2, 0, 3, 1, 1, 2, -1, 0] * 5  # 55 rows: row blocks and tails
    x = torch.randn(len(slots), K, generator=gen)
    base = torch.randn(len(slots), EDGES[-1], generator=gen)
    y = run(stack, x, base, slots)
    expected = reference(x, slots, pairs)
    assert (y.double() - base.double() - expected).abs().max().item() < 1e-4
    untouched = [t for t, s in enumerate(slots) if s in (-1, 3)]
    assert torch.equal(y[untouched], base[untouched])  # the base's bits, not base + 0.0


def test_a_rows_bits_never_depend_on_the_rest_of_its_batch():
    stack, _ = stacked(torch.bfloat16, seed=2)
    gen = torch.Generator().manual_seed(3)
    slots = [2, 0, 0, 1, -1, 0, 2, 2, 1, 0, 0, 0, 0, 0] * 3
    x = torch.randn(len(slots), K, generator=gen)
    base = torch.randn(len(slots), EDGES[-1], generator=gen)
    together = run(stack, x, base, slots)
    order = torch.randperm(len(slots), generator=gen).tolist()
    shuffled = run(stack, x[order], base[order], [slots[i] for i in order])
    assert torch.equal(shuffled, together[order])
    with torch_threads(1):
        for t in range(len(slots)):
            alone = run(stack, x[t : t + 1], base[t : t + 1], [slots[t]])
            assert torch.equal(alone[0], together[t]), t


def test_bf16_activations_and_outputs():
    stack, pairs = stacked(torch.bfloat16, seed=4)
    gen = torch.Generator().manual_seed(5)
    slots = [0, 1, 2, -1]
    x = torch.randn(4, K, generator=gen).bfloat16()
    base = torch.randn(4, EDGES[-1], generator=gen).bfloat16()
    y = run(stack, x, base, slots)
    assert y.dtype == torch.bfloat16
    expected = base.double() + reference(x, slots, pairs)
    assert torch.allclose(y.double(), expected, rtol=1e-2, atol=5e-2)


def test_torch_formulation_agrees_with_the_kernel():
    stack, _ = stacked(torch.float32, seed=6)
    gen = torch.Generator().manual_seed(7)
    slots = [1, 0, -1, 2, 3, 0]
    x = torch.randn(len(slots), K, generator=gen)
    base = torch.randn(len(slots), EDGES[-1], generator=gen)
    kernel = run(stack, x, base, slots)
    by_torch = stack.add_by_torch(x, base.clone(), torch.tensor(slots, dtype=torch.int32))
    assert torch.allclose(kernel, by_torch, atol=1e-4)


def test_a_refilled_slot_keeps_nothing_of_the_adapter_before():
    stack, pairs = stacked(torch.float32, seed=8)
    stack.fill(0, lay_out(pairs[1], EDGES, 2))  # rank 3 over the rank-16 adapter
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, K, generator=gen).repeat(3, 1)
    base = torch.zeros(3, EDGES[-1])
    y = run(stack, x, base, [0, 0, 1])
    assert torch.equal(y[0], y[2]) and torch.equal(y[1], y[2])


def test_a_call_split_over_threads_keeps_every_rows_bits():
    """Rows and slots enough that one call runs as several tasks (lora_products.cpp's runs,
    each a run of slots' row blocks): the bits of one thread, and of each row alone."""
    gen = torch.Generator().manual_seed(10)
    k, edges = 640, (0, 128, 160, 200)  # v's 40 columns: two panels and a tail
    pairs = [
        LowRankPair(
            torch.randn(3, 16, k, generator=gen).bfloat16(),
            torch.randn(edges[-1], 16, generator=gen).bfloat16(),
            (True, True, True),
        )
        for _ in range(4)
    ]
    stack = StackedPair(4, edges, k, 1, torch.bfloat16, torch.device("cpu"))
    for slot, pair in enumerate(pairs):
        stack.fill(slot, lay_out(pair, edges, 1))
    slots = [t % 5 - 1 for t in range(150)]  # every slot and the base, interleaved
    x = torch.randn(len(slots), k, generator=gen)
    base = torch.randn(len(slots), edges[-1], generator=gen)
    with torch_threads(2):
        split = run(stack, x, base, slots)
    with torch_threads(1):
        one = run(stack, x, base, slots)
        alone = {t: run(stack, x[t : t + 1], base[t : t + 1], [slots[t]]) for t in range(0, 150, 7)}
    assert torch.equal(split, one)
    for t, row in alone.items():
        assert torch.equal(row[0], split[t]), t
    expected = reference(x, slots, pairs, edges)
    assert torch.allclose(split.double() - base.double(), expected, rtol=1e-4, atol=1e-3)


def test_products_into_a_y_that_holds_its_modules_in_turns():
    """A PackedGateUp's product holds gate's and up's columns in turns (`interleave`): every
    module's columns get the bits they get in the plain order, by the kernel and by torch."""
    edges, turn, rank = (0, 48, 96), 16, 5
    gen = torch.Generator().manual_seed(10)
    stack = StackedPair(2, edges, K, 1, torch.float32, torch.device("cpu"))
    for slot, present in enumerate([(True, True), (False, True)]):
        a = torch.randn(2, rank, K, generator=gen) * torch.tensor(present)[:, None, None]
        b = torch.randn(edges[-1], rank, generator=gen)
        stack.fill(slot, lay_out(LowRankPair(a, b, present), edges, 1))
    own = torch.arange(edges[-1])  # y's column j holds module m's column n:
    m, n = own % (2 * turn) // turn, own // (2 * turn) * turn + own % turn
    columns = torch.tensor(edges)[m] + n
    slots = torch.tensor([0, 1, -1, 0, 1], dtype=torch.int32)
    x = torch.randn(len(slots), K, generator=gen)
    base = torch.randn(len(slots), edges[-1], generator=gen)
    plain = stack.add(x, base.clone(), slots)
    in_turns = stack.add(x, base[:, columns].clone(), slots, interleave=turn)
    assert torch.equal(in_turns, plain[:, columns])
    by_torch = stack.add_by_torch(x, base[:, columns].clone(), slots, interleave=turn)
    assert torch.allclose(by_torch, plain[:, columns], atol=1e-4)
    with pytest.raises(RuntimeError, match="interleave"):
        stack.add(x, base.clone(), slots, interleave=24)
