"""The batch-invariant linear kernel (csrc/cpu/linear.cpp) and the engine's batch_invariant
mode: accuracy against float64 on shapes with tails, bitwise row invariance across batch
sizes and thread counts, and a request's logits and seeded tokens bitwise the same alone,
batched with others, chunked, or resumed after any number of delivered tokens.

Without batch_invariant (torch's matmul) the engine test fails on every row: a decode row's
logits differ in the last bits from the same row computed in a prefill or a larger batch.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from shared.engine import batch_invariant, native
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from tests.engine_harness import LogitsRecorder, hf_logits, run_to_completion

pytestmark = pytest.mark.skipif(native.load() is None, reason="C++ kernels not built")

SHAPES = [(64, 64), (67, 33), (576, 960), (1536, 576), (5, 1), (200, 130), (1, 17)]  # (K, N)


def packed_linear(x, w, bias=None):
    return batch_invariant.PackedLinear.pack(w)(x, bias)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}-N{s[1]}")
def test_matches_float64_on_shapes_with_tails(shape):
    k, n = shape
    gen = torch.Generator().manual_seed(k * 1000 + n)
    w, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    for m in (1, 2, 3, 5, 6, 7, 64, random.Random(n).randint(8, 300)):
        x = torch.randn(m, k, generator=gen)
        y = packed_linear(x, w, bias)
        reference = F.linear(x.double(), w.double(), bias.double())
        scale = (x.abs().double() @ w.abs().double().t()).max().item() + 1.0
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert (y.double() - reference).abs().max().item() <= 2e-6 * scale, (m, k, n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_weights_round_the_fp32_sum_once(dtype):
    gen = torch.Generator().manual_seed(0)
    w, x, bias = (torch.randn(*s, generator=gen).to(dtype) for s in ((130, 67), (9, 67), (130,)))
    y = packed_linear(x, w, bias)
    reference = F.linear(x.double(), w.double(), bias.double())
    assert y.dtype == dtype
    assert torch.allclose(y.double(), reference, rtol=1e-2, atol=1e-2)
    # the engine's way: fp32 activations against 16-bit weights, an fp32 result
    y32 = packed_linear(x.float(), w, bias)
    assert y32.dtype == torch.float32
    assert torch.allclose(y32.double(), reference, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_float_out_gives_the_fp32_sum_of_the_widened_input(dtype):
    """float_out (attention's bf16 output into the fp32 residual stream through o_proj): the
    bits of widening x to fp32 first, left in fp32; without it the same sums rounded once."""
    gen = torch.Generator().manual_seed(2)
    w, x, bias = (torch.randn(*s, generator=gen).to(dtype) for s in ((130, 67), (9, 67), (130,)))
    layer = batch_invariant.PackedLinear.pack(w)
    for b in (None, bias):
        y = layer(x, b, float_out=True)
        assert y.dtype == torch.float32
        assert torch.equal(y, layer(x.float(), b))
        assert torch.equal(layer(x, b), y.to(dtype))


@pytest.mark.parametrize("shape", [(67, 130), (576, 960)], ids=["K67-N130", "K576-N960"])
@pytest.mark.parametrize(
    "weight_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_a_row_is_bitwise_the_same_for_every_batch_size(shape, weight_dtype):
    """16-bit weights too: the FMA chain widens them (or, with AVX512-BF16, bf16 takes the
    pair dot products), whatever the rows around."""
    k, n = shape
    gen = torch.Generator().manual_seed(1)
    layer = batch_invariant.PackedLinear.pack(torch.randn(n, k, generator=gen).to(weight_dtype))
    x = torch.randn(300, k, generator=gen)
    full = layer(x)
    for m in range(1, 301):
        assert torch.equal(layer(x[:m]), full[:m]), m
    for start in (1, 7, 100):  # the same rows at other offsets of the batch
        assert torch.equal(layer(x[start : start + 5]), full[start : start + 5]), start


@pytest.mark.skipif(
    native.load() is not None and native.load().bf16_dot_product_kernel(),
    reason="bf16 takes the AVX512-BF16 pair dot products here, not the FMA chain",
)
@pytest.mark.parametrize("shape", [(67, 130), (576, 960), (5, 1), (64, 17)], ids=str)
def test_bf16_weights_give_the_bits_of_the_same_values_in_fp32(shape):
    """The FMA chain widens each bf16 weight exactly, however the panel lays them out (an AVX2
    build interleaves a panel's bf16 columns in pairs of eight): every column lands where the
    fp32 copy's does, tails included."""
    k, n = shape
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bf16, fp32 = (batch_invariant.PackedLinear.pack(v) for v in (w, w.float()))
    for m in (1, 5, 6, 7, 64):
        x = torch.randn(m, k, generator=gen)
        assert torch.equal(bf16(x), fp32(x)), m


def test_auto_turns_on_only_with_invariant_weights_and_cpu_attention(tmp_path):
    def resolved(**settings) -> bool:
        return batch_invariant.resolve(EngineConfig(model_dir=tmp_path, **settings))

    assert resolved()
    assert not resolved(batch_invariant=False)
    # w8a8 is batch-invariant through the VNNI kernel; int8 and int4 weight-only never are
    assert resolved(quantization="w8a8") == native.load().int8_dot_product_kernel()
    assert not resolved(quantization="int8") and not resolved(quantization="int4")
    assert not resolved(attention_backend="torch")
    with pytest.raises(ValueError, match="float or w8a8 weights"):
        EngineConfig(model_dir=tmp_path, batch_invariant=True, quantization="int4")
    with pytest.raises(ValueError, match="cpu attention"):
        EngineConfig(model_dir=tmp_path, batch_invariant=True, attention_backend="torch")


PROMPT = [(13 * i) % 250 + 3 for i in range(21)]
OTHERS = [[(7 * i + j) % 250 + 3 for i in range(5 + 9 * j)] for j in range(4)]
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)


def recorded_engine(model_dir, **overrides) -> tuple[LLMEngine, LogitsRecorder]:
    settings = {"num_kv_blocks": 128, "max_num_batched_tokens": 64, "max_num_seqs": 8}
    settings["dtype"] = "float32"  # the fp32 kernel; test_linear_dot_kernels covers bf16
    engine = LLMEngine(
        EngineConfig(model_dir=model_dir, batch_invariant=True, **(settings | overrides))
    )
    return engine, LogitsRecorder(engine)


def rows_of(recorder: LogitsRecorder, prompt: list[int]) -> dict[int, torch.Tensor]:
    return {pos: row for (p, pos), row in recorder.rows.items() if p == tuple(prompt)}


NUMERICS = [
    pytest.param({}, id="fp32"),
    pytest.param({"dtype": "bfloat16"}, id="bf16"),
    pytest.param(
        {"quantization": "w8a8"},
        id="w8a8",
        marks=pytest.mark.skipif(
            native.load() is None or not native.load().int8_dot_product_kernel(),
            reason="w8a8 needs the AVX512-VNNI kernel",
        ),
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("numerics", NUMERICS)
def test_logits_and_seeded_tokens_do_not_depend_on_batch_chunking_or_resume(
    tiny_model_dir, numerics
):
    # Alone: a prefill, then one decode row per step.
    engine, recorder = recorded_engine(tiny_model_dir, **numerics)
    engine.add_request("r", PROMPT, SEEDED)
    reference = run_to_completion(engine)["r"]
    reference_rows = rows_of(recorder, PROMPT)
    if not numerics:  # fp32: the logits are transformers' too
        hf = hf_logits(tiny_model_dir, PROMPT + reference)
        for pos, row in reference_rows.items():
            assert torch.allclose(row, hf[pos - 1], atol=1e-4), pos

    # Batched with four others, prefills chunked by 16 tokens: decode rows share steps with
    # prefill chunks and a varying number of other decodes.
    engine, recorder = recorded_engine(tiny_model_dir, max_num_batched_tokens=16, **numerics)
    for j, other in enumerate(OTHERS):
        engine.add_request(f"other{j}", other, SEEDED)
    engine.add_request("r", PROMPT, SEEDED)
    assert run_to_completion(engine)["r"] == reference
    batched = rows_of(recorder, PROMPT)
    assert batched.keys() == reference_rows.keys()
    for pos, row in batched.items():
        assert torch.equal(row, reference_rows[pos]), pos

    # Resumed on a fresh engine after k delivered tokens, as after a migration: the prefill
    # recomputes the delivered tokens in one pass of len(PROMPT) + k rows.
    for k in range(1, len(reference)):
        engine, recorder = recorded_engine(tiny_model_dir, **numerics)
        engine.add_request("r", PROMPT, SEEDED, output_token_ids=reference[:k])
        assert reference[:k] + run_to_completion(engine)["r"] == reference, k
        for pos, row in rows_of(recorder, PROMPT).items():
            assert torch.equal(row, reference_rows[pos]), (k, pos)


@pytest.mark.skipif(
    native.load() is None or not native.load().bf16_dot_product_kernel(),
    reason="bf16 rows go to the pair kernels only (AMX or AVX512-BF16)",
)
def test_bf16_rows_from_the_norms_give_the_logits_of_each_matmul_rounding_its_own(
    tiny_model_dir,
):
    """With bf16 pair-packed weights the norms and SiLU·up hand the matmuls bf16 rows
    (DecoderModel.bf16_rows): every logit bitwise as when each matmul rounds fp32 rows."""
    rows = {}
    for bf16_rows in (True, False):
        engine, recorder = recorded_engine(tiny_model_dir, dtype="bfloat16")
        assert engine.runner.model.bf16_rows
        engine.runner.model.bf16_rows = bf16_rows
        engine.runner.model.native_layers = None  # the Python layer, which reads bf16_rows
        for j, other in enumerate(OTHERS):
            engine.add_request(f"other{j}", other, SEEDED)
        engine.add_request("r", PROMPT, SEEDED)
        run_to_completion(engine)
        rows[bf16_rows] = rows_of(recorder, PROMPT)
    assert rows[True] and rows[True].keys() == rows[False].keys()
    for pos, row in rows[True].items():
        assert torch.equal(row, rows[False][pos]), pos


@pytest.mark.skipif(
    native.load() is None or not native.load().bf16_dot_product_kernel(),
    reason="the layers run as one native call with bf16 pair-packed weights only",
)
def test_layers_as_one_native_call_give_the_python_layers_logits(tiny_model_dir):
    """model/native_layer.py: the same kernels in the same order, so every logit of a run with
    prefill chunks beside decodes (and the last layer's kept rows) is bitwise the Python
    layer's, and so are the seeded tokens."""
    rows, tokens = {}, {}
    for native_layers in (True, False):
        engine, recorder = recorded_engine(
            tiny_model_dir, dtype="bfloat16", max_num_batched_tokens=16
        )
        assert engine.runner.model.native_layers is not None
        if not native_layers:
            engine.runner.model.native_layers = None
        for j, other in enumerate(OTHERS):
            engine.add_request(f"other{j}", other, SEEDED)
        engine.add_request("r", PROMPT, SEEDED)
        tokens[native_layers] = run_to_completion(engine)
        rows[native_layers] = recorder.rows
    assert tokens[True] == tokens[False]
    assert rows[True] and rows[True].keys() == rows[False].keys()
    for key, row in rows[True].items():
        assert torch.equal(row, rows[False][key]), key
