"""The fused per-row ops of csrc/cpu/fused_ops.cpp (RMSNorm, residual add + RMSNorm,
SiLU * up, RoPE + KV write) and the grouped AVX-512 paged attention: accuracy against the
torch path they replace, in fp32 and bf16, and bitwise row invariance — a row's result is
the same alone, in any batch, at any offset and with 1, 2 or 3 threads."""

from __future__ import annotations

import pytest
import torch

from shared.engine import native
from shared.engine.attention.cpu_backend import CpuAttention
from shared.engine.attention.row_plan import plan_rows
from shared.engine.attention.torch_backend import TorchAttention
from shared.engine.model.layer_ops import LayerOps
from tests.unit.attention_cases import make_step

kernels = native.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels not built")
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
EPS = 1e-5
# one rounding of the activation dtype (bf16 keeps 8 bits), a few fp32 ulps for fp32
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def _ops(native_path: bool) -> LayerOps:
    return LayerOps(kernels if native_path else None, EPS)


def _rows(m: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return (torch.randn(m, n, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def _close(ours: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> None:
    scale = reference.abs().float().max().item() + 1.0
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    assert (ours.float() - reference.float()).abs().max().item() <= TOLERANCE[dtype] * scale


def _thread_counts(call):
    """call() under 1, 2 and 3 torch threads."""
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(call())
        return results
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [576, 67, 16])
def test_norms_match_torch(dtype, n):
    x, delta = _rows(37, n, dtype), _rows(37, n, dtype, seed=1)
    weight = _rows(1, n, dtype, seed=2)[0]
    _close(_ops(True).norm(x, weight), _ops(False).norm(x, weight), dtype)
    h_native, normed_native = _ops(True).add_norm(x.clone(), delta, weight)
    h_torch, normed_torch = _ops(False).add_norm(x.clone(), delta, weight)
    assert torch.equal(h_native, h_torch)  # the add rounds once, as torch's
    _close(normed_native, normed_torch, dtype)


@pytest.mark.parametrize("n", [576, 67])
def test_norms_in_bf16_are_the_fp32_norms_rounded_once(n):
    """bf16_out (for a bf16 matmul next): the fp32 path's bits, rounded as torch's .to
    (a NaN stays a NaN; its payload bits may differ)."""
    x, delta = _rows(37, n, torch.float32), _rows(37, n, torch.float32, seed=1)
    x[0, 0], x[1, 0], x[2, 0] = 3e38, -1e-39, float("nan")  # an overflow, a subnormal, a NaN
    weight = _rows(1, n, torch.float32, seed=2)[0]
    ops = _ops(True)

    def same(a: torch.Tensor, b: torch.Tensor) -> None:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

    same(ops.norm(x, weight, bf16_out=True), ops.norm(x, weight).bfloat16())
    h, normed = ops.add_norm(x.clone(), delta, weight)
    h_too, normed_bf16 = ops.add_norm(x.clone(), delta, weight, bf16_out=True)
    same(h_too, h)
    same(normed_bf16, normed.bfloat16())
    with pytest.raises(RuntimeError, match="bf16_out takes float32 x"):
        kernels.rms_norm(x.bfloat16(), weight.bfloat16(), EPS, True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 41])
def test_silu_mul_matches_torch(dtype, inter):
    fused = _rows(29, 2 * inter, dtype)
    fused[0, :8] = torch.tensor([-100.0, -88.0, -30.0, 0.0, 30.0, 88.0, 100.0, -0.0])
    _close(_ops(True).silu_mul(fused), _ops(False).silu_mul(fused), dtype)


def _rope_case(dtype, t: int, heads=9, kv_heads=3, d=64, rotated=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, heads + 2 * kv_heads, d, generator=gen).to(dtype)
    angles = torch.rand(300, rotated // 2, generator=gen) * 6.3
    table = torch.polar(torch.full_like(angles, 1.1), angles)  # a yarn-like magnitude too
    positions = torch.randint(0, 300, (t,), generator=gen)
    slots = torch.randperm(8 * 16, generator=gen)[:t]
    cache = torch.zeros(8, 16, 2, kv_heads, d, dtype=dtype)
    return qkv, table, positions, slots, cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotated", [64, 32], ids=["full", "partial"])
def test_rope_and_kv_write_match_torch(dtype, rotated):
    from shared.engine.attention.metadata import AttentionMetadata

    qkv, table, positions, slots, cache = _rope_case(dtype, 23, rotated=rotated)
    meta = AttentionMetadata(slots, 0, torch.zeros(0, 1, dtype=torch.int64), None, [])
    results = []
    for path in (True, False):
        ours_qkv, ours_cache, ops = qkv.clone(), cache.clone(), _ops(path)
        ops.rope_write_kv(
            ours_qkv, 9, ops.rope(table, positions), ours_cache, meta, TorchAttention()
        )
        results.append((ours_qkv, ours_cache))
    (native_qkv, native_cache), (torch_qkv, torch_cache) = results
    _close(native_qkv, torch_qkv, dtype)
    _close(native_cache, torch_cache, dtype)
    flat = native_cache.view(-1, 2, 3, 64)
    assert torch.equal(flat[slots], native_qkv[:, 9:].view(-1, 2, 3, 64))  # k rotated, v as is
    assert flat.abs().sum(dim=(1, 2, 3)).count_nonzero() == len(slots)  # nothing else written


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotated", [64, 32], ids=["full", "partial"])
def test_beside_a_16_bit_cache_q_comes_back_rounded_as_torch_rounds_it(cache_dtype, rotated):
    """fp32 qkv, 16-bit cache: the rotated q heads come back in the cache's dtype, bit for bit
    what rotating in fp32 then `.to()` gives, and qkv's own q heads are left as they were."""
    qkv, table, positions, slots, cache = _rope_case(torch.float32, 23, rotated=rotated)
    pairs = torch.view_as_real(table)
    reference, reference_cache = qkv.clone(), cache.clone()  # fp32 all the way: rotates in place
    assert kernels.rope_write_kv(reference, pairs, positions, reference_cache, slots, 9) is None
    ours, ours_cache = qkv.clone(), cache.to(cache_dtype)
    q = kernels.rope_write_kv(ours, pairs, positions, ours_cache, slots, 9)
    assert q.dtype == cache_dtype and q.shape == (23, 9, 64) and q.is_contiguous()
    assert torch.equal(q, reference[:, :9].to(cache_dtype))
    assert torch.equal(ours_cache, reference_cache.to(cache_dtype))
    assert torch.equal(ours[:, :9], qkv[:, :9])  # q: only in what came back
    assert torch.equal(ours[:, 9:], reference[:, 9:])  # k rotated in place, v as it was


def test_rope_refuses_a_position_beyond_the_table_and_a_bad_slot():
    qkv, table, positions, slots, cache = _rope_case(torch.float32, 3)
    pairs = torch.view_as_real(table)
    with pytest.raises(RuntimeError, match="beyond the rope table"):
        kernels.rope_write_kv(qkv, pairs, torch.tensor([0, 1, 300]), cache, slots, 9)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.rope_write_kv(qkv, pairs, positions, cache, torch.tensor([0, 1, 128]), 9)


def _row_op(name: str, dtype: torch.dtype):
    """op(start, m): the fused op over rows [start, start + m) of a fixed 64-row input."""
    x, delta = _rows(64, 576, dtype), _rows(64, 576, dtype, seed=3)
    weight = _rows(1, 576, dtype, seed=2)[0]
    fused = _rows(64, 3072, dtype)
    qkv, table, positions, slots, cache = _rope_case(dtype, 64)
    pairs = torch.view_as_real(table)

    def add_norm(start: int, m: int) -> torch.Tensor:
        h = x[start : start + m].clone()
        normed = kernels.add_rms_norm(h, delta[start : start + m], weight, EPS)
        return torch.cat([h, normed], dim=1)

    def rope(start: int, m: int) -> torch.Tensor:
        rows, written = qkv[start : start + m].clone(), torch.zeros_like(cache)
        rows_slots = slots[start : start + m]
        kernels.rope_write_kv(rows, pairs, positions[start : start + m], written, rows_slots, 9)
        return torch.cat([rows.view(m, -1), written.view(-1, 6 * 64)[rows_slots]], dim=1)

    ops = {
        "rms_norm": lambda start, m: kernels.rms_norm(x[start : start + m], weight, EPS),
        "add_rms_norm": add_norm,
        "silu_mul": lambda start, m: kernels.silu_mul(fused[start : start + m]),
        "rope_write_kv": rope,
    }
    return ops[name]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "silu_mul", "rope_write_kv"])
def test_a_row_is_bitwise_the_same_in_any_batch_and_thread_count(dtype, name):
    op = _row_op(name, dtype)
    full = op(0, 64)
    for m in (1, 2, 5, 17, 63):
        assert torch.equal(op(0, m), full[:m]), m
    for start in (1, 7, 40):
        assert torch.equal(op(start, 9), full[start : start + 9]), start
    for result in _thread_counts(lambda: op(0, 64)):
        assert torch.equal(result, full)


ATTENTION_SHAPES = [(9, 3, 64), (8, 8, 80), (16, 2, 128), (32, 2, 64)]  # heads, kv_heads, d


def _attend_rows(
    step, plan, rows: torch.Tensor, window: int = 0, softcap: float = 0.0
) -> torch.Tensor:
    """The kernel over query rows `rows` of a step only: [len(rows), heads, d]."""
    q = step.q[rows].contiguous()
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5
    kernels.paged_attention(
        out,
        q,
        step.cache,
        plan.block_tables,
        plan.row_table[rows],
        plan.row_context[rows],
        scale,
        window,
        softcap,
    )
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "h{}-kv{}-d{}".format(*s))
def test_an_attention_row_is_bitwise_the_same_alone_or_in_any_batch(dtype, shape):
    """Decodes and prefill chunks in one step; every row alone, the rows in slices and under
    1-3 threads give the same bits, and match the torch backend. 32 heads over 2 (G = 16)
    take the per-head path, which must hold too."""
    heads, kv_heads, d = shape
    step = make_step(
        [5, 40, 17],
        [(0, 21), (24, 9)],
        heads=heads,
        kv_heads=kv_heads,
        d=d,
        block_size=16,
        dtype=dtype,
    )
    plan = plan_rows(step.meta, 16)
    full = CpuAttention().attend(step.q, step.kv, step.cache, step.meta)  # [T, heads, d]
    _close(full, TorchAttention().attend(step.q, step.kv, step.cache, step.meta), dtype)
    t = step.q.shape[0]
    for row in range(t):
        assert torch.equal(_attend_rows(step, plan, torch.tensor([row])), full[row : row + 1])
    for start, stop in ((0, 2), (1, 9), (3, t), (20, 30)):
        assert torch.equal(_attend_rows(step, plan, torch.arange(start, stop)), full[start:stop])
    everything = torch.arange(t)
    for out in _thread_counts(lambda: _attend_rows(step, plan, everything)):
        assert torch.equal(out, full)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("window", "softcap"), [(0, 0.0), (37, 0.0), (0, 30.0)], ids=["full", "window", "softcap"]
)
@pytest.mark.parametrize(
    "shape", [*ATTENTION_SHAPES[:3], (10, 2, 64)], ids=lambda s: "h{}-kv{}-d{}".format(*s)
)
def test_a_long_prefill_chunk_reads_a_widened_context_with_the_same_bits(
    dtype, window, softcap, shape
):
    """A chunk of 16 rows or more reads its context from a copy made once for all its rows, not
    from the paged cache: in fp32 widened (K as 16-token tiles), in bf16 with AVX512-BF16 its
    keys transposed (transposed_keys.h: the keys in the lanes, the same sums in the same order).
    Each row alone, read from the cache, gives the same bits, also where a window starts a
    row's context inside a tile, scores are capped, or a head's dims are not a multiple of 32;
    groups of 3, 1, 8 and 5 query heads a KV head (the transposed scores take up to 4 at once).
    Dim 0 of every q and key is large, so that every score is about 512 (about 30 where a cap
    of 30 would flatten larger ones) and its last bit large: a sum in another order then shows
    in the output (with scores of about 1 it mostly rounds away in the bf16 weights)."""
    heads, kv_heads, d = shape
    step = make_step(
        [9], [(70, 45)], heads=heads, kv_heads=kv_heads, d=d, block_size=16, dtype=dtype
    )
    large = 16.0 if softcap else 64.0
    step.q[..., 0] = large
    step.cache[:, :, 0, :, 0] = large  # [blocks, block_size, K / V, kv_heads, d]
    plan = plan_rows(step.meta, 16)
    every = torch.arange(step.q.shape[0])
    for full in _thread_counts(lambda: _attend_rows(step, plan, every, window, softcap)):
        for row in range(step.q.shape[0]):
            alone = _attend_rows(step, plan, torch.tensor([row]), window, softcap)
            assert torch.equal(alone, full[row : row + 1]), row


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_with_a_peaked_softmax_matches_torch(dtype):
    """Scores hundreds apart: the weights that underflow (or fall under 2^-64) count as 0,
    as they do in fp32 anyway, and the result still matches the torch backend."""
    step = make_step([33, 7], [(16, 20)], heads=9, kv_heads=3, d=64, block_size=16, dtype=dtype)
    step.q.mul_(40)
    ours = CpuAttention().attend(step.q, step.kv, step.cache, step.meta)
    _close(ours, TorchAttention().attend(step.q, step.kv, step.cache, step.meta), dtype)
