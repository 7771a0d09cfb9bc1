"""`splitserve bench step` on the tiny model: every stage it names is timed, for the native
fused ops and for torch's."""

from __future__ import annotations

import pytest

from loadtest.engine_bench.step import StepBenchConfig, blocks_needed, run_step_bench, spans_of
from shared.engine import native


def test_shapes_name_decodes_and_prefills():
    decodes = spans_of("d3", context=20)
    assert [len(s.token_ids) for s in decodes] == [1, 1, 1]
    assert {s.start for s in decodes} == {20}
    tables = [set(s.block_table) for s in decodes]
    assert all(len(t) == 2 for t in tables) and not tables[0] & tables[1]  # disjoint blocks
    (prefill,) = spans_of("p40", context=20)
    assert len(prefill.token_ids) == 40 and len(prefill.block_table) == 3
    assert blocks_needed(("d3", "p40"), 20) == 6
    with pytest.raises(ValueError, match="dN"):
        spans_of("x4", 20)


NO_KERNELS = pytest.mark.skipif(native.load() is None, reason="no C++ kernels")


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [
        ("torch", "float32"),
        pytest.param("cpu", "float32", marks=NO_KERNELS),
        pytest.param("cpu", "bfloat16", marks=NO_KERNELS),  # the layers' stages, not one call
    ],
)
def test_every_stage_is_timed(tiny_model_dir, capsys, backend, dtype):
    run_step_bench(
        StepBenchConfig(
            tiny_model_dir,
            dtype=dtype,
            shapes=("d2", "p9"),
            context=17,
            trials=1,
            attention_backend=backend,
        )
    )
    out = capsys.readouterr().out
    assert ("native fused ops" in out) == (backend == "cpu")
    for stage in ("matmul qkv", "matmul lm_head", "attention", "norm / add + norm", "silu * up"):
        assert out.count(stage) == 2, stage  # once per shape
    assert "d2:" in out and "p9:" in out


def test_each_matmul_says_the_bytes_its_matrices_hold(tiny_model_dir, capsys):
    run_step_bench(StepBenchConfig(tiny_model_dir, shapes=("d1",), context=5, trials=1, threads=2))
    out = capsys.readouterr().out
    assert "wall time, 2 thread(s)" in out
    head = next(line for line in out.splitlines() if "matmul lm_head" in line)
    assert "MB" in head and "GB/s" in head
    attention = next(line for line in out.splitlines() if line.strip().startswith("attention"))
    assert "GB/s" not in attention  # no matrices there
