"""Reading GGUF metadata: typed key/value access and the model's hyper-parameters.

GGUF keys of the model itself are prefixed by the architecture (`llama.block_count`,
`qwen2.attention.head_count`, ...); tokenizer keys live under `tokenizer.ggml.*` and
`tokenizer.chat_template`. This module turns them into `HParams` and `config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import GGUFReader, GGUFValueType

# GGUF architecture -> (HF `architectures[0]`, HF `model_type`)
SUPPORTED_ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
}
GEMMA = ("gemma2", "gemma3")
# llama.cpp's Gemma 3 alternates five sliding-window layers and one global layer
GEMMA3_SLIDING_PATTERN = 6
# llama.cpp scales Gemma's 27B queries by hidden / heads, the others by head_dim (by depth)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

_MISSING = object()


class GGUFConvertError(ValueError):
    """The GGUF file uses something this converter does not handle, or is malformed."""


def field(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """The value of metadata `key`: str, int, float, bool, or a list of those.

    Reads `ReaderField.parts` directly (each array element is its own part, indexed by
    `field.data`) so that it works on every gguf release we allow, also those without
    `ReaderField.contents()`.
    """
    f = reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            raise GGUFConvertError(f"GGUF metadata key {key!r} is missing")
        return default
    kind = f.types[0]
    if kind == GGUFValueType.ARRAY:
        if f.types[-1] == GGUFValueType.STRING:
            return [f.parts[i].tobytes().decode("utf-8") for i in f.data]
        return [f.parts[i][0].item() for i in f.data]
    if kind == GGUFValueType.STRING:
        return f.parts[f.data[0]].tobytes().decode("utf-8")
    value = f.parts[f.data[0]][0]
    if kind == GGUFValueType.FLOAT32:
        # The shortest decimal that rounds to this float32: 1e-05, not 9.999999747378752e-06.
        return float(str(value))
    return value.item()


@dataclass(frozen=True, slots=True)
class HParams:
    """The hyper-parameters a decoder needs, read from GGUF metadata."""

    arch: str  # GGUF architecture: a key of SUPPORTED_ARCHS
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # rows of token_embd.weight
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool  # no output.weight in the file: lm_head shares the embedding
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    rope_scaling: dict[str, Any] | None
    rope_dim: int = 0  # rotated dims of a head (Phi-4-mini: fewer than head_dim)
    # config.json entries of the architecture alone (experts, Gemma's norms and windows)
    extra: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise GGUFConvertError(
                f"{self.num_heads} attention heads are not a multiple of "
                f"{self.num_kv_heads} KV heads"
            )
        if self.head_dim % 2:
            raise GGUFConvertError(f"head_dim {self.head_dim} must be even for rotary embeddings")


def read_hparams(reader: GGUFReader) -> HParams:
    """The model's hyper-parameters; raises GGUFConvertError for what we cannot convert."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFConvertError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHS)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        # Llama 3.1+ stores its rope scaling as per-dimension factors, not as parameters.
        raise GGUFConvertError("rope_freqs.weight (Llama 3 rope scaling) is not supported")
    hidden = field(reader, f"{arch}.embedding_length")
    heads = field(reader, f"{arch}.attention.head_count")
    head_dim = field(reader, f"{arch}.attention.key_length", hidden // heads)
    rope_dim = field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim and arch != "phi3":
        raise GGUFConvertError(f"partial rotary ({rope_dim} of {head_dim} dims) is not supported")
    # GGUF shapes are innermost-first: token_embd.weight is [hidden, vocab].
    vocab_size = int(tensors["token_embd.weight"].shape[1])
    num_layers = field(reader, f"{arch}.block_count")
    return HParams(
        arch=arch,
        hidden_size=hidden,
        intermediate_size=field(reader, f"{arch}.feed_forward_length", 0),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=field(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        vocab_size=vocab_size,
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=field(reader, f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=field(reader, "tokenizer.ggml.eos_token_id", None),
        pad_token_id=field(reader, "tokenizer.ggml.padding_token_id", None),
        rope_scaling=_rope_scaling(reader, arch),
        rope_dim=rope_dim,
        extra=_extra_config(reader, arch, hidden, heads, head_dim, num_layers),
    )


def _extra_config(
    reader: GGUFReader, arch: str, hidden: int, heads: int, head_dim: int, num_layers: int
) -> dict[str, Any]:
    """What an architecture adds to config.json, from its `{arch}.*` keys."""
    if arch == "qwen3moe":
        return {
            "num_experts": field(reader, f"{arch}.expert_count"),
            "num_experts_per_tok": field(reader, f"{arch}.expert_used_count"),
            "moe_intermediate_size": field(reader, f"{arch}.expert_feed_forward_length"),
            "norm_topk_prob": True,  # llama.cpp renormalises qwen3moe's top-k weights
        }
    if arch in GEMMA:
        window = field(reader, f"{arch}.attention.sliding_window")
        if arch == "gemma2":  # even layers slide
            types = [
                "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
            ]
        else:
            pattern = GEMMA3_SLIDING_PATTERN
            types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(num_layers)
            ]
        scalar = hidden // heads if num_layers == GEMMA_27B_LAYERS[arch] else head_dim
        extra: dict[str, Any] = {
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": window,
            "layer_types": types,
            "query_pre_attn_scalar": scalar,
        }
        if arch == "gemma2":
            extra["attn_logit_softcapping"] = field(reader, f"{arch}.attn_logit_softcapping", None)
            extra["final_logit_softcapping"] = field(
                reader, f"{arch}.final_logit_softcapping", None
            )
        else:
            extra["rope_local_base_freq"] = 10000.0  # llama.cpp's fixed base of the sliding layers
        return extra
    if arch == "phi3":
        window = field(reader, f"{arch}.attention.sliding_window", None)
        return {"sliding_window": window or None}
    return {}


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    """HF `rope_scaling` from `{arch}.rope.scaling.*` (Phi-3's LongRoPE: its factor tensors),
    or None when the model has none."""
    tensors = {t.name: t for t in reader.tensors}
    if "rope_factors_long.weight" in tensors:
        original = field(reader, f"{arch}.rope.scaling.original_context_length")
        scaling = {
            "rope_type": "longrope",
            "long_factor": [float(x) for x in tensors["rope_factors_long.weight"].data],
            "short_factor": [float(x) for x in tensors["rope_factors_short.weight"].data],
            "original_max_position_embeddings": original,
        }
        attn_factor = field(reader, f"{arch}.rope.scaling.attn_factor", None)
        if attn_factor is not None:
            scaling["attention_factor"] = float(attn_factor)
        return scaling
    kind = field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = float(field(reader, f"{arch}.rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = field(reader, f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise GGUFConvertError(f"unsupported rope scaling type {kind!r}")


def hf_config(hp: HParams) -> dict[str, Any]:
    """The `config.json` of the converted model (weights are written as float32)."""
    architecture, model_type = SUPPORTED_ARCHS[hp.arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hp.hidden_size,
        "intermediate_size": hp.intermediate_size,
        "num_hidden_layers": hp.num_layers,
        "num_attention_heads": hp.num_heads,
        "num_key_value_heads": hp.num_kv_heads,
        "head_dim": hp.head_dim,
        "vocab_size": hp.vocab_size,
        "hidden_act": "silu",
        "rope_theta": hp.rope_theta,
        "rms_norm_eps": hp.rms_norm_eps,
        "max_position_embeddings": hp.max_position_embeddings,
        "tie_word_embeddings": hp.tie_word_embeddings,
        "bos_token_id": hp.bos_token_id,
        "eos_token_id": hp.eos_token_id,
        "torch_dtype": "float32",
    }
    if hp.pad_token_id is not None:
        config["pad_token_id"] = hp.pad_token_id
    if hp.arch in ("llama", "qwen3", "qwen3moe", "phi3") or hp.arch in GEMMA:
        config["attention_bias"] = False
        config["mlp_bias"] = False
    if hp.arch.startswith("qwen"):
        config["use_sliding_window"] = False  # qwen2 always has q/k/v biases
    if hp.arch in GEMMA:
        config["hidden_act"] = "gelu_pytorch_tanh"
    if hp.rope_dim and hp.rope_dim != hp.head_dim:
        config["partial_rotary_factor"] = hp.rope_dim / hp.head_dim
    if hp.rope_scaling is not None:
        config["rope_scaling"] = hp.rope_scaling
        if hp.rope_scaling["rope_type"] == "longrope":  # Phi-3 keeps it beside, too
            original = hp.rope_scaling["original_max_position_embeddings"]
            config["original_max_position_embeddings"] = original
    config.update(hp.extra or {})
    return config
