"""Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) into our fused
layout, refusing with `BadAdapter` whatever we cannot serve exactly.

Per layer and fused matrix (targets.py), one `LowRankPair`: A [M, r, in] — the A of each of
the matrix's M modules (q, k, v; gate, up; or the one of o_proj, down_proj), zeros where the
adapter leaves a module alone — and B [out, r], each output row's module's B times the
scaling, q's and k's rows interleaved for rope as the base's are. A row's product is then
`B[n] @ A[module of n] @ x`: PEFT's unmerged forward. A fused PEFT module (Phi-3's
qkv_proj, gate_up_proj) gives each module it spans its A.

The one subtle rule: scaling is lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora,
with `r` the config's, and every module's A must have that rank (rank_pattern and
alpha_pattern are refused rather than half-read).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from shared.engine.errors import BadAdapter
from shared.engine.lora.targets import Module, Target, module_bounds, modules, rope_spans
from shared.engine.model.rope import interleave_permutation
from shared.engine.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(slots=True, frozen=True)
class LowRankPair:
    """One fused matrix's share of an adapter."""

    a: torch.Tensor  # [M, r, in]: each module's A (zeros where absent)
    b: torch.Tensor  # [out, r]: each output row's B, scaled
    present: tuple[bool, ...]  # [M]: which modules the adapter changes


@dataclass(slots=True, frozen=True)
class AdapterWeights:
    """One adapter in our layout, on the host, in the engine's dtype."""

    name: str
    rank: int  # the config's r
    # per layer: fused matrix -> its pair; a matrix the adapter leaves alone is absent
    layers: list[dict[Target, LowRankPair]]


def read_adapter(
    name: str, path: Path, config: ModelConfig, max_rank: int, dtype: torch.dtype
) -> AdapterWeights:
    """The adapter at `path` for a base model of `config`; BadAdapter saying why not."""
    settings = _read_config(name, path, max_rank)
    rank = int(settings["r"])
    alpha = float(settings.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    pairs = _read_pairs(name, path, config, rank)
    layers: list[dict[Target, LowRankPair]] = [{} for _ in range(config.num_layers)]
    by_target: dict[tuple[int, Target], list[tuple[Module, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), (a, b) in pairs.items():
        by_target.setdefault((layer, module.target), []).append((module, a, b))
    bounds = module_bounds(config)
    for (layer, target), parts in by_target.items():
        edges = bounds[target]
        a = torch.zeros(len(edges) - 1, rank, parts[0][1].shape[1])  # [M, r, in]
        b = torch.zeros(edges[-1], rank)  # [out, r]
        present = [False] * (len(edges) - 1)
        for module, a_m, b_m in parts:
            first, stop = module.row_offset, module.row_offset + module.out_features
            for i in range(len(present)):
                if first <= edges[i] and edges[i + 1] <= stop:
                    if present[i]:
                        reason = "two of its modules change the same rows"
                        raise BadAdapter(f"adapter {name!r}: layer {layer} {target.name}: {reason}")
                    present[i] = True
                    a[i] = a_m
            b[first:stop] = b_m * scaling
        if target == Target.QKV:
            b = _interleave_rope_rows(b, config)
        layers[layer][target] = LowRankPair(
            a.to(dtype).contiguous(), b.to(dtype).contiguous(), tuple(present)
        )
    return AdapterWeights(name, rank, layers)


def _read_config(name: str, path: Path, max_rank: int) -> dict:
    file = path / CONFIG_FILE
    if not path.is_dir() or not file.is_file():
        raise BadAdapter(f"adapter {name!r}: no {CONFIG_FILE} in {path}")
    try:
        settings = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadAdapter(f"adapter {name!r}: {file} is not readable JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise BadAdapter(f"adapter {name!r}: {file} is not a JSON object")
    refusals = {
        "peft_type": settings.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(settings.get("use_dora")),
        "bias": settings.get("bias", "none") != "none",
        "modules_to_save": bool(settings.get("modules_to_save")),
        "rank_pattern": bool(settings.get("rank_pattern")),
        "alpha_pattern": bool(settings.get("alpha_pattern")),
        "fan_in_fan_out": bool(settings.get("fan_in_fan_out")),
    }
    for key, refused in refusals.items():
        if refused:
            value = settings.get(key)
            raise BadAdapter(f"adapter {name!r}: {key}={value!r} is not supported")
    rank = settings.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise BadAdapter(f"adapter {name!r}: r must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise BadAdapter(f"adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    alpha = settings.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise BadAdapter(f"adapter {name!r}: lora_alpha must be a number, not {alpha!r}")
    return settings


def _read_pairs(
    name: str, path: Path, config: ModelConfig, rank: int
) -> dict[tuple[int, Module], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A [r, in], B [out, r]) float32, every shape checked."""
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise BadAdapter(f"adapter {name!r}: no {WEIGHTS_FILE} in {path}")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise BadAdapter(f"adapter {name!r}: {file} is not a safetensors file ({exc})") from None
    known = modules(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match[2] not in known:
            raise BadAdapter(f"adapter {name!r}: tensor {key!r} is not a supported LoRA target")
        layer = int(match[1])
        if layer >= config.num_layers:
            reason = f"names layer {layer}; the base has {config.num_layers}"
            raise BadAdapter(f"adapter {name!r}: {key!r} {reason}")
        if not tensor.is_floating_point() or tensor.dim() != 2:
            raise BadAdapter(f"adapter {name!r}: {key!r} is not a float matrix")
        halves.setdefault((layer, match[2]), {})[match[3]] = tensor
    pairs = {}
    for (layer, module_name), half in halves.items():
        module = known[module_name]
        where = f"adapter {name!r}: layer {layer} {module_name}"
        if set(half) != {"A", "B"}:
            raise BadAdapter(f"{where}: lora_A and lora_B must both be present")
        if module.target in (Target.GATE_UP, Target.DOWN) and config.is_moe_layer(layer):
            raise BadAdapter(f"{where}: the base's layer {layer} has experts, not a dense MLP")
        a, b = half["A"], half["B"]
        want_a, want_b = (rank, module.in_features), (module.out_features, rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise BadAdapter(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                f"base model (want {want_a} and {want_b}, r={rank})"
            )
        pairs[(layer, module)] = (a.float(), b.float())
    if not pairs:
        raise BadAdapter(f"adapter {name!r}: {file} holds no LoRA weights")
    return pairs


def _interleave_rope_rows(b: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """q's and k's rows of a fused qkv B, from HF's half-split head layout to ours."""
    d = config.head_dim
    perm = interleave_permutation(d, config.rotated_dims)
    b = b.clone()
    for first, heads in rope_spans(config):
        block = b[first : first + heads * d]
        b[first : first + heads * d] = block.view(heads, d, -1)[:, perm].reshape(block.shape)
    return b
