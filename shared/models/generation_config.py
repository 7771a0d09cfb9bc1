"""A model's own sampling defaults, from its `generation_config.json`.

A request that leaves temperature, top_p, top_k, min_p or repetition_penalty out gets the
model's value (as vLLM does, whatever `do_sample` says); without the file, or for a key it
does not set, the OpenAI defaults. EOS ids from the same file are read by the engine
(model_config.py). The gateway imports this module: no torch, no transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from shared.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0


def load_sampling_defaults(model_dir: Path) -> SamplingDefaults:
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return SamplingDefaults()
    raw = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a JSON object")
    values = {}
    for f in fields(SamplingDefaults):
        value = raw.get(f.name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            values[f.name] = int(value) if f.type == "int" else float(value)
    return SamplingDefaults(**values)
