"""GGUF conversion of the newer families (qwen3, qwen3moe, gemma2, gemma3, phi3): a tiny
transformers checkpoint is written as llama.cpp's converter writes it (its tensor names,
Gemma's norms with 1 added, stacked experts, Phi-3's LongRoPE factor tensors), converted
back, and served by the engine with transformers' logits (≤ 1e-4, F32 tensors)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from safetensors.numpy import load_file

from shared.engine import native
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.model.checkpoint import Checkpoint
from shared.engine.model.group_quant import GroupQuantLinear
from shared.engine.sampling_params import SamplingParams
from shared.models.gguf_convert import convert_gguf
from tests.engine_harness import (
    LogitsRecorder,
    assert_same_bits_beside_others,
    greedy_logits,
    hf_logits,
    run_to_completion,
)
from tests.hf_tiny_models import write_hf_model
from tests.kquant_writer import quantize_k
from tests.unit.test_gguf_convert import CONTROL, MERGES, TEMPLATE, vocabulary

HEAD_DIM = 16
# family of tests/hf_tiny_models.py -> (GGUF arch, overrides matching llama.cpp's conventions)
CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3-moe": ("qwen3moe", {}),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": HEAD_DIM}),
    "gemma3": (
        "gemma3",
        {
            "query_pre_attn_scalar": HEAD_DIM,
            "layer_types": ["sliding_attention", "sliding_attention"],  # llama.cpp's 5:1, 2 layers
        },
    ),
    "phi3-longrope": ("phi3", {}),
}
GGUF_PARTS = {  # HF layer part -> llama.cpp's
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def write_llama_cpp_gguf(
    model_dir: Path,
    path: Path,
    arch: str,
    experts_as: GGMLQuantizationType | None = None,
    matrices_as: dict[str, GGMLQuantizationType] | None = None,
) -> None:
    """experts_as: the MoE expert stacks quantized by gguf-py as that type (else F32);
    matrices_as: llama.cpp's layer part (e.g. "ffn_down") -> the k-quant its matrices are
    stored as, by our writer (tests/kquant_writer.py)."""
    import json

    config = json.loads((model_dir / "config.json").read_text())
    state = load_file(str(model_dir / "model.safetensors"))
    gemma = arch.startswith("gemma")
    writer = GGUFWriter(path, arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_dimension_count(int(HEAD_DIM * config.get("partial_rotary_factor", 1.0)))
    rope = config["rope_parameters"]
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch == "qwen3moe":
        writer.add_uint32(f"{arch}.expert_count", config["num_local_experts"])
        writer.add_uint32(f"{arch}.expert_used_count", config["num_experts_per_tok"])
        writer.add_uint32(f"{arch}.expert_feed_forward_length", config["moe_intermediate_size"])
    if config.get("sliding_window"):
        writer.add_uint32(f"{arch}.attention.sliding_window", config["sliding_window"])
    if arch == "gemma2":
        writer.add_float32(f"{arch}.attn_logit_softcapping", config["attn_logit_softcapping"])
        writer.add_float32(f"{arch}.final_logit_softcapping", config["final_logit_softcapping"])
    if arch == "phi3":
        original = config["original_max_position_embeddings"]
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", original)
        for kind in ("long", "short"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    vocab = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(vocab)
    writer.add_token_types(
        [TokenType.CONTROL] * len(CONTROL) + [TokenType.NORMAL] * (len(vocab) - 3)
    )
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(TEMPLATE)
    experts: dict[tuple[str, str], list[np.ndarray]] = {}
    for name, w in sorted(state.items()):
        if gemma and name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp stores Gemma's norms as 1 + w
        if name == "model.embed_tokens.weight":
            gguf = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf = "output.weight"
        else:
            layer, part = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
            if ".experts." in part:
                e, proj = part.removeprefix("mlp.experts.").split(".")
                experts.setdefault((layer, proj), []).append((int(e), w))
                continue
            if part == "post_attention_layernorm":
                gguf_part = "post_attention_norm" if gemma else "ffn_norm"
            else:
                gguf_part = GGUF_PARTS[part]
            gguf = f"blk.{layer}.{gguf_part}.weight"
            if gguf_part in (matrices_as or {}):
                qtype = matrices_as[gguf_part]
                writer.add_tensor(gguf, quantize_k(w, qtype), raw_dtype=qtype)
                continue
        writer.add_tensor(gguf, np.ascontiguousarray(w))
    for (layer, proj), parts in experts.items():
        stacked = np.stack([w for _, w in sorted(parts, key=lambda p: p[0])])  # [E, out, in]
        name = f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight"
        if experts_as is None:
            writer.add_tensor(name, stacked)
        else:
            writer.add_tensor(name, quantize(stacked, experts_as), raw_dtype=experts_as)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CASES))
def test_converted_gguf_serves_transformers_logits(tmp_path, family):
    arch, overrides = CASES[family]
    hf_dir = write_hf_model(tmp_path / "hf", family, vocab_size=288, **overrides)
    write_llama_cpp_gguf(hf_dir, tmp_path / "model.gguf", arch)
    converted = tmp_path / "converted"
    convert_gguf(tmp_path / "model.gguf", converted)
    engine = LLMEngine(
        EngineConfig(
            model_dir=converted, dtype="float32", num_kv_blocks=32, attention_backend="torch"
        )
    )
    recorder = LogitsRecorder(engine)
    prompt = [(7 * i) % 280 + 3 for i in range(30)]  # past the sliding window of 20
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    tokens = run_to_completion(engine)["r"]
    reference = hf_logits(hf_dir, prompt + tokens)
    for position in range(len(prompt), len(prompt) + len(tokens)):
        error = (recorder.rows[(tuple(prompt), position)] - reference[position - 1]).abs().max()
        assert error <= 1e-4, (family, position, float(error))


@pytest.mark.slow
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0])
def test_moe_experts_kept_quantized_give_the_float_conversions_logits(tmp_path, qtype):
    """Qwen3-MoE with its expert stacks quantized: kept (one quantized matrix per expert) and
    dequantized at conversion, the same weights and, through the engine, the same logits up
    to the order of sums; batch-invariant on the kernels."""
    hf_dir = write_hf_model(tmp_path / "hf", "qwen3-moe", vocab_size=288)
    write_llama_cpp_gguf(hf_dir, tmp_path / "model.gguf", "qwen3moe", experts_as=qtype)
    convert_gguf(tmp_path / "model.gguf", tmp_path / "kept", keep_quant=True)
    convert_gguf(tmp_path / "model.gguf", tmp_path / "float")
    kept = Checkpoint(tmp_path / "kept", torch.float32, torch.device("cpu"))
    assert kept.quantized_formats == [qtype.name]
    floats = load_file(str(tmp_path / "float" / "model.safetensors"))
    for name in sorted(kept.quantized):
        assert ".mlp.experts." in name, name
        w = kept.take_linear(name)
        assert isinstance(w, GroupQuantLinear), name
        assert torch.equal(w.dequantize(), torch.from_numpy(floats[name])), name
    prompt = [(7 * i) % 280 + 3 for i in range(30)]
    exact = {"dtype": "float32", "group_quant_activations": "float"}  # auto: int8 for GGUF
    ours = greedy_logits(tmp_path / "kept", prompt, 3, **exact)
    reference = greedy_logits(tmp_path / "float", prompt, 3, dtype="float32")
    torch.testing.assert_close(ours, reference, rtol=0, atol=5e-5)
    if native.load() is not None:
        assert_same_bits_beside_others(tmp_path / "kept", prompt)
        int8 = greedy_logits(
            tmp_path / "kept", prompt, 1, dtype="float32", group_quant_activations="int8"
        )  # the experts' gate_up (K 64) on the int8 kernel: near, not equal
        difference = float((int8[0] - reference[0]).norm() / reference[0].norm())
        assert 0 < difference < 0.1


Q = GGMLQuantizationType
# llama.cpp's mixes, simplified: most matrices one k-quant, ffn_down a wider one; the bounds
# of the stored weights against the original ones (relative L2, round to nearest)
MIXES = {
    "Q4_K_M": (Q.Q4_K, Q.Q6_K, 0.08, 0.025),
    "Q3_K_M": (Q.Q3_K, Q.Q5_K, 0.2, 0.04),
    "Q2_K": (Q.Q2_K, Q.Q3_K, 0.35, 0.2),
}


@pytest.mark.slow
@pytest.mark.parametrize("mix", list(MIXES))
def test_a_k_quant_model_kept_gives_the_float_conversions_logits(tmp_path, mix):
    """A Qwen3 GGUF in a k-quant mix, written by our k-quant writer (tests/kquant_writer.py):
    kept, its logits are those of its float conversion up to the order of sums, its stored
    weights within the formats' bounds of the original ones, and with int8 activations (the
    VNNI path, or the AMX tiles where they run) near."""
    body, wide, body_bound, wide_bound = MIXES[mix]
    hf_dir = write_hf_model(
        tmp_path / "hf", "qwen3", vocab_size=288, hidden_size=256, intermediate_size=256,
        num_attention_heads=16, num_key_value_heads=4,
    )  # fmt: skip
    parts = {p: body for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")}
    mixed = parts | {"ffn_down": wide}
    write_llama_cpp_gguf(hf_dir, tmp_path / "m.gguf", "qwen3", matrices_as=mixed)
    convert_gguf(tmp_path / "m.gguf", tmp_path / "kept", keep_quant=True)
    convert_gguf(tmp_path / "m.gguf", tmp_path / "float")
    kept = Checkpoint(tmp_path / "kept", torch.float32, torch.device("cpu"))
    assert kept.quantized_formats == sorted([body.name, wide.name])
    stored, original = (
        load_file(str(d / "model.safetensors")) for d in (tmp_path / "float", hf_dir)
    )
    for kind, bound in (("down_proj", wide_bound), ("q_proj", body_bound)):
        names = [n for n in original if n.endswith(f"{kind}.weight")]
        error = np.linalg.norm([np.linalg.norm(stored[n] - original[n]) for n in names])
        assert error / np.linalg.norm([np.linalg.norm(original[n]) for n in names]) < bound
    prompt = [(7 * i) % 280 + 3 for i in range(30)]
    exact = {"dtype": "float32", "group_quant_activations": "float"}  # auto: int8 for GGUF
    ours = greedy_logits(tmp_path / "kept", prompt, 3, **exact)
    reference = greedy_logits(tmp_path / "float", prompt, 3, dtype="float32")
    torch.testing.assert_close(ours, reference, rtol=0, atol=5e-5)
    kernels = native.load()
    if kernels is not None and kernels.int8_dot_product_kernel():
        int8 = greedy_logits(
            tmp_path / "kept", prompt, 1, dtype="float32", group_quant_activations="int8"
        )
        difference = float((int8[0] - reference[0]).norm() / reference[0].norm())
        assert 0 < difference < 0.1, difference
