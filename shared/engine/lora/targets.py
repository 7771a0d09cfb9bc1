"""Where a PEFT module lands in our fused layout (model/weights.py): q, k and v in `qkv`,
gate and up in `gate_up`, o_proj and down_proj as they are.

The one rule: a module's rows sit at the same offsets as the base matrix's rows for that
module, and q's and k's rows are interleaved per head for rope as the base's are; its LoRA
product is then added to exactly the outputs the base matrix makes for that module.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from shared.engine.model_config import ModelConfig


class Target(IntEnum):
    """A layer's fused matrices that adapters may change."""

    QKV = 0
    O_PROJ = 1
    GATE_UP = 2
    DOWN = 3


@dataclass(slots=True, frozen=True)
class Module:
    """One PEFT target module: the fused matrix it is part of and the rows it fills there."""

    target: Target
    in_features: int
    row_offset: int  # its first output row in the fused matrix
    out_features: int


def modules(config: ModelConfig) -> dict[str, Module]:
    """PEFT module name -> where it lands; Phi-3's fused qkv_proj and gate_up_proj too."""
    hidden, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q_rows, kv_rows = config.num_heads * d, config.num_kv_heads * d
    qkv, gate_up = Target.QKV, Target.GATE_UP
    return {
        "q_proj": Module(qkv, hidden, 0, q_rows),
        "k_proj": Module(qkv, hidden, q_rows, kv_rows),
        "v_proj": Module(qkv, hidden, q_rows + kv_rows, kv_rows),
        "qkv_proj": Module(qkv, hidden, 0, q_rows + 2 * kv_rows),
        "o_proj": Module(Target.O_PROJ, q_rows, 0, hidden),
        "gate_proj": Module(gate_up, hidden, 0, inter),
        "up_proj": Module(gate_up, hidden, inter, inter),
        "gate_up_proj": Module(gate_up, hidden, 0, 2 * inter),
        "down_proj": Module(Target.DOWN, inter, 0, hidden),
    }


def rope_spans(config: ModelConfig) -> list[tuple[int, int]]:
    """(first row, heads) of the rope-rotated head groups in the fused qkv: q's, then k's."""
    q_rows = config.num_heads * config.head_dim
    return [(0, config.num_heads), (q_rows, config.num_kv_heads)]


def module_bounds(config: ModelConfig) -> dict[Target, tuple[int, ...]]:
    """Each fused matrix's modules as row bounds: module i has rows [b[i], b[i + 1]) (q, k
    and v in qkv; gate and up in gate_up). A fused PEFT module (Phi-3's) spans several."""
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter, hidden = config.intermediate_size, config.hidden_size
    return {
        Target.QKV: (0, q_rows, q_rows + kv_rows, q_rows + 2 * kv_rows),
        Target.O_PROJ: (0, hidden),
        Target.GATE_UP: (0, inter, 2 * inter),
        Target.DOWN: (0, hidden),
    }
