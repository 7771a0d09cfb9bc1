"""The tensors of a safetensors checkpoint, read one at a time and cast to the engine's dtype.

A sharded checkpoint lists its files in `model.safetensors.index.json` (its `weight_map`);
otherwise every `*.safetensors` file of the directory is read. bf16 / fp16 / fp32 files all
load into the chosen dtype; a norm that a family offsets (Gemma's 1 + w) gets its offset in
fp32 before the cast.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{model_dir}: shards {missing[:3]} of {INDEX} are missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors file")
    return files


class Checkpoint:
    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> None:
        self.model_dir, self.dtype, self.device = model_dir, dtype, device
        self._files = ExitStack()
        self._where = {}
        for path in checkpoint_files(model_dir):
            handle = self._files.enter_context(safe_open(str(path), framework="pt"))
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                self._where[name] = handle

    def has(self, name: str) -> bool:
        return name in self._where

    def take(self, name: str, offset: float = 0.0) -> torch.Tensor:
        """The tensor `name` (+ offset), in the engine's dtype on its device; taken once."""
        try:
            handle = self._where.pop(name)
        except KeyError:
            raise KeyError(f"{self.model_dir}: tensor {name} is missing") from None
        tensor = handle.get_tensor(name)
        if offset:
            tensor = tensor.float() + offset
        return tensor.to(device=self.device, dtype=self.dtype)

    def discard(self, name: str) -> None:
        self._where.pop(name, None)

    def check_all_used(self) -> None:
        """Raises on tensors the model never took (a layout we do not understand); closes."""
        unused = [name for name in self._where if "rotary_emb" not in name]
        self._files.close()
        if unused:
            raise ValueError(f"{self.model_dir}: unexpected tensors {unused[:5]}")
