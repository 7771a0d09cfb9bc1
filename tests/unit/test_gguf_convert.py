"""GGUF -> HF conversion on tiny GGUF files written here with gguf.GGUFWriter.

The files mimic llama.cpp's converter: Q/K rows permuted for llama (not for qwen2),
quantized tensors (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), a byte-level BPE vocabulary with merges
and control tokens. Conversion to float32 (keep_quant=False) must give back the original
weights under HF names; test_gguf_keep_quant.py converts the same files keeping quantization.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from safetensors.numpy import load_file
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from shared.models.gguf_convert import MODEL_FILES, GGUFConvertError, convert_gguf
from shared.models.gguf_tensors import unpermute_rope

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, CONTEXT = 64, 4, 2, 16, 96, 2, 256
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ c", "a t", "Ġc at"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)

# GGUF tensor -> the type it is stored as; the rest are F32.
STORED_AS = {
    "token_embd.weight": GGMLQuantizationType.F16,
    "blk.0.attn_q.weight": GGMLQuantizationType.Q8_0,
    "blk.0.attn_k.weight": GGMLQuantizationType.Q8_0,
    "blk.0.ffn_up.weight": GGMLQuantizationType.BF16,
    "blk.1.ffn_gate.weight": GGMLQuantizationType.Q4_0,
    "blk.1.ffn_down.weight": GGMLQuantizationType.Q4_1,
    "blk.1.attn_v.weight": GGMLQuantizationType.Q5_0,
    "blk.1.attn_output.weight": GGMLQuantizationType.Q5_1,
}
# Worst-case absolute error of each type on N(0, 0.02) weights.
TOLERANCE = {
    GGMLQuantizationType.F32: 0.0,
    GGMLQuantizationType.F16: 1e-4,
    GGMLQuantizationType.BF16: 1e-3,
    GGMLQuantizationType.Q8_0: 1e-3,
    GGMLQuantizationType.Q4_0: 0.02,
    GGMLQuantizationType.Q4_1: 0.02,
    GGMLQuantizationType.Q5_0: 0.01,
    GGMLQuantizationType.Q5_1: 0.01,
}
HF_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def vocabulary() -> list[str]:
    """Control tokens, the 256 byte-level symbols, then one token per merge."""
    return CONTROL + sorted(ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES]


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py on llama Q/K: [H, 2, d/2, in] -> [H, d/2, 2, in]."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@dataclass
class TinyModel:
    path: Path  # the .gguf file
    hf_weights: dict[str, np.ndarray]  # HF name -> the original (un-permuted) weight
    stored_as: dict[str, GGMLQuantizationType]  # HF name -> its GGUF type


def write_tiny_gguf(
    path: Path, arch: str = "llama", tied: bool = True, pre: str | None = None
) -> TinyModel:
    """A 2-layer model; `pre` defaults to the arch's usual pre-tokenizer."""
    rng = np.random.default_rng(0)
    vocab = vocabulary()
    shapes = {  # GGUF part -> HF [out, in] shape
        "attn_norm": (HIDDEN,),
        "ffn_norm": (HIDDEN,),
        "attn_q": (HEADS * HEAD_DIM, HIDDEN),
        "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, HEADS * HEAD_DIM),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    tensors = {  # GGUF name -> (HF name, original weight)
        "token_embd.weight": ("model.embed_tokens.weight", (len(vocab), HIDDEN)),
        "output_norm.weight": ("model.norm.weight", (HIDDEN,)),
    }
    if not tied:
        tensors["output.weight"] = ("lm_head.weight", (len(vocab), HIDDEN))
    for i in range(LAYERS):
        for part, shape in shapes.items():
            tensors[f"blk.{i}.{part}.weight"] = (f"model.layers.{i}.{HF_PARTS[part]}.weight", shape)
        if arch == "qwen2":
            for part in ("attn_q", "attn_k", "attn_v"):
                hf = f"model.layers.{i}.{HF_PARTS[part]}.bias"
                tensors[f"blk.{i}.{part}.bias"] = (hf, shapes[part][:1])

    writer = GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or {"llama": "smollm", "qwen2": "qwen2"}[arch])
    writer.add_token_list(vocab)
    writer.add_token_types(
        [TokenType.CONTROL] * len(CONTROL) + [TokenType.NORMAL] * (len(vocab) - 3)
    )
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)

    model = TinyModel(path, {}, {})
    for name, (hf_name, shape) in tensors.items():
        w = rng.normal(0.0, 0.02, size=shape).astype(np.float32)
        model.hf_weights[hf_name] = w
        if arch == "llama" and ".attn_q." in name:
            w = llama_cpp_permute(w, HEADS)
        elif arch == "llama" and ".attn_k." in name:
            w = llama_cpp_permute(w, KV_HEADS)
        qtype = STORED_AS.get(name, GGMLQuantizationType.F32)
        model.stored_as[hf_name] = qtype
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            writer.add_tensor(name, quantize(w, qtype))
        else:
            writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp(request.param)
    model = write_tiny_gguf(root / "tiny.gguf", arch=request.param)
    convert_gguf(model.path, root / "hf", keep_quant=False)  # every tensor float32
    return request.param, model, root / "hf"


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_writes_every_model_file(converted) -> None:
    _, _, out = converted
    assert sorted(p.name for p in out.iterdir()) == sorted(MODEL_FILES)


def test_config_matches_gguf_metadata(converted) -> None:
    arch, _, out = converted
    config = read_json(out / "config.json")
    assert config["architectures"] == [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    ]
    assert config["model_type"] == arch
    assert {k: config[k] for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size", "rope_theta", "rms_norm_eps",
        "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
        "torch_dtype",
    )} == {
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "vocab_size": len(vocabulary()), "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": CONTEXT, "tie_word_embeddings": True, "bos_token_id": 1,
        "eos_token_id": 2, "torch_dtype": "float32",
    }  # fmt: skip
    assert "rope_scaling" not in config
    assert read_json(out / "generation_config.json") == {"bos_token_id": 1, "eos_token_id": 2}


def test_tensors_come_back_unpermuted_under_hf_names(converted) -> None:
    _, model, out = converted
    state = load_file(out / "model.safetensors")
    assert sorted(state) == sorted(model.hf_weights)
    assert "lm_head.weight" not in state  # tied
    for name, original in model.hf_weights.items():
        got = state[name]
        assert got.dtype == np.float32 and got.shape == original.shape, name
        tol = TOLERANCE[model.stored_as[name]]
        np.testing.assert_allclose(got, original, rtol=0, atol=tol, err_msg=name)
    # Q/K stored as Q8_0 also come back in HF order: far closer to the original than to
    # the permuted layout.
    q = state["model.layers.0.self_attn.q_proj.weight"]
    assert np.abs(q - model.hf_weights["model.layers.0.self_attn.q_proj.weight"]).max() < 1e-3


def test_untied_model_gets_lm_head(tmp_path: Path) -> None:
    model = write_tiny_gguf(tmp_path / "untied.gguf", tied=False)
    convert_gguf(model.path, tmp_path / "hf")
    assert read_json(tmp_path / "hf" / "config.json")["tie_word_embeddings"] is False
    lm_head = load_file(tmp_path / "hf" / "model.safetensors")["lm_head.weight"]
    np.testing.assert_array_equal(lm_head, model.hf_weights["lm_head.weight"])


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(KV_HEADS * HEAD_DIM * 3, dtype=np.float32).reshape(KV_HEADS * HEAD_DIM, 3)
    np.testing.assert_array_equal(unpermute_rope(llama_cpp_permute(w, KV_HEADS), KV_HEADS), w)
    bias = np.arange(HEADS * HEAD_DIM, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_rope(llama_cpp_permute(bias, HEADS), HEADS), bias)


def test_tokenizer_round_trips_and_splits_digits(converted) -> None:
    _, _, out = converted
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab = vocabulary()
    text = "<|im_start|> the cat 123 héllo 世界 🙂<|im_end|>"
    enc = tok.encode(text)
    assert enc.ids[0] == 1 and enc.ids[-1] == 2  # control tokens matched whole, no BOS added
    assert [vocab[i] for i in enc.ids[1:5]] == ["Ġthe", "Ġcat", "Ġ", "1"]
    assert [vocab[i] for i in enc.ids[5:7]] == ["2", "3"]  # digits one by one
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert tok.decode(enc.ids) == " the cat 123 héllo 世界 🙂"
    assert tok.get_vocab_size() == len(vocab)


def test_tokenizer_config(converted) -> None:
    _, _, out = converted
    config = read_json(out / "tokenizer_config.json")
    assert config["chat_template"] == TEMPLATE
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert config["add_bos_token"] is False
    assert config["model_max_length"] == CONTEXT


def test_unknown_pre_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    model = write_tiny_gguf(tmp_path / "odd.gguf", pre="mystery")
    with pytest.raises(GGUFConvertError, match=r"tokenizer\.ggml\.pre 'mystery'"):
        convert_gguf(model.path, tmp_path / "hf")


@pytest.mark.slow
def test_transformers_loads_converted_model(converted) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, _, out = converted
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 7]])).logits
    assert logits.shape == (1, 3, len(vocabulary()))
