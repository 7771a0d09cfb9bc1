"""`loadtest/engine_bench/machine_share.py`: a model's work per token, and benchmark figures as
shares of the machine's measured multiply-add peak and memory bandwidth."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from loadtest.engine_bench.machine_share import (
    MachinePeaks,
    ModelWork,
    ServerFigures,
    all_cores_peak,
    format_shares,
    kept_step_bytes,
    kernel_numerics,
    read_bandwidth,
    shares,
)
from shared.engine import native
from shared.engine.model_config import ModelConfig, cpu_runs_bf16

TINY = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=100,
    hidden_size=8,
    intermediate_size=16,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=2,
    rope_theta=1e4,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    attention_bias=False,
)
MACHINE = MachinePeaks(
    cores=2, numerics="bf16", core_peak_gops=120.0, peak_gops=200.0, read_gb_s=20.0
)


def test_the_work_of_a_token_counts_every_matmul_once():
    work = ModelWork.of(TINY)
    # q 8x8, k and v 8x4 each, o 8x8, gate/up/down 3 x 8x16: 320 a layer
    assert work.layer_macs == 2 * (64 + 2 * 32 + 64 + 3 * 128)
    assert work.head_macs == 100 * 8
    assert work.attention_macs_per_context == 2 * 2 * 8  # QK and PV, 2 layers, 4 heads x 2
    assert work.kv_bytes_per_token == 2 * 2 * 4 * 2  # K and V, 2 layers, 2 heads x 2, bf16


def test_an_fp32_server_reads_twice_the_bytes_of_a_bf16_one():
    bf16, fp32 = ModelWork.of(TINY), ModelWork.of(TINY, bytes_per_value=4)
    assert fp32.kv_bytes_per_token == 2 * bf16.kv_bytes_per_token
    assert fp32.decode_step_bytes(context=7) == 2 * bf16.decode_step_bytes(context=7)
    assert fp32.layer_macs == bf16.layer_macs  # the same work, more bytes


def test_our_mesh_is_counted_in_the_dtype_its_flags_or_this_cpu_give():
    from loadtest.peers.run import _bytes_per_value

    auto = 2 if cpu_runs_bf16() else 4
    assert _bytes_per_value("splitserve", ()) == auto
    assert _bytes_per_value("splitserve", ("--dtype", "float32")) == 4
    assert _bytes_per_value("splitserve", ("--prefill", "2", "--dtype=bfloat16")) == 2
    assert _bytes_per_value("vllm", ("--dtype", "float32")) == 2  # our flags are not vLLM's


def test_a_moe_layer_counts_the_experts_a_token_is_routed_to():
    moe = dataclasses.replace(TINY, num_experts=8, num_experts_per_tok=2, moe_layers=(True, False))
    dense, routed = ModelWork.of(TINY), ModelWork.of(moe)
    assert routed.layer_macs - dense.layer_macs == 3 * 128 + 8 * 8  # one more expert + router


def test_ops_per_output_token_add_the_prefill_to_the_decode():
    work = ModelWork(layer_macs=10, head_macs=5, attention_macs_per_context=1, kv_bytes_per_token=0)
    # prefill 4 tokens: 40 + attention 4^2 / 2; one decode step at a mean context of 5: 15;
    # the head for both output tokens: 10
    assert work.ops_per_output_token(4, 2) == 2 * (40 + 8 + 15 + 10) / 2
    assert work.decode_step_bytes(context=3) == 15 * 2


def test_shares_state_each_figure_against_the_machine():
    work = ModelWork(
        layer_macs=0, head_macs=10**9, attention_macs_per_context=0, kv_bytes_per_token=0
    )
    figures = ServerFigures(prompt_len=0, output_len=1, output_tok_s=50.0, tpot_ms=200.0)
    got = shares(figures, work, MACHINE)
    assert got["serve_gops"] == pytest.approx(100.0)  # 50 tok/s x 2 Gop a token
    assert got["serve_of_peak"] == pytest.approx(0.5)
    assert got["decode_gb_s"] == pytest.approx(10.0)  # 2 GB of bf16 weights in 0.2 s
    assert got["decode_of_bandwidth"] == pytest.approx(0.5)
    assert "offline_gops" not in got  # no offline figure given
    offline = ServerFigures(prompt_len=0, output_len=1, offline_tok_s=25.0, offline_lens=(0, 1))
    assert shares(offline, work, MACHINE) == pytest.approx(
        {"offline_gops": 50.0, "offline_of_peak": 0.25}
    )


def test_the_table_leaves_out_a_figure_no_server_has():
    table = format_shares(
        {"splitserve": {"serve_gops": 100.0, "serve_of_peak": 0.5}, "vllm": {}}, MACHINE, (1, 16)
    )
    assert "120 Gop/s on one core alone, 200 on all 2 at once" in table and "20.0 GB/s" in table
    assert "| c=16 output tok/s as multiply-adds (of the peak) | 100.0 Gop/s (50%) | - |" in table
    assert "TPOT" not in table and "offline" not in table


@pytest.mark.skipif(native.load() is None, reason="no native kernels")
def test_the_machine_is_measured_and_torch_threads_are_restored():
    threads = torch.get_num_threads()
    machine = MachinePeaks.measure(cores=1, buffer_bytes=64 << 20)
    assert machine is not None and machine.core_peak_gops > 1 and machine.read_gb_s > 0.1
    assert machine.numerics in ("amx_bf16", "bf16", "fp32") and machine.peak_gops > 1
    assert torch.get_num_threads() == threads
    assert read_bandwidth(1, 16 << 20, passes=1) > 0.1


def test_the_peak_of_all_cores_is_their_rates_measured_at_once():
    """Every core's measurement runs while the others' do, and the machine's peak is the sum
    of what each got: here 3 cores share one unit, so 100 in all, not 3 x 100."""
    running, lock = [0], threading.Lock()

    def shared_unit(numerics: str, iterations: int) -> float:
        with lock:
            running[0] += 1
        time.sleep(0.1)  # the others start meanwhile
        sharing = running[0]
        time.sleep(0.1)
        with lock:
            running[0] -= 1
        return 100.0 / sharing

    assert all_cores_peak(shared_unit, "bf16", 3) == pytest.approx(100.0)


@pytest.mark.parametrize(
    ("amx", "dot_products", "expected"),
    [("on", True, "amx_bf16"), ("refused", True, "bf16"), ("absent", True, "bf16"),
     ("absent", False, "fp32")],
)  # fmt: skip
def test_bf16_weights_are_held_to_the_instruction_that_runs_them(amx, dot_products, expected):
    class Kernels:  # a build's answers about itself
        def amx_tiles(self) -> str:
            return amx

        def bf16_dot_product_kernel(self) -> bool:
            return dot_products

    assert kernel_numerics(Kernels(), "bf16") == expected
    assert kernel_numerics(Kernels(), "int8") == ("amx_int8" if amx == "on" else "int8")
    assert kernel_numerics(Kernels(), "fp32") == "fp32"


def test_a_kept_checkpoint_step_reads_its_files_bytes_but_the_embedding(tmp_path):
    """The decode step's weights as a kept-quantized file holds them: every tensor's bytes
    but the embedding table's, read a row at a time, where the head is a tensor of its own;
    the work's step bytes take them in place of the dtype's."""
    tensors = {
        "model.embed_tokens.weight.low": torch.zeros(100, 4, dtype=torch.uint8),
        "model.layers.0.mlp.down_proj.weight.low": torch.zeros(8, 8, dtype=torch.uint8),
        "model.layers.0.mlp.down_proj.weight.super_scale": torch.zeros(8, 1),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    tied = 400 + 64 + 32  # the embedding is the head: read whole
    assert kept_step_bytes(tmp_path) == tied
    save_file(
        {**tensors, "lm_head.weight.low": torch.zeros(100, 4, dtype=torch.uint8)},
        tmp_path / "model.safetensors",
    )
    assert kept_step_bytes(tmp_path) == 64 + 32 + 400
    work = ModelWork.of(TINY, weight_bytes=496)
    assert work.decode_step_bytes(context=0) == 496
