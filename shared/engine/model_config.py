"""The model's shape and numerics, read from an HF-layout `config.json`.

One dataclass covers every family the engine serves (model/families.py maps each
architecture to its decoder); the fields past the common ones are what a family changes:
q/k norms, Gemma's (1 + w) norms and soft-capping, sliding-window layers, routed experts.
Both config spellings are read: transformers 4's `rope_theta` + `rope_scaling` and
transformers 5's `rope_parameters` (one dict, or one per layer type).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from shared.errors import ConfigError

# architecture → family (the decoder file under shared/engine/model/)
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "MixtralForCausalLM": "moe",
    "Qwen3MoeForCausalLM": "moe",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "Phi3ForCausalLM": "llama",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

log = logging.getLogger(__name__)


class UnsupportedArchitecture(ConfigError):
    """A checkpoint whose architecture the embedded engine does not implement."""


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Decoder hyper-parameters (Llama 2/3, SmolLM, Mistral, Qwen2/3, Mixtral, Qwen3-MoE,
    Gemma 2/3, Phi-3/4)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    # standardized: always has "rope_type" when not empty
    rope_scaling: dict[str, float | str | list[float]] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    rotary_dim: int = 0  # leading dims of each head that rotate (Phi-4-mini: 3/4); 0: all
    qk_norm: bool = False  # RMSNorm over each q and k head before rope (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # silu | gelu_pytorch_tanh (Gemma)
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + w): 1.0
    sandwich_norms: bool = False  # Gemma 2/3: norms on the attention and MLP outputs too
    embed_scale: float = 1.0  # Gemma: sqrt(hidden_size)
    query_scale: float = 0.0  # softmax scale; 0: head_dim ** -0.5
    attn_softcap: float = 0.0  # tanh soft-capping of attention scores (Gemma 2); 0: none
    final_softcap: float = 0.0  # of the logits (Gemma 2); 0: none
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window in tokens, 0 = global
    local_rope_theta: float = 0.0  # sliding layers' own rope base (Gemma 3); 0: the global one
    num_experts: int = 0  # routed experts per MoE layer; 0: dense
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    moe_layers: tuple[bool, ...] = ()  # per layer: routed experts (else a dense MLP)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ConfigError(f"hidden activation {self.hidden_act!r} is not supported")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def family(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def rotated_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def softmax_scale(self) -> float:
        return self.query_scale or self.head_dim**-0.5

    def window_of(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        architecture = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if architecture not in ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"{model_dir}: architecture {architecture} is not served by the embedded "
                f"engine (it serves {', '.join(SUPPORTED_ARCHITECTURES)}); "
                "`--engine vllm` may serve it"
            )
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        theta, scaling, local_theta = _rope(raw)
        num_layers = raw["num_hidden_layers"]
        gemma = ARCHITECTURES[architecture] == "gemma"
        rotary_fraction = float(
            raw.get("partial_rotary_factor") or scaling.pop("partial_rotary_factor", 1.0)
        )
        experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw.get("intermediate_size") or 0,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rope_theta=theta,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
            attention_bias=bool(raw.get("attention_bias", architecture == "Qwen2ForCausalLM")),
            rope_scaling=scaling,
            eos_token_ids=_eos_ids(Path(model_dir), raw),
            rotary_dim=int(head_dim * rotary_fraction) if rotary_fraction < 1 else 0,
            qk_norm=architecture
            in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            embed_scale=math.sqrt(raw["hidden_size"]) if gemma else 1.0,
            query_scale=float(raw["query_pre_attn_scalar"]) ** -0.5 if gemma else 0.0,
            attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(raw.get("final_logit_softcapping") or 0.0),
            layer_windows=_layer_windows(architecture, raw, num_layers),
            local_rope_theta=local_theta,
            num_experts=experts,
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0) if experts else 0,
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            moe_layers=_moe_layers(raw, num_layers) if experts else (),
        )


def _rope(raw: dict) -> tuple[float, dict, float]:
    """(rope base, standardized scaling of the global layers, sliding layers' base or 0)."""
    params = raw.get("rope_parameters")
    local_theta = float(raw.get("rope_local_base_freq") or 0.0)
    if isinstance(params, dict) and "full_attention" in params:  # one dict per layer type
        local = params.get("sliding_attention") or {}
        local_theta = float(local.get("rope_theta") or local_theta)
        params = params["full_attention"]
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type", "rope_type")}
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = {"su": "longrope", "mrope": "default"}.get(rope_type, rope_type)
    if rope_type == "longrope" and raw.get("original_max_position_embeddings"):
        # Phi-3 keeps it beside the rope parameters, and transformers reads it from there
        scaling["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    if rope_type == "default":  # keeps only what is not scaling
        scaling = {k: v for k, v in scaling.items() if k == "partial_rotary_factor"}
    else:
        scaling["rope_type"] = rope_type
    return float(params.get("rope_theta", 10000.0)), scaling, local_theta


def _layer_windows(architecture: str, raw: dict, num_layers: int) -> tuple[int, ...]:
    """Per layer, its sliding window (0: global attention). transformers 5 configs list
    `layer_types`; older ones imply them per family."""
    window = int(raw.get("sliding_window") or 0)
    if architecture.startswith("Qwen") and not raw.get("use_sliding_window", False):
        window = 0
    if not window:
        return ()
    types = raw.get("layer_types")
    if types is None:
        if architecture == "Gemma2ForCausalLM":
            types = ["sliding_attention" if (i + 1) % 2 else "full" for i in range(num_layers)]
        elif architecture == "Gemma3ForCausalLM":
            pattern = int(raw.get("sliding_window_pattern") or 6)
            types = [
                "sliding_attention" if (i + 1) % pattern else "full" for i in range(num_layers)
            ]
        elif architecture.startswith("Qwen"):
            first = int(raw.get("max_window_layers") or 0)
            types = ["sliding_attention" if i >= first else "full" for i in range(num_layers)]
        else:
            types = ["sliding_attention"] * num_layers
    return tuple(window if kind == "sliding_attention" else 0 for kind in types)


def _moe_layers(raw: dict, num_layers: int) -> tuple[bool, ...]:
    """Which layers route to experts: every one for Mixtral; Qwen3-MoE keeps `mlp_only_layers`
    dense and routes every `decoder_sparse_step`-th layer."""
    dense = set(raw.get("mlp_only_layers") or ())
    step = int(raw.get("decoder_sparse_step") or 1)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def auto_dtype(
    model_dir: Path, device_type: str, quantization: str | None = None, kernel_matmuls: bool = True
) -> str:
    """`--dtype auto`: the checkpoint's dtype (config.json's `torch_dtype` or `dtype`) on a
    GPU, bfloat16 only where the GPU supports it. On a CPU, bfloat16 weights and KV cache
    (fp32 activations) where they run at full speed (`cpu_runs_bf16`), else float32;
    quantized weights are made from float32 ones and keep float32 activations.
    `kernel_matmuls`: whether the C++ kernels run the matmuls (batch-invariant, `cpu`
    attention), not torch's."""
    if device_type != "cuda":
        return "bfloat16" if quantization is None and cpu_runs_bf16(kernel_matmuls) else "float32"
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    name = str(raw.get("torch_dtype") or raw.get("dtype") or "float32").removeprefix("torch.")
    if name == "bfloat16":
        import torch

        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return name if name in ("float16", "float32") else "float32"


def cpu_runs_bf16(kernel_matmuls: bool = True) -> bool:
    """Whether bf16 weights run at full speed on this CPU (said once in the log when not):
    - with AVX512-BF16, as dot products (twice the fp32 kernel's speed, half its bytes);
    - with AVX2 or AVX-512F alone, when the C++ kernels run the matmuls: their FMA chain
      widens the weights to fp32, so a batch runs as fast as fp32 and a single stream reads
      half the bytes. torch's bf16 matmul on such a CPU is another matter: many times slower
      than fp32 (docs/engine-speed.md)."""
    from shared.engine import native

    kernels = native.load()
    if kernels is None:
        reason = "C++ kernels not built"
    elif kernels.bf16_dot_product_kernel():
        return True
    elif not {"avx2", "avx512f"} & set(kernels.cpu_features()):
        reason = "the kernels have no AVX2 path here"
    elif kernel_matmuls:
        return True
    else:
        reason = "no AVX512-BF16, and torch runs the matmuls"
    log.info("dtype auto: float32 (%s)", reason)
    return False


def _eos_ids(model_dir: Path, raw: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present (it wins, as in HF), else config.json."""
    gen_path = model_dir / "generation_config.json"
    value = raw.get("eos_token_id")
    if gen_path.exists():
        value = json.loads(gen_path.read_text()).get("eos_token_id", value)
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)
