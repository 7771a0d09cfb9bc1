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
}

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
    """The hyper-parameters a Llama-family decoder needs, read from GGUF metadata."""

    arch: str  # GGUF architecture: "llama" | "qwen2"
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
    if rope_dim != head_dim:
        raise GGUFConvertError(f"partial rotary ({rope_dim} of {head_dim} dims) is not supported")
    # GGUF shapes are innermost-first: token_embd.weight is [hidden, vocab].
    vocab_size = int(tensors["token_embd.weight"].shape[1])
    return HParams(
        arch=arch,
        hidden_size=hidden,
        intermediate_size=field(reader, f"{arch}.feed_forward_length"),
        num_layers=field(reader, f"{arch}.block_count"),
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
    )


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    """HF `rope_scaling` from `{arch}.rope.scaling.*`, or None when the model has none."""
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
    if hp.arch == "llama":
        config["attention_bias"] = False
        config["mlp_bias"] = False
    else:
        config["use_sliding_window"] = False  # qwen2 always has q/k/v biases
    if hp.rope_scaling is not None:
        config["rope_scaling"] = hp.rope_scaling
    return config
