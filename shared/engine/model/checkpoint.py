"""The tensors of a safetensors checkpoint, read one at a time and cast to the engine's dtype.

A sharded checkpoint lists its files in `model.safetensors.index.json` (its `weight_map`);
otherwise every `*.safetensors` file of the directory is read. bf16 / fp16 / fp32 files all
load into the chosen dtype; a norm that a family offsets (Gemma's 1 + w) gets its offset in
fp32 before the cast. A matrix that `pull` kept quantized (its file's metadata lists it under
QUANT_METADATA) is read by `take_linear` as it is stored, into a `GroupQuantLinear`.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from shared.engine.model.group_quant import ARRAY_NAMES, GroupQuantLinear
from shared.models.gguf_quant import QUANT_METADATA

INDEX = "model.safetensors.index.json"


def quantized_formats(model_dir: Path) -> list[str]:
    """The formats a checkpoint keeps quantized, read from its files' headers alone."""
    formats: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            listed = (handle.metadata() or {}).get(QUANT_METADATA)
        formats |= {str(p.get("format")) for p in json.loads(listed or "{}").values()}
    return sorted(formats)


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
        self.quantized: dict[str, dict[str, int | str]] = {}  # name -> layout parameters
        for path in checkpoint_files(model_dir):
            handle = self._files.enter_context(safe_open(str(path), framework="pt"))
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                self._where[name] = handle
            listed = (handle.metadata() or {}).get(QUANT_METADATA)
            if listed:
                self.quantized |= json.loads(listed)
        self._formats = dict(self.quantized)  # as listed, before take_linear takes them

    @property
    def quantized_formats(self) -> list[str]:
        """The formats of the matrices kept quantized, once each ([]: a float checkpoint)."""
        return sorted({str(p.get("format")) for p in self._formats.values()})

    def has(self, name: str) -> bool:
        return name in self._where or name in self.quantized

    def take_linear(self, name: str) -> torch.Tensor | GroupQuantLinear:
        """A matrix as `take` gives it, or as stored where it is kept quantized (CPU only)."""
        params = self.quantized.pop(name, None)
        if params is None:
            return self.take(name)
        parts = {
            # a copy: a tensor over the file's mapping keeps all of it mapped (and resident)
            part: self._where.pop(f"{name}.{part}").get_tensor(f"{name}.{part}").clone()
            for part in ARRAY_NAMES
            if f"{name}.{part}" in self._where
        }
        try:
            return GroupQuantLinear.from_tensors(params, parts)
        except ValueError as e:
            raise ValueError(f"{self.model_dir}: quantized tensor {name}: {e}") from None

    def take(self, name: str, offset: float = 0.0) -> torch.Tensor:
        """The tensor `name` (+ offset), in the engine's dtype on its device; taken once."""
        if name in self.quantized:
            raise ValueError(
                f"{self.model_dir}: {name} is stored quantized "
                f"({self.quantized[name].get('format')}) where a float tensor is needed"
            )
        try:
            handle = self._where.pop(name)
        except KeyError:
            raise KeyError(f"{self.model_dir}: tensor {name} is missing") from None
        tensor = handle.get_tensor(name)
        if offset:
            tensor = tensor.float() + offset
        # beside quantized matrices the residual stream is fp32: norms and biases load fp32
        dtype = torch.float32 if self._formats and tensor.dim() == 1 else self.dtype
        return tensor.to(device=self.device, dtype=dtype, copy=True)  # off the file's mapping

    def discard(self, name: str) -> None:
        self._where.pop(name, None)

    def check_all_used(self) -> None:
        """Raises on tensors the model never took (a layout we do not understand); closes."""
        unused = [name for name in self._where if "rotary_emb" not in name]
        unused += sorted(self.quantized)
        self._files.close()
        if unused:
            raise ValueError(f"{self.model_dir}: unexpected tensors {unused[:5]}")
